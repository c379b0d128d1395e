# expect: memory limit|process limit|killed by|exit code
import os
for _ in range(64):
    if os.fork() == 0:
        x = [bytearray(64 << 20) for _ in range(64)]
        os._exit(0)
os.wait()
raise SystemExit('attack failed: children could not hold the memory')
