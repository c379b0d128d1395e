# expect: attack failed|exit code
import subprocess
r = subprocess.run('cat /etc/shadow; ls /root /work', shell=True, capture_output=True, text=True)
if r.returncode == 0 and r.stdout:
    print(r.stdout)
    raise SystemExit(0)
raise SystemExit('attack failed: ' + (r.stderr.strip().splitlines() or ['nothing'])[-1])
