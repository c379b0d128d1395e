"""Watchdog that cancels a launcher's Slurm job once the launcher is gone.

Run by path with ``python -I -S _slurm_watchdog.py`` (stdlib only, no realflow import),
in its own session so that Ctrl-C or a signal to the launcher's process group does not
reach it. Its stdin is a pipe whose only writer is the launcher:

    + <job id>    a job to cancel if the launcher dies
    - <job id>    the launcher cancelled it itself; forget it

End of file means the launcher exited or was killed (even by SIGKILL: the kernel closes
the pipe). The watchdog then runs ``scancel`` for every job still registered and exits.
Why: the job's placeholder batch script holds the allocation until its time limit, and
steps whose ``srun`` died may keep running; only the controller can end them.
"""
import signal
import subprocess
import sys
import time


def cancel(job):
    for attempt in range(3):
        try:
            res = subprocess.run(["scancel", job], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"scancel {job}: {e}", flush=True)
        else:
            if res.returncode == 0 or "Invalid job id" in res.stderr:
                print(f"cancelled Slurm job {job} (the launcher is gone)", flush=True)
                return
            print(f"scancel {job} failed (exit {res.returncode}): {res.stderr.strip()}", flush=True)
        time.sleep(2 * (attempt + 1))


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    jobs = []
    for raw in sys.stdin.buffer:
        op, _, job = raw.decode().strip().partition(" ")
        if op == "+" and job not in jobs:
            jobs.append(job)
        elif op == "-" and job in jobs:
            jobs.remove(job)
    for job in jobs:
        cancel(job)


if __name__ == "__main__":
    main()
