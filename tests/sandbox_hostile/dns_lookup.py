# expect: attack failed
import socket
try:
    print(socket.getaddrinfo('pypi.org', 443))
except OSError as e:
    raise SystemExit(f'attack failed: {e}')
