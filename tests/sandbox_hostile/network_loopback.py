# expect: attack failed
import socket, sys
port = int(sys.stdin.read())
try:
    socket.create_connection(('127.0.0.1', port), timeout=2)
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
print('connected to the host')
