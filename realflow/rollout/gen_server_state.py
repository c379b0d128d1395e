"""The gen server's in-process state machine: the backend, its step thread, pending requests.

Why a module of its own: this is the part with threads and locks; the HTTP API
(:mod:`realflow.rollout.gen_server`) only parses requests and calls into it.

Concurrency: the backend is stepped by ONE thread; HTTP handlers (asyncio)
only enqueue under the same lock, so requests join the running batch at the
next step.  The lock is fair (:class:`_BackendLock`): it is handed to a waiting
handler before the next step, so a pause, an abort or a metrics read takes
effect between two steps, not when the batch has drained.  No silent hangs:
a step thread kept waiting for the lock longer than :data:`STEP_WAIT_WARN_S`
logs a warning naming the holder, once per such period, and keeps waiting (a
weight update may legitimately hold the lock that long).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any, Iterator, Optional

from realflow.api.generation import GenerationResult, SamplingParams

__all__ = ["BadRequest", "GenServer", "STEP_WAIT_WARN_S"]

# The HTTP module's logger name, kept so that log configuration and filters see one server.
logger = logging.getLogger("realflow.gen_server")

STEP_WAIT_WARN_S = 30.0  # step thread kept from the backend this long -> warn (then again each period)
_WAIT_SLICE_S = 1.0  # the step thread re-checks (and may warn) at least this often while waiting


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and the message."""


class _Pending:
    """Results of one HTTP request, filled by the step thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expected: int) -> None:
        self.loop, self.expected = loop, expected
        self.results: list[GenerationResult] = []
        self.future: asyncio.Future = loop.create_future()


class _BackendLock:
    """The lock around every backend call; a caller waiting for it goes before the next step.

    A plain ``threading.Lock`` is not fair: the step thread releases it and takes it
    again for the next step at once, so a handler blocked on it (``pause``, ``abort``,
    ``/metrics``...) could wait through hundreds of steps -- a pause then took effect
    only after the running batch had finished, aborting nothing.  Callers other than
    the step thread (``with lock:``) count themselves as waiting; the step thread
    (``with lock.for_step():``) waits until none is, then takes the lock.  Handlers run
    on one event-loop thread (plus a few ``to_thread`` weight updates), so there are
    never many waiters and the step thread is not starved.

    The step thread waits in slices so that a stuck holder is reported, not silent:
    after ``warn_after_s`` (default :data:`STEP_WAIT_WARN_S`) it logs who holds the
    lock and how many callers wait for it, again every ``warn_after_s``, and keeps
    waiting.  Handlers are not sliced: they wait behind at most one step.
    """

    def __init__(self, warn_after_s: Optional[float] = None) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0
        # (thread name, monotonic time taken) of the holder, for the warning only: one
        # tuple assigned and read whole, so no lock is needed to see a consistent pair.
        self._holder: Optional[tuple[str, float]] = None
        self.warn_after_s = STEP_WAIT_WARN_S if warn_after_s is None else warn_after_s
        if not self.warn_after_s > 0:
            raise ValueError(f"warn_after_s must be > 0, got {self.warn_after_s!r}")

    def __enter__(self) -> "_BackendLock":
        with self._cond:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                if not self._waiting:
                    self._cond.notify_all()
        self._holder = (threading.current_thread().name, time.monotonic())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._holder = None
        self._lock.release()

    @contextlib.contextmanager
    def for_step(self) -> Iterator[None]:
        self._acquire_for_step()
        self._holder = (threading.current_thread().name, time.monotonic())
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()

    def _acquire_for_step(self) -> None:
        """Wait until no caller waits, then take the lock; warn each ``warn_after_s`` meanwhile."""
        slice_s = min(_WAIT_SLICE_S, self.warn_after_s)
        start = time.monotonic()
        warn_at = start + self.warn_after_s
        while True:
            with self._cond:
                clear = self._cond.wait_for(lambda: not self._waiting, timeout=slice_s)
                waiting = self._waiting
            if clear and self._lock.acquire(timeout=slice_s):
                return
            now = time.monotonic()
            if now >= warn_at:
                warn_at = now + self.warn_after_s
                holder = self._holder
                held = (f"held by thread {holder[0]!r} for {now - holder[1]:.1f} s" if holder
                        else "not held (being handed over)")
                logger.warning("step thread %r has waited %.1f s for the backend lock: %d caller(s) "
                               "waiting for it, %s; still waiting",
                               threading.current_thread().name, now - start, waiting, held)


class GenServer:
    """Owns the backend, its step thread and the bookkeeping of pending requests."""

    def __init__(self, backend: Any, model_path: str = "") -> None:
        self.backend = backend
        self.model_path = model_path
        self.lock = _BackendLock()  # serialises every backend call (see _BackendLock)
        # staging builds new weights beside the backend's (no backend lock): one at a time
        self.stage_lock = threading.Lock()
        self.can_stage = callable(getattr(backend, "stage_weights_from_tensors", None))
        self.weight_group: Optional[str] = None  # the weight-broadcast group joined (gen_server_weight_group)
        self._plock = threading.Lock()  # guards self.pending and result delivery
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.paused = False
        self.pending: dict[str, _Pending] = {}  # request rid -> its waiters
        self.requests_total = 0
        self.bad_requests_total = 0
        self.aborted_total = 0
        self._window: deque[tuple[float, float]] = deque(maxlen=4096)  # (time, tokens)
        self.thread = threading.Thread(target=self._loop, name="gen-step", daemon=True)
        self.step_error: Optional[str] = None

    def start(self) -> None:
        self.thread.start()

    # ------------------------------------------------------------ weight updates

    def stage_flag(self, body: dict) -> bool:
        """``stage`` of an update request: build the new weights beside the live ones."""
        stage = body.get("stage", False)
        if not isinstance(stage, bool):
            raise BadRequest(f"stage must be a boolean, got {stage!r}")
        if stage and not self.can_stage:
            raise BadRequest("stage: this backend cannot stage weights (no stage_weights_from_tensors)")
        return stage

    def load_weights(self, tensors: dict, fmt: str, version: Optional[int], stage: bool) -> int:
        """Staged: no backend lock, generation goes on while the new weights are built (one
        staging at a time); otherwise in place under the backend lock. Returns the version."""
        if stage:
            with self.stage_lock:
                return self.backend.stage_weights_from_tensors(tensors, fmt, version)
        with self.lock:
            return self.backend.update_weights_from_tensors(tensors, fmt, version)

    def weights_reply(self, version: int, stage: bool) -> dict:
        if stage:
            return {"success": True, "message": "staged", "staged_version": version}
        self.wake.set()
        return {"success": True, "message": "updated", "weight_version": version}

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(10.0)

    # ------------------------------------------------------------ step thread

    def _loop(self) -> None:
        while not self.stopping.is_set():
            results: list[GenerationResult] = []
            with self.lock.for_step():
                busy = not self.paused and self.backend.has_work()
                if busy:
                    try:
                        results = self.backend.step()
                    except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                        logger.exception("generation step failed")
                        self.step_error = f"{type(e).__name__}: {e}"
                        results = self.backend.pause("abort")
                    self._window.append((time.monotonic(),
                                         float(self.backend.stats()["tokens_generated"])))
            self._deliver(results)
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def _deliver(self, results: list[GenerationResult]) -> None:
        with self._plock:
            self._deliver_locked(results)

    def _deliver_locked(self, results: list[GenerationResult]) -> None:
        for r in results:
            p = self.pending.get(r.request_rid)
            if p is None:
                continue
            p.results.append(r)
            if len(p.results) == p.expected:
                self.pending.pop(r.request_rid, None)
                p.loop.call_soon_threadsafe(_set_result, p.future, p.results)

    # ------------------------------------------------------------ operations

    def submit(self, prompts: list[Any], params: list[SamplingParams], rids: list[str]
               ) -> list[_Pending]:
        """Add every prompt or none (a bad one aborts those already added)."""
        loop = asyncio.get_running_loop()
        added: list[str] = []
        waiters: list[_Pending] = []
        with self.lock:
            try:
                for i, (ids, sp, rid) in enumerate(zip(prompts, params, rids)):
                    if rid in self.pending:
                        raise BadRequest(f"rid {rid!r} is already in use")
                    try:
                        seq_ids = self.backend.add_request(rid, ids, sp)
                    except ValueError as e:
                        where = f"input_ids[{i}]: " if len(prompts) > 1 else ""
                        raise BadRequest(where + str(e)) from None
                    added.append(rid)
                    w = _Pending(loop, len(seq_ids))
                    with self._plock:
                        self.pending[rid] = w
                    waiters.append(w)
            except BadRequest:
                for rid in added:
                    self.backend.abort(rid)
                    with self._plock:
                        self.pending.pop(rid, None)
                raise
        self.requests_total += len(prompts)
        self.wake.set()
        return waiters

    def abort(self, rid: str) -> int:
        with self.lock:
            results = self.backend.abort(rid)
        self.aborted_total += len(results)
        self._deliver(results)
        return len(results)

    def pause(self, mode: str) -> int:
        with self.lock:
            self.paused = True
            results = self.backend.pause(mode)
        self.aborted_total += len(results)
        self._deliver(results)
        return len(results)

    def resume(self) -> None:
        with self.lock:
            self.paused = False
        self.wake.set()

    def metrics_text(self) -> str:
        with self.lock:
            st = dict(self.backend.stats())
            version = self.backend.weight_version
            window = list(self._window)
        now = time.monotonic()
        recent = [(t, n) for t, n in window if now - t <= 10.0]
        tps = 0.0
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            tps = (recent[-1][1] - recent[0][1]) / max(now - recent[0][0], 1e-9)
        lines = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            lines.extend([f"# HELP realflow_gen_{name} {help_}", f"# TYPE realflow_gen_{name} {kind}",
                          f"realflow_gen_{name} {value:g}"])

        metric("tokens_generated_total", "counter", "tokens sampled since start",
               st.get("tokens_generated", 0.0))
        metric("requests_total", "counter", "prompts accepted", self.requests_total)
        metric("bad_requests_total", "counter", "requests answered with 4xx", self.bad_requests_total)
        metric("aborted_total", "counter", "sequences ended by abort/pause", self.aborted_total)
        metric("running_requests", "gauge", "sequences in the running batch",
               st.get("running_requests", 0.0))
        metric("queued_requests", "gauge", "sequences waiting to join", st.get("queued_requests", 0.0))
        metric("tokens_per_second", "gauge", "tokens/s over the last 10 s", tps)
        busy = st.get("busy_seconds", 0.0)
        metric("busy_tokens_per_second", "gauge", "tokens/s while stepping, since start",
               st.get("tokens_generated", 0.0) / busy if busy > 0 else 0.0)
        metric("weight_version", "gauge", "version of the weights in use", version)
        metric("paused", "gauge", "1 while generation is paused", float(self.paused))
        return "\n".join(lines) + "\n"


def _set_result(fut: asyncio.Future, value: Any) -> None:
    """Runs on the event loop (``call_soon_threadsafe``); the future is done if the client went away."""
    if not fut.done():
        fut.set_result(value)
