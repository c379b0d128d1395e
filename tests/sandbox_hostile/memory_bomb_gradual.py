# expect: memory limit
chunks = []
while True:
    chunks.append(bytearray(16 << 20))
