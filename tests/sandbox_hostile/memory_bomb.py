# expect: memory limit
x = bytearray(4 << 30)
