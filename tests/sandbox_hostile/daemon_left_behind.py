# expect: attack failed
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
        os._exit(0)
    os._exit(0)
time.sleep(0.2)
raise SystemExit('attack failed? a daemon was started (the test checks that it died)')
