# expect: attack failed
import os
try:
    os.chroot('/tmp')
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
