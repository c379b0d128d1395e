# expect: No space left|file size limit|killed by SIGXFSZ
with open('/tmp/fill', 'wb') as f:
    while True:
        f.write(b'y' * (1 << 20))
