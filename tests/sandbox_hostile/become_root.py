# expect: attack failed
import os
try:
    os.setuid(0)
    os.setgid(0)
    open('/usr/rooted', 'w')
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
