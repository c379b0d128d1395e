"""Process inspection and child setup, from /proc and prctl (no psutil).

Linux only, like the rest of the launcher: it relies on process groups, /proc and
``prctl(PR_SET_PDEATHSIG)``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from typing import Callable, Iterable

from realflow.base.procfs import pid_alive, proc_stat as _stat  # noqa: F401 (re-exported)

PR_SET_PDEATHSIG = 1

# Resolved in the parent: the preexec function runs between fork and exec, where
# loading a library (taking locks another thread may hold) is unsafe.
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl


def _all_stats() -> dict[int, tuple[str, int, int, int, int]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                out[int(entry)] = st
    return out


def group_members(pgids: Iterable[int]) -> dict[int, list[int]]:
    """Live (non-zombie) pids of each process group in ``pgids``."""
    wanted = {int(g): [] for g in pgids}
    if not wanted:
        return {}
    for pid, (state, _ppid, pgid, _sid, _start) in _all_stats().items():
        if pgid in wanted and state not in ("Z", "X"):
            wanted[pgid].append(pid)
    return wanted


def descendants(roots: Iterable[int]) -> dict[int, int]:
    """Live descendants of ``roots`` (not the roots) as ``{pid: start time}``.

    Found by parent links, so this also finds children that left their parent's
    process group (setsid/setpgid) - while their parent is alive to link them.
    The start time tells a remembered pid from a later process that reused it.
    """
    children: dict[int, list[int]] = {}
    table = _all_stats()
    for pid, st in table.items():
        children.setdefault(st[1], []).append(pid)
    out: dict[int, int] = {}
    stack = list(roots)
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out[c] = table[c][4]
                stack.append(c)
    return {p: t for p, t in out.items() if table[p][0] not in ("Z", "X")}


def same_process_alive(pid: int, start_time: int) -> bool:
    """True if ``pid`` runs and is the process that had ``start_time`` (not a reuse)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X") and st[4] == start_time


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def make_child_setup(launcher_pid: int, death_signal: int = signal.SIGTERM) -> Callable[[], None]:
    """preexec_fn that makes the child receive ``death_signal`` when the launcher dies.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so submit
    workers from a long-lived thread (normally the main thread). If the launcher
    died before the prctl took effect, the child exits at once.
    """

    def setup() -> None:
        _prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        if os.getppid() != launcher_pid:
            os._exit(1)

    return setup


def terminate_all(procs: Iterable[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each process still running, SIGKILL it after ``grace`` seconds, reap it."""
    for p in procs:
        if p.poll() is not None:
            continue
        p.terminate()
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
