"""What a launcher asks of a scheduler, whichever engine runs the processes.

The launcher describes every process of a run as a :class:`WorkerRequest` and hands the
whole list to a scheduler at once (``start``), so that a cluster scheduler can ask for all
resources in one job before anything runs (a Slurm heterogeneous job, Ray placement
groups). The local scheduler simply starts them. Afterwards every scheduler is watched the
same way: ``wait`` until the job is done (raising :class:`WorkerFailed` when a worker dies),
``stop_all`` to tear everything down.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from realflow.base.logging import get_logger
from realflow.base.timeutil import Deadline
from realflow.scheduler.proc import signal_name

logger = get_logger("realflow.scheduler")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal_name(-returncode)} ({-returncode})"
    return f"exited with code {returncode}"


def read_log_tail(path: str | Path, n: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """Last ``n`` lines of a log file (empty list if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


class WorkerFailed(RuntimeError):
    """A worker exited non-zero or was killed; the job was stopped."""

    def __init__(self, name: str, pid: int, returncode: int, log_path: Path,
                 log_tail: list[str], others: Sequence[str] = (),
                 returncodes: Mapping[str, int] | None = None) -> None:
        self.name, self.pid, self.returncode = name, pid, returncode
        #: every worker that had failed when the failure was noticed -> its exit code (negative: signal)
        self.returncodes = dict(returncodes or {name: returncode})
        self.signal = -returncode if returncode < 0 else None
        self.log_path, self.log_tail = log_path, log_tail
        head = f"worker '{name}' (pid {pid}) {describe_exit(returncode)}"
        if others:
            head += f"; also failed: {', '.join(others)}"
        body = "\n".join(f"    | {ln}" for ln in log_tail) or "    (log is empty)"
        super().__init__(f"{head}; all workers stopped. Last {len(log_tail)} lines of {log_path}:\n{body}")



#: resource groups of a run: each becomes a component of a heterogeneous Slurm job
#: (or a placement-group bundle shape on Ray) when their resources differ
KINDS = ("master", "model_worker", "gen_server", "rollout")


class SchedulerError(RuntimeError):
    """A scheduler cannot start the job (the cluster refused it, or it cannot be placed);
    the message names the setting to change."""


@dataclass
class WorkerRequest:
    """One process of a run: its name (scheduler name, log file, RPC identity), command and needs."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    n_threads: int = 1
    kind: str = "model_worker"  # one of KINDS
    gpus: int = 0  # accelerators this process uses (model workers and gen servers on GPU clusters)
    service: bool = False  # serves the others: the job is done without it exiting
    expendable: bool = False  # its death is logged, not fatal (its users fail over)
    restarts: int = 0  # an expendable worker is started again up to this many times when it dies

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"worker '{self.name}': kind={self.kind!r} is not one of {', '.join(KINDS)}")


def sigterm_as_interrupt() -> Callable[[], None]:
    """While waiting, SIGTERM to the launcher (kill, scancel) stops the workers like Ctrl-C.
    Returns the function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"launcher received {signal_name(signum)}")

    old = signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, old)


class WatchLoop:
    """The ``wait`` every scheduler shares; a scheduler provides ``_workers`` (name -> an object
    with ``expendable`` and ``service``), ``poll``, ``stop_all``, ``_fail`` (stop all, raise
    WorkerFailed) and ``_note_expendable`` (log dead expendable workers, restart them)."""

    _workers: dict[str, Any]

    def wait(self, timeout: float | None = None, check_interval: float = 0.2) -> bool:
        """Wait until every non-service worker exited 0 and return True; False if ``timeout``
        passed first (nothing is stopped, so a launcher can poll: ``while not s.wait(0.5):
        refresh_ui()``). A worker exiting non-zero or killed: stop all and raise WorkerFailed.
        Ctrl-C / SIGTERM while waiting: stop all, re-raise KeyboardInterrupt."""
        deadline = Deadline(timeout)
        restore = sigterm_as_interrupt()
        try:
            while True:
                codes = self.poll()  # type: ignore[attr-defined]
                failed = [n for n, rc in codes.items() if rc not in (None, 0)]
                self._note_expendable([n for n in failed if self._workers[n].expendable])
                failed = [n for n in failed if not self._workers[n].expendable]
                if failed:
                    self._fail(failed)
                if not [n for n, rc in codes.items() if rc is None and not self._workers[n].service]:
                    self.stop_all()  # type: ignore[attr-defined]  # services, and leftovers of workers done
                    return True
                self._while_running()
                if deadline.expired():
                    return False
                deadline.sleep(check_interval)
        except KeyboardInterrupt:
            logger.warning("interrupted: stopping %d workers", len(self._workers))
            self.stop_all()  # type: ignore[attr-defined]
            raise
        finally:
            restore()

    def running(self) -> list[str]:
        """Names of workers that have not exited yet."""
        return [n for n, rc in self.poll().items() if rc is None]  # type: ignore[attr-defined]

    def _fail(self, failed: list[str]) -> None:
        """Stop everything, then raise WorkerFailed naming the first failed worker."""
        self.stop_all()  # type: ignore[attr-defined]
        first = self._workers[failed[0]]
        # A worker killed *by us* while stopping shows a signal too; report the real
        # failures only: those that had already exited when we noticed.
        others = [f"{n} ({describe_exit(self._workers[n].returncode)})" for n in failed[1:]]
        console = getattr(self, "_console", None)
        if console is not None:
            console.poll(final=True)
        tail = read_log_tail(first.log_path, getattr(self, "tail_lines", 20))
        codes = {n: self._workers[n].returncode for n in failed}
        raise WorkerFailed(first.name, first.pid, first.returncode, first.log_path, tail, others, codes)

    def _note_expendable(self, dead: list[str]) -> None:
        raise NotImplementedError

    def _while_running(self) -> None:
        """Called on every round of ``wait`` while workers run."""


def make_scheduler(deploy: Any, log_dir: str, console: bool, job_name: str) -> Any:
    """The scheduler of ``deploy.launcher`` (local | slurm | ray), writing logs under ``log_dir``."""
    if deploy.launcher == "local":
        from realflow.scheduler.local import LocalScheduler

        return LocalScheduler(log_dir, console=console)
    if deploy.launcher == "slurm":
        from realflow.scheduler.slurm import SlurmScheduler

        return SlurmScheduler(log_dir, deploy.slurm, job_name=job_name, console=console)
    if deploy.launcher == "ray":
        from realflow.scheduler.ray import RayScheduler

        return RayScheduler(log_dir, deploy.ray, job_name=job_name, console=console)
    raise ValueError(f"launcher={deploy.launcher!r}: expected local, slurm or ray")
