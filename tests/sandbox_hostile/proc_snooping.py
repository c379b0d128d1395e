# expect: attack failed
import os
others = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()
    except OSError:
        continue
    if b'pytest' in cmd or b'realflow' in cmd or b'main.py' not in cmd and b'bwrap' not in cmd:
        others.append(cmd)
if others:
    print(others)
    raise SystemExit(0)
raise SystemExit('attack failed: only this sandbox is visible in /proc')
