# expect: attack failed
import os, signal
for pid in (os.getppid(), 1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
raise SystemExit('attack failed: parent and init outlived SIGKILL')
