# expect: CPU time limit|killed by SIGKILL|wall time limit
import threading
def spin():
    while True:
        pass
for _ in range(8):
    threading.Thread(target=spin).start()
