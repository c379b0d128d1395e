"""The rollout controller: admission under the staleness bound, routing, weight-update rounds.

One process per run. It is the only place that knows the weight version the servers
run and how many rollouts exist at each version, so it is where staleness is bounded
from exact counts it keeps itself:

* ``admitted[w]``: rollouts admitted while the servers ran version ``w``;
* ``failed[w]``: those whose agent raised (they will never reach the trainer).

A rollout is admitted only while ``sum(admitted) - sum(failed) < (version + eta + 1) * B``
(:meth:`RolloutSpec.admission_limit`); the trainer's batch selection
(:mod:`realflow.system.staleness`) turns that into the exact per-trajectory bound.

Interfaces:

* rollout workers, over HTTP on loopback with the experiment's bearer token:
  ``POST /admit`` (long-polls until a slot is free), ``POST /done``, ``POST /generate``
  (routed by :class:`~realflow.rollout.server_pool.ServerPool`, which resumes
  interrupted requests and fails over from dead servers), ``GET /state``;
* the trainer's master, over the signed ZMQ control plane (this process is an RPC
  worker named ``rollout_controller``): ``counts``, ``update_weights``, ``finish``.

A weight-update round is pause (abort or retract running requests) -> update every
server (shared memory, or disk) -> continue; rounds run one at a time, a newer version
that arrives meanwhile supersedes an older one not yet started, and each round's time
is logged and reported.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from realflow.api.rollout import LORA_ADAPTER_NAME, RolloutSpec
from realflow.api.routing import encode_routed_experts, moe_routing_of
from realflow.comm import shm
from realflow.comm.drop_log import DropLog
from realflow.rollout.prompt_ledger import PromptLedger
from realflow.rollout.server_pool import NoServerError, ServerPool
from realflow.weights.broadcast_groups import WeightGroups
from realflow.weights.rounds import update_servers
from realflow.weights.version import WeightUpdate, remove_older_checkpoints

__all__ = ["RolloutController", "build_controller_app"]

logger = logging.getLogger("realflow.rollout.controller")

ADMIT_WAIT_S = 5.0  # one /admit long-poll; the worker asks again after a refusal


@dataclass
class Counts:
    admitted: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    failed: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    finished: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    refused: int = 0  # /admit calls answered "not now" (the staleness bound held a rollout back)
    agent_errors: int = 0
    agent_timeouts: int = 0
    filtered: int = 0  # dynamic sampling: groups whose rewards were all equal, never sent to the trainer

    @property
    def live_total(self) -> int:
        return sum(self.admitted.values()) - sum(self.failed.values())

    @property
    def running(self) -> int:
        return sum(self.admitted.values()) - sum(self.failed.values()) - sum(self.finished.values())


class RolloutController:
    """State and operations of the controller; every method runs on its event loop."""

    def __init__(self, spec: RolloutSpec, server_urls: list[str], api_key: Optional[str],
                 resume: Optional[dict[str, Any]] = None,
                 lookup_server: Optional[Callable[[int], Awaitable[Optional[str]]]] = None,
                 rejoin_wait_s: float = 0.0) -> None:
        """``resume``: the rollout part of a recover point (``next_index``, ``pending`` prompt
        numbers, ``consumed`` rollouts per admission version) when the run continues from one.
        ``lookup_server(i)``: the address server ``i`` publishes now (a replacement started by
        the launcher publishes a new one); ``rejoin_wait_s``: how long requests and the run
        wait for a replacement when no server is up."""
        self.spec = spec
        self.pool = ServerPool(server_urls, api_key, request_timeout=spec.request_timeout_s)
        if spec.lora is not None and spec.backend != "builtin":
            self.pool.lora_name = LORA_ADAPTER_NAME  # SGLang serves the adapter by name (builtin merges it)
        self.pool.rejoin_wait_s = rejoin_wait_s
        self.pool.moe_routing = moe_routing_of(spec.model_path)  # MoE: routing replay (realflow.api.routing)
        self.lookup_server = lookup_server
        self.rejoin_wait_s = rejoin_wait_s
        self._none_alive_since: Optional[float] = None
        self.groups = WeightGroups(self.pool, spec.weight_sync, spec.weight_broadcast_timeout_s)
        self.version = 0
        self.counts = Counts()
        self.ledger = PromptLedger()
        if resume is not None:
            self.ledger = PromptLedger(resume["next_index"], resume["pending"], resume.get("failed", 0))
            # what was trained counts as admitted and finished; what was pending is handed out again.
            # The weights stay at version 0 until the trainer's first round brings the servers to its
            # version, and the admission limit of version 0 admits nothing before that round.
            for v, n in resume["consumed"].items():
                self.counts.admitted[int(v)] += int(n)
                self.counts.finished[int(v)] += int(n)
        self.stopping = False
        self.fatal: Optional[str] = None  # why rollouts cannot go on (e.g. every server lost)
        self._changed: Optional[asyncio.Condition] = None
        self._pending_round: Optional[WeightUpdate] = None
        self._running: Optional[int] = None  # the version of the round in progress
        self._round_wakeup: Optional[asyncio.Event] = None
        self.round_times: list[float] = []
        self.stall_times: list[float] = []  # pause -> continue of each round
        self.rounds_skipped = 0
        self._tasks: list[asyncio.Task] = []
        self._seq = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._changed = asyncio.Condition()
        self._round_wakeup = asyncio.Event()
        await self.pool.start()
        await self.pool.check_health()  # learn the versions and who can stage weights before round 1
        self._tasks = [asyncio.create_task(self._health_loop(), name="health"),
                       asyncio.create_task(self._round_loop(), name="weight-rounds")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pending_round is not None and self._pending_round.handle is not None:
            shm.release(self._pending_round.handle)
        await self.pool.close()

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ admission

    async def admit(self, wait_s: float = ADMIT_WAIT_S) -> dict[str, Any]:
        """Admit one rollout now, or after waiting up to ``wait_s`` for the bound to allow it."""
        assert self._changed is not None
        deadline = time.monotonic() + wait_s
        refused_once = False
        async with self._changed:
            while True:
                if self.stopping or self.fatal:
                    return {"admitted": False, "stop": True, "reason": self.fatal or "run finished"}
                if self.counts.live_total < self.spec.admission_limit(self.version):
                    self.counts.admitted[self.version] += 1
                    self._seq += 1
                    return {"admitted": True, "version": self.version, "seq": self._seq,
                            "index": self.ledger.hand_out()}
                if not refused_once:
                    self.counts.refused += 1
                    refused_once = True
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"admitted": False, "stop": False}
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    return {"admitted": False, "stop": False}

    async def done(self, version: int, ok: bool, error: str = "", index: Optional[int] = None,
                   sample_id: str = "", timed_out: bool = False, filtered: bool = False) -> None:
        """A rollout admitted at ``version`` (prompt number ``index``) reached the trainer (``ok``), failed,
        or was ``filtered`` (dynamic sampling: all rewards equal). A failed or filtered one frees its
        place under the staleness bound (it never reaches the trainer) and its prompt is not handed
        out again."""
        if self.counts.admitted.get(version, 0) <= self.counts.failed[version] + self.counts.finished[version]:
            raise ValueError(f"/done for version {version}: no such rollout is running")
        if index is not None:
            self.ledger.finished(int(index), sample_id, ok)
        if ok:
            self.counts.finished[version] += 1
        else:
            self.counts.failed[version] += 1
            if filtered:
                self.counts.filtered += 1
            else:
                self.counts.agent_errors += 1
                self.counts.agent_timeouts += bool(timed_out)
        await self._notify()

    def state(self) -> dict[str, Any]:
        c = self.counts
        return {"version": self.version, "admitted": dict(c.admitted), "failed": dict(c.failed),
                "finished": dict(c.finished), "running": c.running, "refused": c.refused,
                "agent_errors": c.agent_errors, "agent_timeouts": c.agent_timeouts, "filtered": c.filtered, "tokens_generated": self.pool.tokens_generated,
                "failovers": self.pool.requests_failed_over,
                "servers": {s.name: {"alive": s.alive, "url": s.url, "version": s.version,
                                     "outstanding_tokens": s.outstanding_tokens, "lost": s.lost_reason}
                            for s in self.pool.servers},
                "gen_busy_s": sum(s.busy_s for s in self.pool.servers), "n_servers": len(self.pool.servers),
                "round_times": list(self.round_times[-8:]), "rounds": len(self.round_times),
                "stall_times": list(self.stall_times[-8:]),
                "rounds_skipped": self.rounds_skipped, "broadcast_failures": self.groups.failures,
                # a replacement server waits for the current weights: the trainer publishes them again
                "weights_wanted": self.version > 0 and self._pending_round is None
                and any(s.joining and s.alive for s in self.pool.servers),
                "fatal": self.fatal}

    # ------------------------------------------------------------ weight-update rounds

    def weight_plan(self, writer_host: str) -> dict[str, Any]:
        """How the next version travels: shared memory and/or a broadcast group (see
        realflow.weights.broadcast_groups) and, with delta sync, the base each way's receivers hold:
        the version they will run when the round starts -- unknown (a full update) while a round is
        queued, since a queued round may be superseded and never reach them."""
        delta = None
        if self.spec.delta_sync_on():
            target = None if self._pending_round is not None else (
                self._running if self._running is not None else self.version)
            delta = (self.spec.weight_sync_delta, self.version, target)
        return self.groups.plan(writer_host, delta)

    def request_round(self, version: int, handle: Optional[dict], path: Optional[str],
                      broadcast: Optional[dict] = None, shm_delta: Optional[dict] = None) -> None:
        """Queue a round to ``version``; one not started yet is superseded (and its weights freed).

        (A round with a broadcast is never pending when the next arrives: the writer's next
        publish waits for its send, which needs this round's receivers.)"""
        assert self._round_wakeup is not None
        refresh = version == self.version and any(s.joining for s in self.pool.servers)
        if version <= self.version and not refresh:  # (a refresh brings a replacement server up to date)
            raise ValueError(f"update_weights to version {version}: the servers already run {self.version}")
        old = self._pending_round
        if old is not None:
            self.rounds_skipped += 1
            if old.handle is not None:
                shm.release(old.handle)
        self._pending_round = WeightUpdate(version, handle, path, broadcast, shm_delta)
        self._round_wakeup.set()

    async def _round_loop(self) -> None:
        assert self._round_wakeup is not None
        while True:
            await self._round_wakeup.wait()
            self._round_wakeup.clear()
            r, self._pending_round = self._pending_round, None
            if r is None:
                continue
            try:
                self._running = r.version
                await self._run_round(r)
            except NoServerError as e:
                self.fatal = str(e)
                await self._notify()
            except Exception as e:  # noqa: BLE001 - reported to the master through counts()
                logger.exception("weight-update round to version %d failed", r.version)
                self.fatal = f"weight-update round to version {r.version} failed: {type(e).__name__}: {e}"
                await self._notify()
            finally:
                self._running = None
                if r.handle is not None:
                    shm.release(r.handle)

    async def _run_round(self, r: WeightUpdate) -> None:
        """Stage (in memory, on servers that can: generation goes on) -> pause -> update
        (a pointer swap where staged) -> continue (:mod:`realflow.weights.rounds`). ``round_times``
        holds the whole round, ``stall_times`` the pause -> continue part: how long generation stopped."""
        t0 = time.perf_counter()
        mode = "abort" if self.spec.interrupt_mode == "abort" else "retract"
        done = await update_servers(self.pool, self.groups, r, mode)
        staged, t_pause = done.staged, done.t_pause
        self.pool.admit_joined(r.version)
        if self.rejoin_wait_s <= 0:  # (else the health loop gives replacements rejoin_wait_s to come up)
            self.pool.pick()  # raises NoServerError naming every server when none survived the round
        t1 = time.perf_counter()
        self.round_times.append(t1 - t0)
        self.stall_times.append(t1 - t_pause)
        self.version = r.version
        how = done.how(r)
        logger.info("weight-update round to version %d (%s%s, %s): %.3f s, generation stopped %.3f s",
                    r.version, how,
                    f", {len(staged)} staged" if staged else "", mode, t1 - t0, t1 - t_pause)
        if r.path is not None:
            remove_older_checkpoints(r.path)
        await self._notify()

    # ------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.health_interval_s)
            await self.pool.check_health()
            await self._take_replacements()
            self.pool.admit_joined(self.version)
            if self.pool.alive():
                self._none_alive_since = None
            elif not self.fatal:
                now = time.monotonic()
                self._none_alive_since = self._none_alive_since or now
                if now - self._none_alive_since >= self.rejoin_wait_s:
                    try:
                        self.pool.pick()
                    except NoServerError as e:
                        self.fatal = str(e)
                        logger.error("%s", e)
                        await self._notify()

    async def _take_replacements(self) -> None:
        """A lost server whose address changed was replaced (the launcher restarts dead servers):
        it joins, takes the next weight-update round, and is routed to once current."""
        if self.lookup_server is None:
            return
        for i, s in enumerate(list(self.pool.servers)):
            if s.alive:
                continue
            url = await self.lookup_server(i)
            if url and url.rstrip("/") != s.url:
                self.pool.replace(i, url, self.version)
                await self.pool.check_health()


# ---------------------------------------------------------------- HTTP API


class BodyError(ValueError):
    """A request body field is missing or has the wrong type: 400 naming it."""


async def _body(request: web.Request) -> dict[str, Any]:
    body = await request.json()
    if not isinstance(body, dict):
        raise BodyError(f"body must be a JSON object, got {type(body).__name__}")
    return body


_MISSING = object()


def _field(body: dict[str, Any], name: str, kind: type, default: Any = _MISSING) -> Any:
    """``body[name]`` checked to be a ``kind`` (ints are floats too; bools are not ints)."""
    if name not in body or body[name] is None:
        if default is _MISSING:
            raise BodyError(f"field {name!r} ({kind.__name__}) is required")
        return default
    v = body[name]
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        raise BodyError(f"field {name!r} must be {kind.__name__}, got {v!r:.60}")
    return v


def build_controller_app(ctl: RolloutController, api_key: Optional[str]) -> web.Application:
    expected = None if api_key is None else f"Bearer {api_key}"
    unauthorized = DropLog("rollout controller", "request")

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        import hmac

        if expected is not None and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected.encode()):
            unauthorized(request.remote, f"{request.method} {request.path} without the run's API key")
            return web.json_response({"error": "missing or wrong API key"}, status=401)
        try:
            return await handler(request)
        except json.JSONDecodeError as e:
            return web.json_response({"error": f"body is not valid JSON: {e}"}, status=400)
        except BodyError as e:
            return web.json_response({"error": str(e)}, status=400)
        except RecursionError:
            return web.json_response({"error": "body is nested too deeply"}, status=400)
        except NoServerError as e:
            return web.json_response({"error": str(e)}, status=503)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return web.json_response({"error": f"{e.reason}: {request.method} {request.path}"}, status=e.status)

    async def admit(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(await ctl.admit(_field(body, "wait_s", float, ADMIT_WAIT_S)))

    async def done(request: web.Request) -> web.Response:
        body = await _body(request)
        await ctl.done(_field(body, "version", int), _field(body, "ok", bool), _field(body, "error", str, ""),
                       _field(body, "index", int, None), _field(body, "id", str, ""),
                       _field(body, "timed_out", bool, False), _field(body, "filtered", bool, False))
        return web.json_response({"success": True})

    async def generate(request: web.Request) -> web.Response:
        body = await _body(request)
        prompt = body.get("input_ids")
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            raise BodyError("input_ids must be a non-empty list of token ids (integers >= 0)")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BodyError("sampling_params must be an object")
        params = dict(sp)
        n = params.pop("n", 1)
        most = ctl.spec.server_limits.max_sequences_per_request
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= most:
            raise BodyError(f"sampling_params.n={n!r}: must be an integer in [1, {most}]")
        rid = str(body.get("rid") or f"req{id(body)}")
        seed = params.get("seed")
        images = body.get("image_data")  # VL policies: the prompt's images, base64 / data URLs (servers check them)
        if images is not None and (not isinstance(images, list) or not all(isinstance(x, str) and x for x in images)):
            raise BodyError("image_data must be a list of base64 images or data: URLs")

        async def one(i: int):
            p = dict(params) if seed is None else dict(params, seed=int(seed) + i)
            return await ctl.pool.complete(f"{rid}-{i}", prompt, p, images)
        results = await asyncio.gather(*(one(i) for i in range(n)))
        return web.json_response([{"prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                                   "logprobs": r.logprobs, "versions": r.versions,
                                   "finish_reason": r.finish_reason, "resubmits": r.resubmits,
                                   "servers": r.servers,
                                   "routed_experts": None if r.routed_experts is None
                                   else encode_routed_experts(r.routed_experts)} for r in results])

    async def state(request: web.Request) -> web.Response:
        return web.json_response(ctl.state())

    app = web.Application(middlewares=[guard], client_max_size=16 << 20)
    app.add_routes([web.post("/admit", admit), web.post("/done", done), web.post("/generate", generate),
                    web.get("/state", state)])
    return app


# ---------------------------------------------------------------- trainer side (ZMQ RPC)


def master_handlers(ctl: RolloutController, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """Handlers the master calls (from the RPC thread; each hops onto the event loop)."""

    def on_loop(fn, *args, timeout: float = 60.0):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    def counts(payload: dict) -> dict:
        st = on_loop(ctl.state)
        # msgpack keys must be plain: versions as strings
        for k in ("admitted", "failed", "finished"):
            st[k] = {str(v): n for v, n in st[k].items()}
        return st

    def update_weights(payload: dict) -> dict:
        on_loop(ctl.request_round, int(payload["version"]), payload.get("handle"), payload.get("path"),
                payload.get("broadcast"), payload.get("shm_delta"))
        return {"queued": True}

    def weight_plan(payload: dict) -> dict:
        return on_loop(ctl.weight_plan, str(payload["writer_host"]))

    def finish(payload: dict) -> dict:
        """No new rollouts (workers asking are told to stop). The controller itself keeps
        serving, as a service, until the launcher stops the run, so that no rollout worker
        finds it gone while the trainer finishes its evaluation and checkpoint."""
        def _stop():
            ctl.stopping = True
            asyncio.ensure_future(ctl._notify())
        on_loop(_stop)
        return {"stopped": True}

    def trained(payload: dict) -> dict:
        """The trainer took these rollouts into a step: they are no longer pending."""
        on_loop(ctl.ledger.trained, [str(i) for i in payload["ids"]])
        return {"ok": True}

    def data_state(payload: dict) -> dict:
        return on_loop(ctl.ledger.state)

    return {"counts": counts, "update_weights": update_weights, "weight_plan": weight_plan, "finish": finish,
            "trained": trained, "data_state": data_state,
            "ping": lambda payload: {"worker": "rollout_controller"}}
