"""Watchdog that kills a launcher's workers once the launcher is gone.

Run by path with ``python -I -S _reaper.py GRACE`` (stdlib only, no realflow
import). It lives in its own session, ignores Ctrl-C/SIGHUP, and reads its stdin,
a pipe whose only writer is the launcher:

    + <pgid>    a worker's process group to watch (the worker is its leader)
    - <pgid>    that group is gone; forget it

End of file means the launcher exited or was killed (even by SIGKILL: the kernel
closes the pipe). The reaper then sends SIGTERM to every group still registered
and to every process it saw descending from a worker outside its group (children
that called setsid), waits up to GRACE seconds, sends SIGKILL, and exits.

Workers also get SIGTERM through PR_SET_PDEATHSIG; the reaper is what reaches
their children (the launcher's grandchildren) and escalates to SIGKILL. It scans
/proc every SCAN_INTERVAL seconds to remember descendants that left the worker's group, because
once their parent dies nothing links them to the job any more.
"""
import os
import select
import signal
import sys
import time

SCAN_INTERVAL = 2.0  # seconds between /proc scans for setsid descendants (cheap, bounded)


def _proc_table():
    """pid -> (state, ppid, pgid, starttime) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    return table


def _live(st):
    return st is not None and st[0] not in (b"Z", b"X")


def _strays(groups, table):
    """Descendants of registered workers that are outside every registered group."""
    children = {}
    for pid, st in table.items():
        children.setdefault(st[1], []).append(pid)
    out, stack = {}, [p for p in groups if p in table]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out[c] = table[c][3]  # remember the start time: pids get reused
                stack.append(c)
    return {p: t for p, t in out.items() if table[p][2] not in groups and _live(table[p])}


def _alive(groups, strays):
    table = _proc_table()
    left_groups = {g for g in groups if any(st[2] == g and _live(st) for st in table.values())}
    left_strays = {p: t for p, t in strays.items() if _live(table.get(p)) and table[p][3] == t}
    return left_groups, left_strays


def _signal(groups, strays, sig):
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in strays:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main():
    grace = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    fd = sys.stdin.fileno()
    groups, strays, buf = set(), {}, b""
    while True:
        ready, _, _ = select.select([fd], [], [], SCAN_INTERVAL)
        if not ready:
            if groups:
                strays.update(_strays(groups, _proc_table()))
            continue
        data = os.read(fd, 4096)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            op, _, arg = line.decode().strip().partition(" ")
            if op == "+":
                groups.add(int(arg))
            elif op == "-":
                groups.discard(int(arg))
    if groups:
        strays.update(_strays(groups, _proc_table()))
    groups, strays = _alive(groups, strays)
    if not groups and not strays:
        return
    _signal(groups, strays, signal.SIGTERM)
    _signal(groups, strays, signal.SIGCONT)  # a stopped process handles its SIGTERM only once continued
    end = time.monotonic() + grace
    while time.monotonic() < end:
        groups, strays = _alive(groups, strays)
        if not groups and not strays:
            return
        time.sleep(0.1)
    _signal(groups, strays, signal.SIGKILL)


if __name__ == "__main__":
    main()
