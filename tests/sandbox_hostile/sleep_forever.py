# expect: wall time limit
import time
time.sleep(3600)
