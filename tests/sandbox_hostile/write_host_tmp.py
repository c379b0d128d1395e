# expect: attack failed
open('/tmp/rf_sandbox_escape_marker', 'w').write('escaped')
import os
raise SystemExit('attack failed: /tmp is the sandbox own tmpfs' if os.path.exists('/tmp/rf_sandbox_escape_marker') else 'odd')
