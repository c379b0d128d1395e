# expect: No space left|exit code|wall time limit
i = 0
while True:
    open(f'/sandbox/f{i}', 'wb').write(b'x' * 65536)
    i += 1
