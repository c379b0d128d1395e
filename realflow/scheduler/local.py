"""Local launcher: runs every worker of a job as an OS process on this host.

Guarantees, because a half-dead job that keeps GPUs or ports busy is worse than a
dead one:

* If any worker exits non-zero or is killed, ``wait`` stops all others and raises
  ``WorkerFailed`` naming the worker, its exit code or signal, and its last log lines.
* ``stop_all`` ends everything within ``grace`` + a few seconds: SIGTERM to each
  worker's process group (and to descendants that left the group), SIGKILL after
  ``grace``.
* Ctrl-C (SIGINT) or SIGTERM to the launcher during ``wait`` stops all workers, then
  the KeyboardInterrupt propagates.
* No orphans when the launcher itself dies, even by SIGKILL, in two layers:
  each worker has PR_SET_PDEATHSIG=SIGTERM (set with prctl in a preexec function),
  and a small watchdog process (``_reaper.py``, own session, reads a pipe from the
  launcher) sees the pipe close and kills every worker process group, so workers'
  own children die too.

Every worker runs in its own session/process group, writes stdout+stderr to
``<log_dir>/<name>.log``, and gets OMP/MKL/REALFLOW_NUM_THREADS = ``n_threads`` so
that N workers on one host do not each start one thread per core.

Descendants that leave their worker's process group (setsid) are found through
parent links: at stop time, and by a /proc scan every few seconds while waiting
(launcher) or watching (watchdog), so that they are remembered even after their
parent died. Not covered: a child that leaves the group *and* loses its parent
within one scan interval (a classic double-fork daemon): nothing links it to the
job any more. Workers must not daemonize helpers; run them as submitted workers.
(Closing that gap needs a subreaper or cgroups; a process-wide subreaper would also
adopt children of unrelated code in the launcher process.)

Limits: Linux only. Fork-based multiprocessing in the launcher process delays
the watchdog (forked children inherit the pipe).
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence, TextIO

from realflow.base.logging import get_logger
from realflow.base.timeutil import Deadline, format_seconds
from realflow.scheduler.base import WatchLoop, WorkerFailed, WorkerRequest, describe_exit, read_log_tail  # noqa: F401 (re-exported)
from realflow.scheduler.console import ConsoleTail
from realflow.scheduler.proc import (
    descendants,
    group_members,
    make_child_setup,
    same_process_alive,
)

logger = get_logger("realflow.scheduler")

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "REALFLOW_NUM_THREADS")
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(/[A-Za-z0-9_\-][A-Za-z0-9_.\-]*)*$")
_REAPER = Path(__file__).with_name("_reaper.py")
STRAY_SCAN_INTERVAL = 2.0  # seconds between /proc scans for workers' setsid descendants


@dataclasses.dataclass
class _Worker:
    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path
    returncode: int | None = None
    group_gone: bool = False  # its process group was seen empty: never signal that pgid again
    service: bool = False  # serves the others: the job is done without it exiting
    expendable: bool = False  # its death is logged, not fatal (its users fail over)
    restarts_left: int = 0  # an expendable worker that dies is started again this many more times
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | os.PathLike | None = None
    starts: int = 1

    @property
    def pid(self) -> int:
        return self.popen.pid


class LocalScheduler(WatchLoop):
    """Starts, watches and stops worker processes on this host (see module docstring)."""

    def __init__(self, log_dir: str | os.PathLike, console: bool = True,
                 console_stream: TextIO | None = None, grace: float = 5.0, tail_lines: int = 20) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace = grace
        self.tail_lines = tail_lines
        self._workers: dict[str, _Worker] = {}
        self._console = ConsoleTail(console_stream) if console else None
        self._reaper: subprocess.Popen | None = None
        self._strays: dict[int, int] = {}  # pid -> start time of workers' out-of-group descendants
        self._last_scan = 0.0
        self._lost_expendable: set[str] = set()  # expendable workers already reported dead
        self._lock = threading.RLock()
        self._closed = False

    # ---- starting -------------------------------------------------------------------
    def submit(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
               n_threads: int = 1, cwd: str | os.PathLike | None = None, *, service: bool = False,
               expendable: bool = False, restarts: int = 0) -> int:
        """Start worker ``name`` running ``argv``; returns its pid.

        ``env`` is added to this process's environment. The thread variables
        (OMP/MKL/OPENBLAS/REALFLOW_NUM_THREADS) come from ``n_threads`` and must not be
        set differently in ``env``. REALFLOW_ROLE is set to ``name`` for log lines.
        A ``service`` (e.g. a generation server) runs until the other workers are done
        and is then stopped; an ``expendable`` service may die without failing the job
        (its death is logged with its exit and last log lines; its clients fail over), and
        is started again, with the same command, up to ``restarts`` times (a replacement
        generation server rejoins its controller; the run never stops for it).
        """
        if self._closed:
            raise RuntimeError("LocalScheduler is closed")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"worker name {name!r} must be '/'-separated parts of letters, digits, '_', '.', '-' "
                "(not starting with '.')"
            )
        if name in self._workers:
            raise ValueError(f"worker name '{name}' was already submitted")
        argv = list(argv) if not isinstance(argv, str) else None  # type: ignore[assignment]
        if not argv:
            raise ValueError(f"argv of worker '{name}' must be a non-empty list of str")
        for i, a in enumerate(argv):
            if not isinstance(a, str):
                raise TypeError(f"argv[{i}] of worker '{name}' must be a str, got {type(a).__name__}: {a!r}")
        if not isinstance(n_threads, int) or isinstance(n_threads, bool) or n_threads < 1:
            raise ValueError(f"n_threads of worker '{name}' must be an int >= 1, got {n_threads!r}")
        child_env = dict(os.environ)
        for k, v in (env or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"env of worker '{name}': {k!r}={v!r} must map str to str")
            if k in THREAD_ENV_VARS and v != str(n_threads):
                raise ValueError(f"env of worker '{name}' sets {k}={v}; use n_threads= instead")
            child_env[k] = v
        child_env.update({k: str(n_threads) for k in THREAD_ENV_VARS})
        child_env["REALFLOW_ROLE"] = name
        child_env["PYTHONUNBUFFERED"] = "1"  # log lines appear when written, and survive a kill

        log_path = self.log_dir / f"{name}.log"  # 'model_worker/3' -> <log_dir>/model_worker/3.log
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._start_reaper()
            with open(log_path, "wb") as log_file:
                try:
                    popen = subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                        env=child_env, cwd=cwd, start_new_session=True,
                        preexec_fn=make_child_setup(os.getpid()),
                    )
                except (FileNotFoundError, PermissionError) as e:
                    raise RuntimeError(f"cannot start worker '{name}': {argv[0]!r}: {e.strerror}") from None
            self._workers[name] = _Worker(name, argv, popen, log_path, service=service or expendable,
                                          expendable=expendable, restarts_left=restarts if expendable else 0,
                                          env=child_env, cwd=cwd)
            self._tell_reaper(f"+ {popen.pid}")
        if self._console is not None:
            self._console.add(name, log_path)
        logger.info("started worker %s (pid %d, %d threads), log %s", name, popen.pid, n_threads, log_path)
        return popen.pid

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_REAPER), str(self.grace)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )

    def _tell_reaper(self, line: str) -> None:
        if self._reaper is not None and self._reaper.stdin is not None:
            try:
                self._reaper.stdin.write((line + "\n").encode())
                self._reaper.stdin.flush()
            except (BrokenPipeError, ValueError):
                logger.warning("process watchdog (pid %d) is gone", self._reaper.pid)

    def start(self, requests: Sequence["WorkerRequest"]) -> None:
        """Start every process of a run (see :mod:`realflow.scheduler.base`)."""
        for r in requests:
            self.submit(r.name, r.argv, env=r.env, n_threads=r.n_threads, service=r.service,
                        expendable=r.expendable, restarts=r.restarts)

    # ---- watching -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._workers)

    def pid(self, name: str) -> int:
        try:
            return self._workers[name].pid
        except KeyError:
            raise KeyError(f"no worker named '{name}'; workers: {', '.join(self._workers) or 'none'}") from None

    @property
    def reaper_pid(self) -> int | None:
        return None if self._reaper is None else self._reaper.pid

    def log_path(self, name: str) -> Path:
        self.pid(name)  # names the culprit if unknown
        return self._workers[name].log_path

    def poll(self) -> dict[str, int | None]:
        """``{name: returncode or None while running}`` (negative: killed by that signal)."""
        out = {}
        for w in self._workers.values():
            if w.returncode is None:
                w.returncode = w.popen.poll()
            out[w.name] = w.returncode
        return out

    def _while_running(self) -> None:
        if time.monotonic() - self._last_scan > STRAY_SCAN_INTERVAL:
            self._remember_strays()

    def _note_expendable(self, dead: list[str]) -> None:
        for n in dead:
            if n not in self._lost_expendable:
                self._lost_expendable.add(n)
                w = self._workers[n]
                tail = "\n".join(f"    | {ln}" for ln in read_log_tail(w.log_path, 5))
                logger.warning("expendable worker %s (pid %d) %s; the job goes on. Last lines of %s:\n%s",
                               n, w.pid, describe_exit(w.returncode), w.log_path, tail)
                if w.restarts_left > 0:
                    self._respawn(w)

    def _respawn(self, w: _Worker) -> None:
        """Start a dead expendable worker again with the same command (its own new log file)."""
        with self._lock:
            if self._closed:
                return
            self.stop_group(w)
            w.restarts_left -= 1
            w.starts += 1
            w.log_path = w.log_path.with_name(f"{w.log_path.stem}.restart{w.starts - 1}.log")
            with open(w.log_path, "wb") as log_file:
                w.popen = subprocess.Popen(
                    w.argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env=w.env, cwd=w.cwd, start_new_session=True, preexec_fn=make_child_setup(os.getpid()))
            w.returncode, w.group_gone = None, False
            self._lost_expendable.discard(w.name)
            self._tell_reaper(f"+ {w.popen.pid}")
        if self._console is not None:
            self._console.add(w.name, w.log_path)
        logger.warning("restarted worker %s (pid %d, start %d), log %s", w.name, w.pid, w.starts, w.log_path)

    def stop_group(self, w: _Worker) -> None:
        """Kill what is left of a dead worker's process group (its children) before replacing it."""
        if w.group_gone:
            return
        members = group_members([w.pid]).get(w.pid, set())
        if members:
            self._signal([w.pid], {}, signal.SIGKILL)
            self._wait_gone([w.pid], {}, 5.0)
        w.group_gone = True
        self._tell_reaper(f"- {w.pid}")

    def _remember_strays(self) -> None:
        self._last_scan = time.monotonic()
        leaders = {w.pid for w in self._workers.values() if w.returncode is None}
        self._strays = {p: t for p, t in self._strays.items() if same_process_alive(p, t)}
        self._strays.update(descendants(leaders))

    # ---- stopping -------------------------------------------------------------------
    def stop_all(self, grace: float | None = None) -> None:
        """SIGTERM every worker's process group, SIGKILL after ``grace`` s; wait until gone."""
        grace = self.grace if grace is None else grace
        with self._lock, _sigint_deferred():
            # A pgid whose group is empty may be reused by an unrelated process: skip it.
            workers = [w for w in self._workers.values() if not w.group_gone]
            if not workers:
                return
            pgids = [w.pid for w in workers]  # session leaders: pgid == pid
            leaders = [w.pid for w in workers if w.popen.poll() is None]
            strays = {**self._strays, **descendants(leaders)}  # also those that left the group
            if self._alive(pgids, strays):
                self._signal(pgids, strays, signal.SIGTERM)
                # a stopped (SIGSTOP, or hung in a debugger) process acts on SIGTERM only once continued
                self._signal(pgids, strays, signal.SIGCONT)
                self._wait_gone(pgids, strays, grace)
            if self._alive(pgids, strays):
                left = self._alive(pgids, strays)
                logger.warning("sending SIGKILL to %d processes still alive after %s",
                               len(left), format_seconds(grace))
                self._signal(pgids, strays, signal.SIGKILL)
                self._wait_gone(pgids, strays, 5.0)
            for w in workers:
                if w.returncode is None:
                    try:
                        w.returncode = w.popen.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        pass
            left = self._alive(pgids, strays)
            if left:
                logger.error("processes still alive after SIGKILL (uninterruptible?): %s", sorted(left))
            self._strays = {p: t for p, t in strays.items() if p in left}
            if not left:
                for w in workers:
                    if w.returncode is not None:
                        w.group_gone = True
                        self._tell_reaper(f"- {w.pid}")

    @staticmethod
    def _alive(pgids: Sequence[int], strays: dict[int, int]) -> set[int]:
        members = group_members(pgids)
        return ({p for ps in members.values() for p in ps}
                | {p for p, start in strays.items() if same_process_alive(p, start)})

    @staticmethod
    def _signal(pgids: Sequence[int], strays: dict[int, int], sig: int) -> None:
        for g in pgids:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p, start in strays.items():
            if not same_process_alive(p, start):
                continue  # gone, or the pid now belongs to someone else
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_gone(self, pgids: Sequence[int], strays: dict[int, int], timeout: float) -> None:
        deadline = Deadline(timeout)
        while not deadline.expired():
            for w in self._workers.values():  # reap leaders so they do not linger as zombies
                if w.returncode is None:
                    w.returncode = w.popen.poll()
            if not self._alive(pgids, strays):
                return
            deadline.sleep(0.05)

    def close(self) -> None:
        """Stop all workers, the watchdog and the console. Idempotent."""
        if self._closed:
            return
        self.stop_all()
        self._closed = True
        if self._reaper is not None:
            if self._reaper.stdin is not None:
                self._reaper.stdin.close()  # EOF: the watchdog finds nothing left and exits
            try:
                self._reaper.wait(timeout=self.grace + 5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
        if self._console is not None:
            self._console.stop()

    def __enter__(self) -> "LocalScheduler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _sigint_deferred:
    """While stopping, a second Ctrl-C must not abort the cleanup half-way."""

    def __enter__(self) -> None:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(
                signal.SIGINT, lambda s, f: logger.warning("already stopping workers; please wait")
            )

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
