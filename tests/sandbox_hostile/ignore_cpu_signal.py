# expect: CPU time limit|killed by SIGKILL|wall time limit
import signal
signal.signal(signal.SIGXCPU, signal.SIG_IGN)
while True:
    pass
