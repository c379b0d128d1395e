"""Process liveness from /proc (Linux), shared by the launcher and the shared-memory janitor."""
from __future__ import annotations

import os

__all__ = ["proc_stat", "pid_alive"]


def proc_stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """(state, ppid, pgid, sid, starttime) of ``pid`` from /proc/<pid>/stat, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (dead, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")
