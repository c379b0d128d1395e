# expect: attack failed
try:
    print(open('/etc/shadow').read())
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
