"""Generation server: a generation backend behind SGLang's native HTTP API.

Why SGLang's API: on GPU the gen server IS SGLang; the gen manager and rollout
workers talk to both through one client (:mod:`realflow.rollout.gen_client`).
Endpoints (JSON in and out; bad input -> 4xx ``{"error": message}``):

* ``POST /generate``  ``input_ids`` (list, or list of lists), ``sampling_params``
  (object, or one per prompt), ``return_logprob``, ``rid``.  One prompt with
  ``n == 1`` answers an object, otherwise a list (prompt-major, samples
  within).  Each has ``output_ids``, ``text`` (with a tokenizer) and
  ``meta_info``: ``id``, ``finish_reason`` ``{type: stop|length|abort}``,
  ``prompt_tokens``, ``completion_tokens``, ``weight_version`` (of the last
  token), ``output_token_logprobs`` (``[[logprob, token_id, null], ...]``) and
  ``output_token_weight_versions`` (realflow's addition: one per token).
  ``return_routed_experts`` (bool, SGLang's request flag; default: on for MoE models) adds
  ``routed_experts`` (base64, as SGLang) with ``routed_experts_shape`` ``[prompt + output - 1,
  layers, topk]`` and ``routed_experts_dtype`` (:mod:`realflow.api.routing`).
  ``image_data`` (vision-language models, SGLang's field): each prompt's images, base64 or
  data URLs, with one ``image_token_id`` per image in ``input_ids`` or every image's expanded
  placeholders (:mod:`.gen_server_images`); a text model answers 400.
* ``POST /update_weights_from_disk`` ``{model_path, weight_version?}``.
* ``POST /update_weights_from_tensor`` ``{shm_handle, format: hf|megatron,
  weight_version?, unlink?}``: the handle of :func:`realflow.comm.shm.put_tensors`
  (SGLang's own endpoint carries pickled tensors; no pickle here). ``unlink: false``
  leaves the segment for other servers (the sender releases it). ``stage: true``
  (backends that say ``weight_staging`` in ``/health``) builds the new weights
  beside the ones in use while generation goes on; ``POST /commit_staged_weights``
  ``{weight_version}`` then swaps them in -- the controller's pause shrinks to that.
  ``delta`` (a manifest of :mod:`realflow.weights.delta`): the tensors are a versioned
  update on a base this server must hold, digests checked (:mod:`.gen_server_delta`).
* ``GET /weights_digest``: digests of the weights in use and of the delta base.
* ``POST /init_weights_update_group``, ``/update_weights_from_distributed``,
  ``/destroy_weights_update_group``: weights by torch.distributed broadcast from a
  writer on another host (see :mod:`realflow.rollout.gen_server_weight_group`).
* ``POST /pause_generation`` ``{mode}``: ``abort`` (default, as SGLang) ends
  running and queued requests now, each answering what it generated so far
  with finish type ``abort`` (the manager resubmits prompt + prefix);
  ``retract`` holds them: after ``/continue_generation`` they are re-prefilled
  under the weights then in force and their answers carry all tokens, with the
  version of each.  While paused, new requests queue.
* ``POST /continue_generation``, ``POST /flush_cache``, ``POST /abort_request``
  ``{rid}``, ``GET /health``, ``GET /get_model_info``, ``GET /metrics``
  (Prometheus text).

This module is the HTTP side only: handlers parse requests and call the
server's state machine (:class:`~realflow.rollout.gen_server_state.GenServer`,
which owns the backend, its step thread and the lock; concurrency is described
there).  The server binds 127.0.0.1 unless told otherwise.

Entry point::

    python -m realflow.rollout.gen_server --model PATH --backend builtin --port 0 [--import MODULE]

(the built-in generation backends load by themselves, :mod:`realflow.plugins`; ``--import``
adds a module that registers another one.)
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import socket
import json
import logging
import sys
import uuid
from dataclasses import fields
from typing import Any, Optional

from aiohttp import web

from realflow.api.routing import encode_routed_experts
from realflow.api.generation import (PAUSE_MODES, BackendConfig, ExternalServerBackend, GenerationResult,
                                     GenServerLimits, SamplingParams, check_inference_memory,
                                     generation_backends)
from realflow.base.fault_injection import fault_point
from realflow.plugins import load_plugins
from realflow.rollout.gen_server_images import parse_image_data, prepare_images
from realflow.rollout.gen_server_state import BadRequest, GenServer, Overloaded
from realflow.rollout.gen_server_weight_group import weight_group_routes
from realflow.rollout.request_log import RequestLog

__all__ = ["GenServer", "build_app", "serve", "main"]

logger = logging.getLogger("realflow.gen_server")

#: sequences one /generate may ask for by default (prompts x n): a request of 10 million one-token
#: samples would otherwise hold the engine for minutes and grow without bound before anything runs
MAX_SEQUENCES_PER_REQUEST = GenServerLimits().max_sequences_per_request
#: bodies larger than this are parsed on a worker thread, so /health never waits behind a parse
_PARSE_ON_THREAD_BYTES = 256 << 10
#: answers of more sequences than this are serialised on a worker thread (same reason)
_SERIALISE_ON_THREAD = 256


# ---------------------------------------------------------------- request parsing


async def _json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = await asyncio.to_thread(json.loads, raw) if len(raw) > _PARSE_ON_THREAD_BYTES else json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    return body


def _parse_generate(body: dict[str, Any]) -> tuple[list[Any], list[SamplingParams], list[str], bool, bool]:
    known = {"input_ids", "sampling_params", "return_logprob", "rid", "stream", "text", "return_routed_experts",
             "image_data"}
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
    routed = body.get("return_routed_experts")
    if routed is not None:
        if not isinstance(routed, bool):
            raise BadRequest(f"return_routed_experts must be a boolean, got {routed!r}")
        for p in params:
            p.return_routed_experts = routed
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
    if r.routed_experts is not None:
        meta.update(encode_routed_experts(r.routed_experts))
    out: dict[str, Any] = {"output_ids": r.output_ids, "meta_info": meta}
    text = server.backend.decode(r.output_ids)
    if text is not None:
        out["text"] = text
    return out


# ---------------------------------------------------------------- handlers


def build_app(server: GenServer, api_key: Optional[str] = None, bind_host: str = "127.0.0.1",
              request_log: Optional[RequestLog] = None) -> web.Application:
    """The aiohttp application for ``server`` (its step thread is started on startup).

    With ``api_key`` every request must carry ``Authorization: Bearer <api_key>`` (as
    SGLang's ``--api-key``); anything else is answered 401 before it is parsed.
    """
    expected = None if api_key is None else f"Bearer {api_key}"
    max_body = server.admission.limits.max_body_bytes

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        if expected is not None and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected.encode()):
            server.bad_requests_total += 1
            server.unauthorized(request.remote, f"{request.method} {request.path} without the run's API key")
            return web.json_response({"error": "missing or wrong API key", "success": False}, status=401)
        try:
            return await handler(request)
        except BadRequest as e:
            server.bad_requests_total += 1
            return web.json_response({"error": str(e), "success": False}, status=400)
        except Overloaded as e:
            return web.json_response({"error": str(e), "success": False, "retry_after_s": e.retry_after_s},
                                     status=429, headers={"Retry-After": str(e.retry_after_s)})
        except web.HTTPRequestEntityTooLarge:
            server.bad_requests_total += 1
            return web.json_response({"error": f"body of {request.content_length} bytes is larger than this "
                                               f"server takes: max_body_bytes={max_body}", "success": False},
                                     status=413)
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
        fault_point("generate")  # (tests only: realflow.base.fault_injection)
        body = await _json(request)
        prompts, params, rids, ret_lp, one_object = _parse_generate(body)
        images = None
        sources = parse_image_data(body, len(prompts), not isinstance(body["input_ids"][0], list))
        if sources is not None:
            lim = server.admission.limits
            prompts, images = await asyncio.to_thread(
                prepare_images, prompts, sources, getattr(server.backend, "image_tokens", None),
                lim.min_pixels, lim.max_pixels)
        waiters = await server.submit(prompts, params, rids, images)
        try:
            groups = await asyncio.gather(*(w.future for w in waiters))
        except asyncio.CancelledError:  # client went away: free the batch slots
            server.abort_later(rids)
            raise
        failed = [r for g in groups for r in g if r.finish_reason.get("type") == "error"]
        if failed:  # e.g. non-finite logits after a bad weight update: say so, never return garbage
            server.failed_requests_total += len(failed)
            first = failed[0].finish_reason
            return web.json_response({"error": first.get("message", "generation failed"), "success": False,
                                      "rid": [r.rid for r in failed],
                                      "weight_version": first.get("weight_version",
                                                                  server.backend.weight_version)},
                                     status=500)
        if request_log is not None:
            request_log.record(r for g in groups for r in g)

        def answer() -> str:
            out = [_result_json(server, r, ret_lp) for g in groups for r in sorted(g, key=lambda x: x.index)]
            return json.dumps(out[0] if one_object else out)

        n_results = sum(len(g) for g in groups)
        text = await asyncio.to_thread(answer) if n_results > _SERIALISE_ON_THREAD else answer()
        return web.Response(text=text, content_type="application/json")

    async def update_from_disk(request: web.Request) -> web.Response:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path (a checkpoint directory) is required")
        version = _version(body)

        def work() -> int:
            with server.lock:
                v = server.backend.update_weights_from_disk(path, version)
                server.delta.plain_update(False)
                return v

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
        unlink = body.get("unlink", True)
        if not isinstance(unlink, bool):
            raise BadRequest(f"unlink must be a boolean, got {unlink!r}")

        stage = server.stage_flag(body)

        def work() -> int:
            from realflow.comm.shm import ShmError, take_tensors

            try:
                tensors = take_tensors(handle, unlink=unlink)
            except ShmError as e:
                raise BadRequest(str(e)) from None
            return server.load_weights(tensors, fmt, version, stage, body.get("delta"))

        try:
            v = await asyncio.to_thread(work)
        except (ValueError, KeyError) as e:
            raise BadRequest(f"update_weights_from_tensor: {e}") from None
        return web.json_response(server.weights_reply(v, stage))

    async def commit_staged(request: web.Request) -> web.Response:
        body = await _json(request)
        version = _version(body)
        if not server.can_stage:
            raise BadRequest("commit_staged_weights: this backend cannot stage weights")

        def work() -> int:
            with server.stage_lock, server.lock:
                v = server.backend.commit_staged_weights(version)
                server.delta.committed(v)
                return v
        try:
            v = await asyncio.to_thread(work)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        server.wake.set()
        return web.json_response({"success": True, "message": "committed", "weight_version": v})

    async def pause(request: web.Request) -> web.Response:
        body = await _json(request) if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: expected one of {PAUSE_MODES}")
        n = await server.pause(mode)
        return web.json_response({"success": True, "mode": mode, "aborted": n})

    async def resume(request: web.Request) -> web.Response:
        await server.resume()
        return web.json_response({"success": True})

    async def flush(request: web.Request) -> web.Response:
        await server.flush_cache()
        return web.json_response({"success": True})

    async def abort(request: web.Request) -> web.Response:
        body = await _json(request)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise BadRequest("rid (string) is required")
        return web.json_response({"success": True, "aborted": await server.abort(rid)})

    async def health(request: web.Request) -> web.Response:
        alive = server.thread.is_alive()
        body = {"status": "ok" if alive else "dead", "paused": server.paused,
                "weight_version": server.backend.weight_version, "last_step_error": server.step_error,
                "weight_staging": server.can_stage, "hostname": socket.gethostname(),
                "weight_group": server.weight_group, **server.delta.describe()}
        return web.json_response(body, status=200 if alive else 503)

    async def weights_digest(request: web.Request) -> web.Response:
        """The digests of the weights in use (the engine's, if it can say) and of the delta base."""
        fn = getattr(server.backend, "weights_digest", None)

        def work() -> Optional[str]:
            with server.lock:
                return fn() if callable(fn) else None
        engine = await asyncio.to_thread(work)
        return web.json_response({"weight_version": server.backend.weight_version, "engine": engine,
                                  **server.delta.describe()})

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

    group_routes, group_cleanup = weight_group_routes(server, _json, _version, bind_host)
    app = web.Application(middlewares=[errors], client_max_size=max_body)
    app.add_routes(group_routes)
    app.add_routes([
        web.post("/generate", generate),
        web.post("/update_weights_from_disk", update_from_disk),
        web.post("/update_weights_from_tensor", update_from_tensor),
        web.post("/commit_staged_weights", commit_staged),
        web.get("/weights_digest", weights_digest),
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
    app.on_cleanup.append(group_cleanup)
    return app


def _version(body: dict[str, Any]) -> Optional[int]:
    v = body.get("weight_version")
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise BadRequest(f"weight_version must be an integer, got {v!r}")
    return v


# ---------------------------------------------------------------- entry point


async def serve(app: web.Application, host: str, port: int, on_ready: Any = None) -> None:
    """Serve ``app`` until cancelled; ``on_ready(url)`` runs once the port is bound."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    actual = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://{host}:{actual}"
    print(f"READY {url}", flush=True)
    if on_ready is not None:
        on_ready(url)
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m realflow.rollout.gen_server",
                                 description="generation server (SGLang-compatible HTTP API)")
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--backend", default="builtin", help="generation backend name (registry)")
    ap.add_argument("--import", dest="imports", action="append", default=[],
                    help="module to import first (registers more backends); repeatable")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (printed as READY url)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + new tokens of one sequence, the length of each KV-cache slot (default: the "
                         "model's context; SGLang: --context-length)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="fraction of the device's free memory the KV cache may take, in (0, 1] "
                         "(SGLang: --mem-fraction-static)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="GPU: decode without CUDA graphs")
    ap.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    ap.add_argument("--no-prefix-sharing", action="store_true",
                    help="every sequence prefills its own prompt (no shared or cached KV blocks)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--log-requests", default=None, metavar="FILE",
                    help="append the first --log-requests-max answered sequences (prompt and answer ids and text) "
                         "to FILE as JSON lines")
    ap.add_argument("--log-requests-max", type=int, default=100)
    ap.add_argument("--lora-r", type=int, default=None,
                    help="the policy trains LoRA adapters of this rank: updates may carry adapters only")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (scaling alpha / r)")
    ap.add_argument("--lora-target-modules", default="", help="comma-separated HF module names (SGLang's flag)")
    ap.add_argument("--api-key-env", default=None,
                    help="environment variable holding the API key clients must send (Bearer)")
    for f in fields(GenServerLimits):
        ap.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help=f.metadata["help"])
    a = ap.parse_args(argv)
    try:
        limits = GenServerLimits(**{f.name: getattr(a, f.name) for f in fields(GenServerLimits)}).validate()
        check_inference_memory(a.gpu_memory_utilization, a.max_model_len, prefix="--")
    except ValueError as e:
        ap.error(str(e).replace("--max_model_len", "--max-model-len")
                 .replace("--gpu_memory_utilization", "--gpu-memory-utilization"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gen_server %(levelname)s %(message)s")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    load_plugins(a.imports, kinds=("generation",))
    factory = generation_backends.get(a.backend)
    cfg = BackendConfig(model_path=a.model, tokenizer_path=a.tokenizer,
                        max_running_requests=a.max_running_requests, max_model_len=a.max_model_len,
                        gpu_memory_utilization=a.gpu_memory_utilization,
                        dtype=a.dtype, seed=a.seed, enforce_eager=a.enforce_eager,
                        kv_block_size=a.kv_block_size, prefix_sharing=not a.no_prefix_sharing)
    if (a.lora_r is None) != (a.lora_alpha is None):
        ap.error("--lora-r and --lora-alpha go together")
    if a.lora_r is not None:
        cfg.lora = {"r": a.lora_r, "alpha": a.lora_alpha,
                    "target_modules": [t for t in a.lora_target_modules.split(",") if t]}
    backend = factory(cfg)
    if isinstance(backend, ExternalServerBackend) and not hasattr(backend, "step"):
        return backend.serve(a.host, a.port)
    server = GenServer(backend, a.model, limits)
    try:
        api_key = os.environ[a.api_key_env] if a.api_key_env else None
        log = RequestLog(a.log_requests, a.log_requests_max, backend.decode) if a.log_requests else None
        asyncio.run(serve(build_app(server, api_key, bind_host=a.host, request_log=log), a.host, a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
