# expect: process limit|killed by
import os, time
for _ in range(10000):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
