"""Ray launcher (``launcher=ray``): every worker is a child process of a small Ray actor.

Why this shape:

* **One placement group per start, one bundle per worker** (``{CPU: cpus, GPU: gpus}``),
  strategy PACK: Ray reserves a run's resources all at once or not at all (like one Slurm
  job), on as few nodes as fit. Groups per worker kind could be half placed and hold
  resources while waiting; STRICT_SPREAD/STRICT_PACK refuse layouts that PACK finds.
* **The actor runs the worker's argv, it is not the worker.** A worker inside Ray's worker
  runtime would inherit its signal handling, stdout capture and thread pools. Instead the
  actor drives a :class:`LocalScheduler` on its node (:mod:`realflow.scheduler.ray_node`),
  so every guarantee of the local launcher holds per node: own session,
  ``<log_dir>/<name>.log``, thread variables, PR_SET_PDEATHSIG and the watchdog that
  kills the worker's process group, children included, when the actor dies.
* **Nothing outlives the launcher**: it is the Ray driver; when it dies Ray kills its
  (non-detached) actors, and each actor's death reaches its worker as above.
* **Polling never blocks**: one ``poll`` call per actor is outstanding; ``ray.wait(...,
  timeout=0)`` collects the answers. An actor that died (its node was lost) reads as its
  worker killed by SIGKILL: a fault, which ``recover_mode=auto`` relaunches from.

Assumes the log directory and the launcher's working directory are on a file system every
node sees, and this Python environment at the same path on every node. A worker's
environment is its node's (where ``ray start`` ran; Ray sets CUDA_VISIBLE_DEVICES), plus the
launcher's ``REALFLOW_*`` (not the per-host REALFLOW_HOST_IP) and PYTHONPATH, plus its
request's ``env``. The Ray cluster itself is never started or stopped here.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _e:  # pragma: no cover - depends on the install
    raise ImportError("launcher=ray needs Ray: pip install -c constraints.txt -e '.[ray]'") from _e

from realflow.api.deploy import RayConfig
from realflow.base.logging import get_logger
from realflow.base.timeutil import format_seconds
from realflow.scheduler.base import SchedulerError, WatchLoop, WorkerRequest, describe_exit, read_log_tail
from realflow.scheduler.console import ConsoleTail
from realflow.scheduler.local import THREAD_ENV_VARS, _sigint_deferred
from realflow.scheduler.ray_node import NodeRunner

logger = get_logger("realflow.scheduler")

LOST = -signal.SIGKILL  # return code of a worker whose actor (or node) died under it


class RayError(SchedulerError):
    """The Ray cluster could not be reached, or could not place or start the workers."""


@dataclasses.dataclass
class _Worker:
    name: str
    actor: Any
    pid: int
    host: str
    log_path: Path
    service: bool
    expendable: bool
    restarts_left: int = 0  # an expendable worker that dies is started again this many more times
    returncode: int | None = None
    pending: Any = None  # the outstanding poll call
    stopped: bool = False  # its actor was killed


def _one_line(e: BaseException) -> str:
    """The last non-empty line of an error (Ray's remote errors carry a whole traceback)."""
    cause = getattr(e, "cause", None)
    text = str(cause if cause is not None else e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


class RayScheduler(WatchLoop):
    """Starts, watches and stops a run's workers as Ray actors (see module docstring).

    The interface is :class:`LocalScheduler`'s: ``start``/``submit``, ``wait`` (True once
    every non-service worker exited 0, False on timeout, :class:`WorkerFailed` after
    stopping everything when a non-expendable worker fails), ``poll``, ``running``,
    ``stop_all``, ``close``.
    """

    def __init__(self, log_dir: str | os.PathLike, cfg: RayConfig | None = None, job_name: str = "realflow",
                 console: bool = True, console_stream: TextIO | None = None, grace: float = 5.0,
                 tail_lines: int = 20) -> None:
        self.cfg = cfg or RayConfig()
        self.log_dir = Path(log_dir).resolve()  # actors on other nodes see the same absolute path
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.job_name, self.grace, self.tail_lines = job_name, grace, tail_lines
        self._workers: dict[str, _Worker] = {}
        self._groups: list[Any] = []
        self._console = ConsoleTail(console_stream) if console else None
        self._lost_expendable: set[str] = set()
        self._lock = threading.RLock()
        self._connected = self._owns_connection = self._closed = False

    # ---- connecting and placing -------------------------------------------------------
    def _connect(self) -> None:
        if self._connected or ray.is_initialized():  # someone else's connection: not ours to shut down
            self._connected = True
            return
        address, timeout, where = self.cfg.address, self.cfg.connect_timeout_s, f"ray.address={self.cfg.address}"
        host, _, port = address.rpartition(":")
        if host and port.isdigit() and "://" not in address:  # a refused/unroutable address fails fast
            try:
                socket.create_connection((host, int(port)), timeout=timeout).close()
            except OSError as e:
                raise RayError(f"cannot reach the Ray cluster at {where}: {e.strerror or e} "
                               "(is `ray start --head` running there?)") from None
        outcome: dict[str, BaseException | bool] = {}

        def init() -> None:  # ray.init has no timeout and retries a silent server for minutes
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
                outcome["ok"] = True
            except BaseException as e:  # noqa: BLE001 - reported below
                outcome["error"] = e

        t = threading.Thread(target=init, name="ray-connect", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise RayError(f"no answer from the Ray cluster at {where} within {format_seconds(timeout)} "
                           "(ray.connect_timeout_s)")
        if "error" in outcome:
            raise RayError(f"cannot connect to the Ray cluster at {where}: {_one_line(outcome['error'])}")
        self._connected = self._owns_connection = True
        logger.info("connected to the Ray cluster at %s (%s free)", address, _fmt(ray.available_resources()))

    def _bundle(self, r: WorkerRequest) -> dict[str, float]:
        cpus = self.cfg.cpus_per_worker or r.n_threads
        gpus = r.gpus or (self.cfg.gpus_per_worker if r.kind == "model_worker" else 0)
        return {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}

    def _place(self, requests: Sequence[WorkerRequest]) -> Any:
        """A ready placement group with one bundle per request; names what does not fit."""
        bundles = [self._bundle(r) for r in requests]
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        for r, b in zip(requests, bundles):
            if not any(all(node.get(k, 0) >= v for k, v in b.items()) for node in nodes):
                raise RayError(f"worker '{r.name}' needs {_fmt(b)} but no node of the Ray cluster has that "
                               f"much (nodes: {'; '.join(_fmt(n) for n in nodes) or 'none'}); "
                               "lower ray.cpus_per_worker / ray.gpus_per_worker or add nodes")
        pg = placement_group(bundles, strategy="PACK", name=f"{self.job_name}:{os.urandom(4).hex()}")  # unique
        self._groups.append(pg)
        timeout = self.cfg.connect_timeout_s
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
            raise RayError(f"Ray could not place {len(bundles)} workers ({_fmt(need)} in all: "
                           + ", ".join(f"{r.name} {_fmt(b)}" for r, b in zip(requests, bundles))
                           + f") within {format_seconds(timeout)} (ray.connect_timeout_s); the cluster has "
                           f"{_fmt(ray.available_resources())} free")
        return pg

    # ---- starting ---------------------------------------------------------------------
    def start(self, requests: Sequence[WorkerRequest], cwd: str | os.PathLike | None = None) -> None:
        """Place every request in one placement group and start each worker in its bundle, in
        ``cwd`` (default: the launcher's working directory, which every node must see)."""
        if self._closed:
            raise RuntimeError("RayScheduler is closed")
        names = [r.name for r in requests]
        dup = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(self._workers)))
        if dup:
            raise ValueError(f"worker name(s) {', '.join(dup)} submitted twice")
        if not requests:
            return
        self._connect()
        pg = self._place(requests)
        runner = ray.remote(max_restarts=0)(NodeRunner)
        forwarded = {k: v for k, v in os.environ.items()
                     if (k.startswith("REALFLOW_") and k != "REALFLOW_HOST_IP" and k not in THREAD_ENV_VARS)
                     or k == "PYTHONPATH"}
        calls = {}
        for i, r in enumerate(requests):
            b = self._bundle(r)
            actor = runner.options(
                num_cpus=b["CPU"], num_gpus=b.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(str(self.log_dir), self.grace)
            calls[r.name] = (actor, actor.start.remote(r.name, list(r.argv), {**forwarded, **r.env},
                                                       r.n_threads, os.path.abspath(cwd or os.getcwd())))
        answers, missing = _get_named({n: ref for n, (_, ref) in calls.items()}, self.cfg.connect_timeout_s)
        failed = {n: a for n, a in answers.items() if isinstance(a, BaseException)}
        for r in requests:
            actor = calls[r.name][0]
            pid, host = answers[r.name] if r.name in answers and r.name not in failed else (0, "?")
            self._workers[r.name] = _Worker(r.name, actor, pid, host, self.log_dir / f"{r.name}.log",
                                            service=r.service or r.expendable, expendable=r.expendable,
                                            restarts_left=r.restarts if r.expendable else 0,
                                            returncode=None if pid else LOST)
        if failed or missing:
            self.stop_all()
            why = [f"'{n}': {_one_line(e)}" for n, e in failed.items()] + [
                f"'{n}': no answer within {format_seconds(self.cfg.connect_timeout_s)}" for n in missing]
            raise RayError("Ray could not start worker(s) " + "; ".join(why))
        for r in requests:
            w = self._workers[r.name]
            if self._console is not None:
                self._console.add(w.name, w.log_path)
            logger.info("started worker %s on %s (pid %d, %s), log %s", w.name, w.host, w.pid,
                        _fmt(self._bundle(r)), w.log_path)

    def submit(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, n_threads: int = 1,
               cwd: str | os.PathLike | None = None, *, service: bool = False, expendable: bool = False,
               restarts: int = 0, kind: str = "model_worker", gpus: int = 0) -> int:
        """As :meth:`LocalScheduler.submit`, in its own placement group; returns its pid on its node."""
        self.start([WorkerRequest(name, list(argv), dict(env or {}), n_threads, kind, gpus, service, expendable,
                                  restarts)], cwd)
        return self._workers[name].pid

    # ---- watching ---------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._workers)

    def _get(self, name: str) -> _Worker:
        if name not in self._workers:
            raise KeyError(f"no worker named '{name}'; workers: {', '.join(self._workers) or 'none'}")
        return self._workers[name]

    def pid(self, name: str) -> int:
        """The worker's pid on its node (see :meth:`host`)."""
        return self._get(name).pid

    def host(self, name: str) -> str:
        return self._get(name).host

    def log_path(self, name: str) -> Path:
        return self._get(name).log_path

    def poll(self) -> dict[str, int | None]:
        """``{name: returncode or None while running}`` (negative: killed by that signal)."""
        with self._lock:
            live = [w for w in self._workers.values() if w.returncode is None and not w.stopped]
            pending = [w.pending for w in live if w.pending is not None]
            ready = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) if pending else set()
            for w in live:
                if w.pending is not None and w.pending in ready:
                    try:
                        w.returncode = ray.get(w.pending)
                    except ray.exceptions.RayError as e:  # its actor died, or its node was lost
                        logger.error("the Ray actor of worker %s on %s failed (%s): worker lost",
                                     w.name, w.host, _one_line(e))
                        w.returncode = LOST
                    w.pending = None
                if w.returncode is None and w.pending is None:
                    w.pending = w.actor.poll.remote()
            return {w.name: w.returncode for w in self._workers.values()}

    def _note_expendable(self, dead: list[str]) -> None:
        for n in dead:
            if n not in self._lost_expendable:
                self._lost_expendable.add(n)
                self._expendable_died(self._workers[n])

    def _expendable_died(self, w: _Worker) -> None:
        tail = "\n".join(f"    | {ln}" for ln in read_log_tail(w.log_path, 5))
        logger.warning("expendable worker %s (pid %d on %s) %s; the job goes on. Last lines of %s:\n%s",
                       w.name, w.pid, w.host, describe_exit(w.returncode), w.log_path, tail)
        if w.restarts_left <= 0:
            return
        answers, _ = _get_named({w.name: w.actor.restart.remote()}, self.cfg.connect_timeout_s)
        got = answers.get(w.name)
        if not isinstance(got, tuple):
            logger.error("could not restart worker %s on %s: %s", w.name, w.host,
                         _one_line(got) if got is not None else "its actor did not answer")
            return
        w.pid, name = got
        w.restarts_left, w.returncode, w.log_path = w.restarts_left - 1, None, self.log_dir / f"{name}.log"
        self._lost_expendable.discard(w.name)
        if self._console is not None:
            self._console.add(w.name, w.log_path)
        logger.warning("restarted worker %s on %s (pid %d), log %s", w.name, w.host, w.pid, w.log_path)

    # ---- stopping ---------------------------------------------------------------------
    def stop_all(self, grace: float | None = None) -> None:
        """Each actor stops its worker (SIGTERM, SIGKILL after ``grace``); then the actors are
        killed and the placement groups removed, which frees the resources."""
        grace = self.grace if grace is None else grace
        with self._lock, _sigint_deferred():
            live = [w for w in self._workers.values() if not w.stopped]
            if live:
                answers, missing = _get_named({w.name: w.actor.stop.remote(grace) for w in live}, grace + 15)
                for w in live:
                    a = answers.get(w.name)
                    if w.returncode is None:
                        w.returncode = a if isinstance(a, int) else LOST
                    elif isinstance(a, BaseException) and not isinstance(a, ray.exceptions.RayActorError):
                        logger.warning("stopping worker %s on %s: %s", w.name, w.host, _one_line(a))
                if missing:  # killing their actors below: the watchdogs on their nodes stop the workers
                    logger.warning("no answer from the actors of %s within %s while stopping",
                                   ", ".join(missing), format_seconds(grace + 15))
                for w in live:
                    ray.kill(w.actor)
                    w.stopped, w.pending = True, None
            for pg in self._groups:
                remove_placement_group(pg)
            self._groups.clear()

    def close(self) -> None:
        """Stop all workers, release the resources and disconnect; the Ray cluster keeps running."""
        if self._closed:
            return
        try:
            if self._connected:
                self.stop_all()
        finally:
            self._closed = True
            if self._console is not None:
                self._console.stop()
            if self._owns_connection:
                ray.shutdown()
            self._connected = self._owns_connection = False

    def __enter__(self) -> "RayScheduler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _get_named(refs: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], list[str]]:
    """Results of named Ray calls (an exception where one failed) and the names with no answer in time."""
    by_ref = {ref: name for name, ref in refs.items()}
    ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout)
    out: dict[str, Any] = {}
    for ref in ready:
        try:
            out[by_ref[ref]] = ray.get(ref)
        except ray.exceptions.RayError as e:
            out[by_ref[ref]] = e
    return out, [n for n in refs if n not in out]


def _fmt(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") and v}
    return ", ".join(f"{v:g} {k}" for k, v in shown.items()) or "0 CPU"

