# expect: output limit
import sys
while True:
    sys.stderr.write('e' * 65536)
