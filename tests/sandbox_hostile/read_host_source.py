# expect: attack failed
import os
hits = [p for p in ('/work', '/root', '/home', '/etc/passwd', '/etc/shadow', '/var') if os.path.exists(p)]
if hits:
    print('visible:', hits)
    raise SystemExit(0)
raise SystemExit('attack failed: no host files visible')
