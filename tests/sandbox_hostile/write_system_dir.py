# expect: attack failed
try:
    open('/usr/lib/evil.py', 'w').write('x')
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
