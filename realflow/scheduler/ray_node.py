"""What runs inside each Ray actor of ``launcher=ray`` (see :mod:`realflow.scheduler.ray`).

Kept apart from the driver side so that the actor's process imports only this and the
local scheduler. The actor runs its worker as a child process through a LocalScheduler,
so the worker gets the local launcher's guarantees on its node. Ray runs a sync actor's
methods on the actor's main thread; that matters because PR_SET_PDEATHSIG fires when the
*thread* that forked the child ends, so ``start`` checks it.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from realflow.scheduler.local import _REAPER, LocalScheduler, WorkerFailed

# ``python -c _DETACH REAPER GRACE`` runs the watchdog as a grandchild (see NodeScheduler)
_DETACH = ("import os, sys\n"
           "if os.fork():\n    os._exit(0)\n"
           "os.execv(sys.executable, [sys.executable, '-I', '-S'] + sys.argv[1:])")


class NodeScheduler(LocalScheduler):
    """A LocalScheduler whose watchdog is not a child of the actor.

    An actor that exits (as all of a driver's actors do when the launcher dies) SIGKILLs its
    direct children (Ray's RAY_kill_child_processes_on_worker_exit): the worker, but also the
    watchdog, before it could stop the worker's own children. Started through a process that
    forks and exits, the watchdog is out of that reach and still holds the pipe.
    """

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _DETACH, str(_REAPER), str(self.grace)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )


class NodeRunner:
    """Body of the Ray actor: runs one worker as its child process, on the actor's node."""

    def __init__(self, log_dir: str, grace: float) -> None:
        self._log_dir, self._grace = log_dir, grace
        self._sched = NodeScheduler(log_dir, console=False, grace=grace)
        self._name, self._current, self._starts = "", "", 0
        self._args: tuple = ()

    def start(self, name: str, argv: list[str], env: dict[str, str], n_threads: int,
              cwd: str) -> tuple[int, str]:
        """Start the worker; returns (pid, host name)."""
        if threading.current_thread() is not threading.main_thread():  # see module docstring
            raise RuntimeError("the actor must start its worker from its main thread (pdeathsig)")
        host = socket.gethostname()
        if not os.path.isdir(cwd):
            raise RuntimeError(f"the launcher's working directory {cwd} does not exist on {host}")
        self._name, self._args = name, (argv, env, n_threads, cwd)
        return self._submit(name), host

    def _submit(self, name: str) -> int:
        argv, env, n_threads, cwd = self._args
        pid = self._sched.submit(name, argv, env=env, n_threads=n_threads, cwd=cwd)  # REALFLOW_ROLE=name
        self._current, self._starts = name, self._starts + 1
        return pid

    def restart(self) -> tuple[int, str]:
        """Start the dead worker again, same command; its log is ``<name>.restart<k>.log``.
        Returns (pid, that name)."""
        self._sched.close()  # what is left of the dead worker's process group, and its watchdog
        self._sched = NodeScheduler(self._log_dir, console=False, grace=self._grace)
        name = f"{self._name}.restart{self._starts}"
        return self._submit(name), name

    def poll(self) -> int | None:
        """The worker's return code, or None while it runs (also scans for its setsid children)."""
        try:
            if not self._sched.wait(timeout=0):
                return None
        except WorkerFailed as e:
            return e.returncode
        return self._sched.poll()[self._current]

    def stop(self, grace: float) -> int | None:
        """SIGTERM the worker's process group, SIGKILL after ``grace``; its return code."""
        self._sched.stop_all(grace)
        rc = self._sched.poll().get(self._current)
        self._sched.close()
        return rc
