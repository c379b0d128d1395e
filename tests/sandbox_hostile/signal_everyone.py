# expect: killed by SIGKILL|attack failed
import os, signal
try:
    os.kill(-1, signal.SIGKILL)  # every process this one may signal
except OSError as e:
    raise SystemExit(f"attack failed: {e} (only this sandbox's processes are visible)")
raise SystemExit("attack failed: still here")
