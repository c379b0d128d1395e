"""Generation server: a generation backend behind SGLang's native HTTP API.

Why SGLang's API: on GPU the gen server IS SGLang; the gen manager and rollout
workers talk to both through one client (:mod:`realflow.system.gen_client`).
Endpoints (JSON in and out; bad input -> 4xx ``{"error": message}``):

* ``POST /generate``  ``input_ids`` (list, or list of lists), ``sampling_params``
  (object, or one per prompt), ``return_logprob``, ``rid``.  One prompt with
  ``n == 1`` answers an object, otherwise a list (prompt-major, samples
  within).  Each has ``output_ids``, ``text`` (with a tokenizer) and
  ``meta_info``: ``id``, ``finish_reason`` ``{type: stop|length|abort}``,
  ``prompt_tokens``, ``completion_tokens``, ``weight_version`` (of the last
  token), ``output_token_logprobs`` (``[[logprob, token_id, null], ...]``) and
  ``output_token_weight_versions`` (realflow's addition: one per token).
* ``POST /update_weights_from_disk`` ``{model_path, weight_version?}``.
* ``POST /update_weights_from_tensor`` ``{shm_handle, format: hf|megatron,
  weight_version?}``: the handle of :func:`realflow.comm.shm.put_tensors`
  (SGLang's own endpoint carries pickled tensors; no pickle here).
* ``POST /pause_generation`` ``{mode}``: ``abort`` (default, as SGLang) ends
  running and queued requests now, each answering what it generated so far
  with finish type ``abort`` (the manager resubmits prompt + prefix);
  ``retract`` holds them: after ``/continue_generation`` they are re-prefilled
  under the weights then in force and their answers carry all tokens, with the
  version of each.  While paused, new requests queue.
* ``POST /continue_generation``, ``POST /flush_cache``, ``POST /abort_request``
  ``{rid}``, ``GET /health``, ``GET /get_model_info``, ``GET /metrics``
  (Prometheus text).

Concurrency: the backend is stepped by ONE thread; HTTP handlers (asyncio)
only enqueue under the same lock, so requests join the running batch at the
next step.  The lock is handed to a waiting handler before the next step (a
pause, an abort or a metrics read takes effect between two steps, not when
the batch has drained).  The server binds 127.0.0.1 unless told otherwise.

Entry point::

    python -m realflow.system.gen_server --model PATH --backend builtin --port 0 \\
        --import parallel.generation
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any, Iterator, Optional

from aiohttp import web

from realflow.api.generation import (PAUSE_MODES, BackendConfig, ExternalServerBackend,
                                     GenerationResult, SamplingParams, generation_backends)

__all__ = ["GenServer", "build_app", "main"]

logger = logging.getLogger("realflow.gen_server")

MAX_BODY_BYTES = 64 << 20


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
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0

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
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def for_step(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._waiting)
        with self._lock:
            yield


class GenServer:
    """Owns the backend, its step thread and the bookkeeping of pending requests."""

    def __init__(self, backend: Any, model_path: str = "") -> None:
        self.backend = backend
        self.model_path = model_path
        self.lock = _BackendLock()  # serialises every backend call (see _BackendLock)
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
    if not fut.done():
        fut.set_result(value)


# ---------------------------------------------------------------- request parsing


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    return body


def _parse_generate(body: dict[str, Any]) -> tuple[list[Any], list[SamplingParams], list[str], bool, bool]:
    known = {"input_ids", "sampling_params", "return_logprob", "rid", "stream", "text"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown} (known: {sorted(known)})")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by this server")
    if "input_ids" not in body:
        if "text" in body:
            raise BadRequest("text prompts are not supported: send input_ids")
        raise BadRequest("input_ids is required")
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    sp = body.get("sampling_params")
    try:
        if isinstance(sp, list):
            if len(sp) != len(prompts):
                raise BadRequest(f"sampling_params has {len(sp)} entries for {len(prompts)} prompts")
            params = [SamplingParams.from_dict(d) for d in sp]
        else:
            params = [SamplingParams.from_dict(sp) for _ in prompts]
    except ValueError as e:
        raise BadRequest(str(e)) from None
    rid = body.get("rid")
    if rid is None:
        base = uuid.uuid4().hex
        rids = [base] if single else [f"{base}-p{i}" for i in range(len(prompts))]
    elif single and isinstance(rid, str) and rid:
        rids = [rid]
    elif not single and isinstance(rid, list) and len(rid) == len(prompts) and all(
            isinstance(r, str) and r for r in rid):
        rids = list(rid)
    else:
        raise BadRequest("rid must be a non-empty string (one prompt) or a list of them (one per prompt)")
    if len(set(rids)) != len(rids):
        raise BadRequest("rid values must be unique")
    ret_lp = body.get("return_logprob", False)
    if not isinstance(ret_lp, bool):
        raise BadRequest(f"return_logprob must be a boolean, got {ret_lp!r}")
    one_object = single and params[0].n == 1
    return prompts, params, rids, ret_lp, one_object


def _result_json(server: GenServer, r: GenerationResult, return_logprob: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": len(r.prompt_ids),
        "completion_tokens": len(r.output_ids),
        "weight_version": r.weight_version if r.output_versions else server.backend.weight_version,
        "output_token_weight_versions": r.output_versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_ids)]
    out: dict[str, Any] = {"output_ids": r.output_ids, "meta_info": meta}
    text = server.backend.decode(r.output_ids)
    if text is not None:
        out["text"] = text
    return out


# ---------------------------------------------------------------- handlers


def build_app(server: GenServer) -> web.Application:
    """The aiohttp application for ``server`` (its step thread is started on startup)."""

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as e:
            server.bad_requests_total += 1
            return web.json_response({"error": str(e), "success": False}, status=400)
        except web.HTTPException as e:
            if e.status >= 400:
                server.bad_requests_total += 1
                return web.json_response({"error": f"{e.reason}: {request.method} {request.path}",
                                          "success": False}, status=e.status)
            raise
        except Exception as e:  # noqa: BLE001 - the server must outlive any request
            logger.exception("error handling %s", request.path)
            return web.json_response({"error": f"{type(e).__name__}: {e}", "success": False},
                                     status=500)

    async def generate(request: web.Request) -> web.Response:
        prompts, params, rids, ret_lp, one_object = _parse_generate(await _json(request))
        waiters = server.submit(prompts, params, rids)
        try:
            groups = [await w.future for w in waiters]
        except asyncio.CancelledError:  # client went away: free the batch slots
            for rid in rids:
                server.abort(rid)
            raise
        out = [_result_json(server, r, ret_lp)
               for g in groups for r in sorted(g, key=lambda x: x.index)]
        return web.json_response(out[0] if one_object else out)

    async def update_from_disk(request: web.Request) -> web.Response:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path (a checkpoint directory) is required")
        version = _version(body)

        def work() -> int:
            with server.lock:
                return server.backend.update_weights_from_disk(path, version)

        try:
            v = await asyncio.to_thread(work)
        except (ValueError, OSError, KeyError) as e:
            raise BadRequest(f"update_weights_from_disk({path}): {e}") from None
        server.wake.set()
        return web.json_response({"success": True, "message": f"loaded {path}", "weight_version": v})

    async def update_from_tensor(request: web.Request) -> web.Response:
        body = await _json(request)
        handle = body.get("shm_handle")
        if not isinstance(handle, dict):
            raise BadRequest("shm_handle (from realflow.comm.shm.put_tensors) is required")
        fmt = body.get("format", "hf")
        version = _version(body)

        def work() -> int:
            from realflow.comm.shm import ShmError, take_tensors

            try:
                tensors = take_tensors(handle)
            except ShmError as e:
                raise BadRequest(str(e)) from None
            with server.lock:
                return server.backend.update_weights_from_tensors(tensors, fmt, version)

        try:
            v = await asyncio.to_thread(work)
        except (ValueError, KeyError) as e:
            raise BadRequest(f"update_weights_from_tensor: {e}") from None
        server.wake.set()
        return web.json_response({"success": True, "message": "updated", "weight_version": v})

    async def pause(request: web.Request) -> web.Response:
        body = await _json(request) if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: expected one of {PAUSE_MODES}")
        n = server.pause(mode)
        return web.json_response({"success": True, "mode": mode, "aborted": n})

    async def resume(request: web.Request) -> web.Response:
        server.resume()
        return web.json_response({"success": True})

    async def flush(request: web.Request) -> web.Response:
        with server.lock:
            server.backend.flush_cache()
        server.wake.set()
        return web.json_response({"success": True})

    async def abort(request: web.Request) -> web.Response:
        body = await _json(request)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise BadRequest("rid (string) is required")
        return web.json_response({"success": True, "aborted": server.abort(rid)})

    async def health(request: web.Request) -> web.Response:
        alive = server.thread.is_alive()
        body = {"status": "ok" if alive else "dead", "paused": server.paused,
                "weight_version": server.backend.weight_version, "last_step_error": server.step_error}
        return web.json_response(body, status=200 if alive else 503)

    async def model_info(request: web.Request) -> web.Response:
        b = server.backend
        return web.json_response({"model_path": server.model_path, "weight_version": b.weight_version,
                                  "max_context": b.max_context, "vocab_size": b.vocab_size})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=server.metrics_text(), content_type="text/plain")

    async def on_startup(app: web.Application) -> None:
        server.start()

    async def on_cleanup(app: web.Application) -> None:
        server.stop()

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    app.add_routes([
        web.post("/generate", generate),
        web.post("/update_weights_from_disk", update_from_disk),
        web.post("/update_weights_from_tensor", update_from_tensor),
        web.post("/pause_generation", pause),
        web.post("/continue_generation", resume),
        web.post("/flush_cache", flush),
        web.post("/abort_request", abort),
        web.get("/health", health),
        web.get("/get_model_info", model_info),
        web.get("/metrics", metrics),
    ])
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _version(body: dict[str, Any]) -> Optional[int]:
    v = body.get("weight_version")
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise BadRequest(f"weight_version must be an integer, got {v!r}")
    return v


# ---------------------------------------------------------------- entry point


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    actual = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"READY http://{host}:{actual}", flush=True)
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m realflow.system.gen_server",
                                 description="generation server (SGLang-compatible HTTP API)")
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--backend", default="builtin", help="generation backend name (registry)")
    ap.add_argument("--import", dest="imports", action="append", default=[],
                    help="module to import first (registers backends); repeatable")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (printed as READY url)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gen_server %(levelname)s %(message)s")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    for mod in a.imports:
        importlib.import_module(mod)
    factory = generation_backends.get(a.backend)
    cfg = BackendConfig(model_path=a.model, tokenizer_path=a.tokenizer,
                        max_running_requests=a.max_running_requests, max_seq_len=a.max_seq_len,
                        dtype=a.dtype, seed=a.seed)
    backend = factory(cfg)
    if isinstance(backend, ExternalServerBackend) and not hasattr(backend, "step"):
        return backend.serve(a.host, a.port)
    server = GenServer(backend, a.model)
    try:
        asyncio.run(_serve(build_app(server), a.host, a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
