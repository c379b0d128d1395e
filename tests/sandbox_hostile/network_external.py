# expect: attack failed
import socket
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2)
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
