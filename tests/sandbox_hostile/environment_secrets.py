# expect: attack failed
import os
leaked = {k: v for k, v in os.environ.items() if 'SECRET' in k or 'TOKEN' in k or 'KEY' in k or 'REALFLOW' in k}
if leaked:
    print(leaked)
    raise SystemExit(0)
raise SystemExit('attack failed: environment holds ' + ', '.join(sorted(os.environ)))
