# expect: file size limit|No space left|killed by SIGXFSZ
with open('/sandbox/big', 'wb') as f:
    while True:
        f.write(b'x' * (1 << 20))
