"""The gen server's in-process state machine: the backend, its step thread, pending requests.

Why a module of its own: this is the part with threads and locks; the HTTP API
(:mod:`realflow.rollout.gen_server`) only parses requests and calls into it.

Concurrency: the backend is stepped by ONE thread.  HTTP handlers (asyncio) never
take the backend lock themselves: they queue operations (add these prompts, abort,
pause, continue) that the step thread runs, in arrival order, before
its next step (:meth:`GenServer.on_step_thread`), so a request joins the running
batch at the next step and a pause takes effect between two steps -- and the event
loop is never blocked behind the engine, so ``/health`` answers at once under any
load.  Weight updates hold the lock from a worker thread (they may take long); the
lock is fair (:class:`_BackendLock`): a waiting holder gets it before the next
step.  No silent hangs: a step thread kept waiting for the lock longer than
:data:`STEP_WAIT_WARN_S` logs a warning naming the holder, once per such period,
and keeps waiting (a weight update may legitimately hold the lock that long); an
operation not run within :data:`OP_TIMEOUT_S` fails naming the lock's holder.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator, Optional

from realflow.comm.drop_log import DropLog
from realflow.api.generation import GenerationResult, GenServerLimits, SamplingParams
from realflow.rollout.gen_server_admission import Admission, Overloaded
from realflow.rollout.gen_server_delta import ServerDelta

__all__ = ["BadRequest", "GenServer", "Overloaded", "STEP_WAIT_WARN_S"]

# The HTTP module's logger name, kept so that log configuration and filters see one server.
logger = logging.getLogger("realflow.gen_server")

STEP_WAIT_WARN_S = 30.0  # step thread kept from the backend this long -> warn (then again each period)
_WAIT_SLICE_S = 1.0  # the step thread re-checks (and may warn) at least this often while waiting
OP_TIMEOUT_S = 300.0  # a handler's operation not run by the step thread in this long -> error naming why


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and the message."""


class _Pending:
    """Results of one HTTP request, filled by the step thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expected: int, cost: int) -> None:
        self.loop, self.expected = loop, expected
        self.cost = cost  # queued tokens each of its sequences holds until delivered (see Admission)
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

    def holder_text(self) -> str:
        holder = self._holder
        if holder is None:
            return "not held"
        return f"held by thread {holder[0]!r} for {time.monotonic() - holder[1]:.1f} s"

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

    def __init__(self, backend: Any, model_path: str = "", limits: Optional[GenServerLimits] = None) -> None:
        self.backend = backend
        self.model_path = model_path
        self.admission = Admission(limits or GenServerLimits(), backend.max_context)
        self.lock = _BackendLock()  # serialises every backend call (see _BackendLock)
        # staging builds new weights beside the backend's (no backend lock): one at a time
        self.stage_lock = threading.Lock()
        self.can_stage = callable(getattr(backend, "stage_weights_from_tensors", None))
        self.weight_group: Optional[str] = None  # the weight-broadcast group joined (gen_server_weight_group)
        self.delta = ServerDelta(self)  # the base of delta updates (gen_server_delta)
        self._plock = threading.Lock()  # guards self.pending and result delivery
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.paused = False
        self.pending: dict[str, _Pending] = {}  # request rid -> its waiters
        # operations handlers queued for the step thread: (fn, loop, future or None), FIFO
        self._ops: list[tuple[Callable[[], Any], Optional[asyncio.AbstractEventLoop], Optional[asyncio.Future]]] = []
        self.requests_total = 0
        self.bad_requests_total = 0
        self.failed_requests_total = 0  # sequences the engine failed (non-finite logits): answered 500
        self.unauthorized = DropLog("gen server", "request")  # 401s, logged rate-limited per peer
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

    def load_weights(self, tensors: dict, fmt: str, version: Optional[int], stage: bool,
                     manifest: Any = None) -> int:
        """Staged: no backend lock, generation goes on while the new weights are built (one
        staging at a time); otherwise in place under the backend lock. With a ``manifest``
        (delta sync) :class:`ServerDelta` checks and applies it. Returns the version."""
        if manifest is not None:
            return self.delta.load(tensors, fmt, version, stage, manifest)
        if stage:
            with self.stage_lock:
                v = self.backend.stage_weights_from_tensors(tensors, fmt, version)
        else:
            with self.lock:
                v = self.backend.update_weights_from_tensors(tensors, fmt, version)
        self.delta.plain_update(stage)
        return v

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
                self._run_ops()
                busy = not self.paused and self.backend.has_work()
                if busy:
                    try:
                        results = self.backend.step()
                    except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                        logger.exception("generation step failed")
                        self.step_error = f"{type(e).__name__}: {e}"
                        results = self.backend.pause("abort")
                    point = (time.monotonic(), float(self.backend.stats()["tokens_generated"]))
                    with self._plock:
                        self._window.append(point)
            self._deliver(results)
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def _run_ops(self) -> None:
        """Run the operations handlers queued, in arrival order (the step thread holds the lock)."""
        with self._plock:
            ops, self._ops = self._ops, []
        for fn, loop, fut in ops:
            try:
                value, exc = fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                value, exc = None, e
            if fut is not None:
                loop.call_soon_threadsafe(_set_outcome, fut, value, exc)

    async def on_step_thread(self, fn: Callable[[], Any], timeout_s: float = OP_TIMEOUT_S) -> Any:
        """``fn()`` run by the step thread between two steps, under the backend lock.

        Why: a handler that took the lock itself would stop the event loop for up to a
        step (and a thousand handlers for a thousand steps): /health would wait behind them."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(fn, loop, fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            holder = self.lock.holder_text()
            raise RuntimeError(f"the step thread did not run the operation within {timeout_s:.0f} s "
                               f"(step thread alive: {self.thread.is_alive()}; backend lock {holder})") from None

    def _post(self, fn: Callable[[], Any], loop: Optional[asyncio.AbstractEventLoop] = None,
              fut: Optional[asyncio.Future] = None) -> None:
        with self._plock:
            self._ops.append((fn, loop, fut))
        self.wake.set()

    def _deliver(self, results: list[GenerationResult]) -> None:
        with self._plock:
            self._deliver_locked(results)

    def _deliver_locked(self, results: list[GenerationResult]) -> None:
        for r in results:
            p = self.pending.get(r.request_rid)
            if p is None:
                continue
            p.results.append(r)
            self.admission.release(p.cost)
            if len(p.results) == p.expected:
                self.pending.pop(r.request_rid, None)
                p.loop.call_soon_threadsafe(_set_outcome, p.future, p.results, None)

    # ------------------------------------------------------------ operations (event loop)

    async def submit(self, prompts: list[Any], params: list[SamplingParams], rids: list[str],
                     images: Optional[list[Any]] = None) -> list[_Pending]:
        """Add every prompt or none (a bad one aborts those already added); returns the waiters.
        ``images``: each prompt's ``ImageInputs`` or None (vision-language backends).

        Bounds are checked and queued tokens reserved on the event loop, without the
        backend lock: a request over a bound (:class:`BadRequest`) or past the queue
        (:class:`Overloaded`) costs the engine nothing.  The prompts are added by the
        step thread between two steps."""
        loop = asyncio.get_running_loop()
        try:
            costs = self.admission.sequence_costs(prompts, params)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        reserved = sum(c * sp.n for c, sp in zip(costs, params))
        self.admission.reserve(reserved, self.recent_tokens_per_second)
        waiters = [_Pending(loop, sp.n, cost) for sp, cost in zip(params, costs)]

        def add() -> None:
            added: list[str] = []
            try:
                with self._plock:
                    clash = [r for r in rids if r in self.pending]
                    if clash:
                        raise BadRequest(f"rid {clash[0]!r} is already in use")
                    self.pending.update(zip(rids, waiters))
                for i, (ids, sp, rid, w) in enumerate(zip(prompts, params, rids, waiters)):
                    img = None if images is None else images[i]
                    try:
                        w.expected = len(self.backend.add_request(rid, ids, sp) if img is None
                                         else self.backend.add_request(rid, ids, sp, images=img))
                    except ValueError as e:
                        where = f"input_ids[{i}]: " if len(prompts) > 1 else ""
                        raise BadRequest(where + str(e)) from None
                    added.append(rid)
            except BadRequest:
                for rid in added:
                    self.backend.abort(rid)
                with self._plock:
                    for rid, w in zip(rids, waiters):
                        if self.pending.get(rid) is w:
                            del self.pending[rid]
                self.admission.release(reserved)
                raise
            self.requests_total += len(prompts)

        try:
            await self.on_step_thread(add)
        except asyncio.CancelledError:  # the client left before the step thread took it
            self.abort_later(rids)
            raise
        return waiters

    def abort_later(self, rids: list[str]) -> None:
        """Abort ``rids`` at the next step, without waiting (a client went away)."""
        def abort() -> None:
            for rid in rids:
                self._abort_now(rid)
        self._post(abort)

    def _abort_now(self, rid: str) -> int:
        results = self.backend.abort(rid)
        self.aborted_total += len(results)
        self._deliver(results)
        return len(results)

    async def abort(self, rid: str) -> int:
        return await self.on_step_thread(lambda: self._abort_now(rid))

    async def pause(self, mode: str) -> int:
        def pause() -> int:
            self.paused = True
            results = self.backend.pause(mode)
            self.aborted_total += len(results)
            self._deliver(results)
            return len(results)
        return await self.on_step_thread(pause)

    async def resume(self) -> None:
        def resume() -> None:
            self.paused = False
        await self.on_step_thread(resume)

    async def flush_cache(self) -> None:
        await self.on_step_thread(self.backend.flush_cache)

    def recent_tokens_per_second(self, window_s: float = 10.0) -> float:
        """Tokens/s generated over the last ``window_s`` seconds (0 when idle)."""
        with self._plock:
            window = list(self._window)
        now = time.monotonic()
        recent = [(t, n) for t, n in window if now - t <= window_s]
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            return (recent[-1][1] - recent[0][1]) / max(now - recent[0][0], 1e-9)
        return 0.0

    def metrics_text(self) -> str:
        """Prometheus text.  Read without the backend lock: the counters are plain numbers the
        step thread replaces whole, and a weight update holding the lock for seconds must not
        hold up monitoring."""
        st, version = dict(self.backend.stats()), self.backend.weight_version
        tps = self.recent_tokens_per_second()
        lines = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            lines.extend([f"# HELP realflow_gen_{name} {help_}", f"# TYPE realflow_gen_{name} {kind}",
                          f"realflow_gen_{name} {value:g}"])

        metric("tokens_generated_total", "counter", "tokens sampled since start",
               st.get("tokens_generated", 0.0))
        metric("requests_total", "counter", "prompts accepted", self.requests_total)
        metric("bad_requests_total", "counter", "requests answered with 4xx", self.bad_requests_total)
        metric("failed_requests_total", "counter", "sequences failed in the engine (non-finite logits), answered "
               "500", self.failed_requests_total)
        metric("unauthorized_total", "counter", "requests answered 401 (no or wrong API key)",
               self.unauthorized.count)
        metric("aborted_total", "counter", "sequences ended by abort/pause", self.aborted_total)
        metric("running_requests", "gauge", "sequences in the running batch",
               st.get("running_requests", 0.0))
        metric("queued_requests", "gauge", "sequences waiting to join", st.get("queued_requests", 0.0))
        metric("tokens_per_second", "gauge", "tokens/s over the last 10 s", tps)
        busy = st.get("busy_seconds", 0.0)
        metric("busy_tokens_per_second", "gauge", "tokens/s while stepping, since start",
               st.get("tokens_generated", 0.0) / busy if busy > 0 else 0.0)
        metric("queued_tokens", "gauge", "prompt + new tokens admitted and not yet answered",
               self.admission.queued_tokens)
        metric("max_queued_tokens", "gauge", "the limit on queued_tokens (429 above)",
               self.admission.limits.max_queued_tokens)
        metric("overloaded_total", "counter", "requests answered 429 (queue full)", self.admission.rejected_total)
        metric("weight_version", "gauge", "version of the weights in use", version)
        metric("paused", "gauge", "1 while generation is paused", float(self.paused))
        return "\n".join(lines) + "\n"


def _set_outcome(fut: asyncio.Future, value: Any, exc: Optional[BaseException]) -> None:
    """Runs on the event loop (``call_soon_threadsafe``); the future is done if the client went away."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
