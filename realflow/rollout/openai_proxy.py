"""An OpenAI-compatible HTTP proxy in front of the generation servers, recording sessions.

Agents written against the OpenAI API (the official ``openai`` client, or any framework
built on it) talk to the policy through ``POST /v1/chat/completions`` and
``POST /v1/completions`` (streaming or not, ``n``, ``temperature``, ``top_p``, and
``top_k`` / ``min_p`` as extra body fields as in vLLM and SGLang, ``max_tokens``, ``stop``,
``seed``, ``logprobs``, ``tools`` through the chat template)
and ``GET /v1/models``. Each agent run is a *session* with its own API key
(``Authorization: Bearer <key>``); every completion served in it is recorded with its
exact prompt and output token ids, behaviour log-probs and weight versions
(:class:`~realflow.api.agent_session.RecordedCompletion`), which is what trains.
``POST /v1/rl/reward`` (``{"completion_id", "reward", "choice"?}``) sets a reward on
a completion of the session.

The proxy runs inside a rollout worker, on its event loop, bound to loopback; its
generation requests go through the rollout controller, so they are routed, bounded
and resumed across weight updates like any other. Streaming responses are sent once
the completion is finished (token-sized deltas): generation may be interrupted and
resumed under new weights, and a client must only ever see tokens that stay.

Vision-language policies (``ProxyConfig.image_token_id`` set): chat messages may hold
``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`` parts (data URLs
only: workers fetch nothing). The chat template renders each as the model's image placeholder,
the proxy expands it to the image's feature count with the servers' pixel budget, and the images
go to generation beside the ids (``GenerateFn``'s ``image_data``); the recorded completion keeps
them (``images``) for the trainer. A text model answers images with a 400.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from aiohttp import web

from realflow.api.agent import Completion
from realflow.api.agent_session import RecordedCompletion
from realflow.rollout.chat_tokens import ChatTokenizer, message_images, normalize_messages, parse_tool_calls
from realflow.rollout.openai_requests import APIError, ChatRequest, CompletionRequest, parse_chat, parse_completion

__all__ = ["OpenAIProxy", "ProxyConfig", "ProxySession", "UpstreamError", "GenerateFn"]

logger = logging.getLogger("realflow.rollout.proxy")

#: (input_ids, sampling_params, n, request id) -> n completions; called with ``image_data=[...]`` (base64 /
#: data URLs, in prompt order) too when the prompt has images
GenerateFn = Callable[..., Awaitable[list[Completion]]]


class UpstreamError(Exception):
    """The controller / a server refused a request (4xx): passed on to the agent with its status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ProxyConfig:
    model_name: str = "policy"  # the ``model`` agents must ask for
    chat_template: Optional[str] = None  # None: the tokenizer's, else a plain one
    max_tokens: int = 256  # default and cap of max_tokens per completion
    max_n: int = 64
    max_completions_per_session: int = 1024
    max_body_bytes: int = 8 << 20
    # vision-language policy: its image placeholder token and spatial merge size (None: a text model,
    # which refuses images), and the servers' pixel budget (None: realflow.api.images.ImageProcessing's)
    image_token_id: Optional[int] = None
    image_merge_size: int = 2
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None


@dataclass
class ProxySession:
    """One agent run: its key, what it may call, and what it recorded."""

    key: str
    seed: int
    base_url: str
    model: str
    records: list[RecordedCompletion] = field(default_factory=list)
    turns: list[Any] = field(default_factory=list)  # chat_tokens._Turn per chat completion choice
    calls: int = 0
    inflight: set = field(default_factory=set)  # generation tasks, cancelled when the session ends


class OpenAIProxy:
    def __init__(self, generate: GenerateFn, tokenizer: Any, cfg: Optional[ProxyConfig] = None) -> None:
        self.cfg = cfg or ProxyConfig()
        self.generate = generate
        self.chat = ChatTokenizer(tokenizer, self.cfg.chat_template)
        self.tok = tokenizer
        self.sessions: dict[str, ProxySession] = {}
        self.base_url = ""
        self._runner: Optional[web.AppRunner] = None
        self.n_requests = self.n_errors = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://{host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, seed: int) -> ProxySession:
        s = ProxySession(key=f"rf-{secrets.token_urlsafe(24)}", seed=int(seed), base_url=self.base_url,
                         model=self.cfg.model_name)
        self.sessions[s.key] = s
        return s

    def close_session(self, key: str) -> list[RecordedCompletion]:
        """End a session (its key stops working) and return what it recorded."""
        s = self.sessions.pop(key, None)
        if s is None:
            return []
        for t in list(s.inflight):  # an agent timed out or failed: its requests are not waited for
            t.cancel()
        return s.records

    # ------------------------------------------------------------ HTTP

    def app(self) -> web.Application:
        @web.middleware
        async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
            self.n_requests += 1
            try:
                return await handler(request)
            except APIError as e:
                self.n_errors += 1
                return web.json_response(e.body(), status=e.status)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                self.n_errors += 1
                kind = "invalid_request_error" if e.status < 500 else "server_error"
                return web.json_response(APIError(e.status, f"{e.reason}: {request.method} {request.path}",
                                                  kind=kind).body(), status=e.status)
            except Exception as e:  # noqa: BLE001 - generation failed upstream: the agent gets a 5xx
                self.n_errors += 1
                status = 504 if isinstance(e, TimeoutError) else 502
                logger.warning("proxy %s %s -> %d: %s: %s", request.method, request.path, status,
                               type(e).__name__, e)
                return web.json_response(APIError(status, f"generation failed: {type(e).__name__}: {e}",
                                                  kind="server_error").body(), status=status)

        app = web.Application(middlewares=[errors], client_max_size=self.cfg.max_body_bytes)
        app.add_routes([web.post("/v1/chat/completions", self._chat), web.post("/v1/completions", self._completion),
                        web.get("/v1/models", self._models), web.post("/v1/rl/reward", self._reward)])
        return app

    def _session(self, request: web.Request) -> ProxySession:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        s = self.sessions.get(key)
        if s is None:
            raise APIError(401, "Incorrect API key provided: not an open realflow agent session",
                           code="invalid_api_key")
        return s

    @staticmethod
    async def _json(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except ValueError as e:
            raise APIError(400, f"We could not parse the JSON body of your request: {e}") from None

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "realflow"}]})

    async def _reward(self, request: web.Request) -> web.Response:
        s = self._session(request)
        body = await self._json(request)
        if not isinstance(body, dict) or not isinstance(body.get("completion_id"), str):
            raise APIError(400, "Missing required parameter: 'completion_id'", param="completion_id")
        r = body.get("reward")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or r != r:
            raise APIError(400, f"Invalid value for 'reward': expected a number, got {r!r}", param="reward")
        choice = body.get("choice")
        hit = [c for c in s.records if c.id == body["completion_id"] and (choice is None or c.choice == choice)]
        if not hit:
            raise APIError(404, f"No completion {body['completion_id']!r} (choice {choice}) in this session",
                           param="completion_id")
        for c in hit:
            c.reward = float(r)
        return web.json_response({"success": True, "completions": len(hit)})

    # ------------------------------------------------------------ generation

    def _sampling(self, s: ProxySession, req: Any) -> dict[str, Any]:
        limit = self.cfg.max_tokens
        if req.max_tokens is not None and req.max_tokens > limit:
            raise APIError(400, f"Invalid value for 'max_tokens': {req.max_tokens} is over this proxy's limit "
                                f"of {limit} tokens per completion", param="max_tokens")
        eos = self.tok.eos_token_id
        s.calls += 1
        return {"max_new_tokens": req.max_tokens or limit, "temperature": req.temperature, "top_p": req.top_p,
                "top_k": req.top_k, "min_p": req.min_p, "stop": list(req.stop),
                "stop_token_ids": [eos] if eos is not None else [],
                "seed": req.seed if req.seed is not None else (s.seed * 1000003 + s.calls) % (2 ** 31),
                # behaviour log-probs of the distribution sampled from (tempered) unless T = 1
                "logprob_mode": "raw" if req.temperature == 1.0 else "sampling"}

    async def _images(self, ids: list[int], urls: list[str]) -> tuple[list[int], Any]:
        """(expanded ids, ImageInputs) of a chat prompt with images, or a 400 saying why not."""
        from realflow.api.images import ImageError, ImageProcessing
        from realflow.rollout.image_prompts import prompt_images

        cfg = self.cfg
        if cfg.image_token_id is None:
            raise APIError(400, "this model is text-only: image_url parts are not accepted", param="messages")
        d = ImageProcessing()
        processing = ImageProcessing(min_pixels=cfg.min_pixels or d.min_pixels, max_pixels=cfg.max_pixels or d.max_pixels)
        try:
            return await asyncio.to_thread(prompt_images, ids, urls, (cfg.image_token_id, cfg.image_merge_size),
                                           processing)
        except ImageError as e:
            raise APIError(400, f"images of these messages: {e}", param="messages") from None

    async def _run(self, s: ProxySession, req: Any, prompt_ids: list[int], parent: Optional[int],
                   kind: str, images: Optional[tuple[Any, list[str]]] = None) -> tuple[str, list[RecordedCompletion]]:
        if len(s.records) + req.n > self.cfg.max_completions_per_session:
            raise APIError(429, f"this session reached max_completions_per_session="
                                f"{self.cfg.max_completions_per_session}", code="session_limit")
        params = self._sampling(s, req)
        rid = f"{kind}-{uuid.uuid4().hex[:20]}"
        extra = {} if images is None else {"image_data": images[1]}
        task = asyncio.ensure_future(self.generate(prompt_ids, params, req.n, rid, **extra))
        s.inflight.add(task)
        try:
            outs = await task
        except UpstreamError as e:
            raise APIError(e.status, str(e), code="upstream_rejected") from None
        except asyncio.CancelledError:
            if s.key in self.sessions:  # the handler itself was cancelled, not the session closed
                raise
            outs = None
        finally:
            s.inflight.discard(task)
        if outs is None or s.key not in self.sessions:
            raise APIError(409, "the agent session ended while this completion was running", code="session_closed")
        recs = []
        for i, c in enumerate(outs):
            recs.append(RecordedCompletion(id=rid, choice=i, order=len(s.records), prompt_ids=list(c.prompt_ids),
                                           output_ids=list(c.output_ids), logprobs=list(c.logprobs),
                                           versions=list(c.versions), finish_reason=c.finish_reason,
                                           parent=parent, routed_experts=c.routed_experts,
                                           images=None if images is None else images[0]))
            s.records.append(recs[-1])
        return rid, recs

    def _visible(self, rec: RecordedCompletion, stop: Sequence[str]) -> tuple[str, str]:
        """(text the agent sees, finish reason): special tokens dropped, cut at a stop string."""
        text = self.tok.decode(rec.output_ids, skip_special_tokens=True)
        cut = min((text.find(x) for x in stop if x in text), default=-1)
        if cut >= 0:
            return text[:cut], "stop"
        return text, "length" if rec.finish_reason == "length" else "stop"

    def _logprob_items(self, rec: RecordedCompletion) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(rec.output_ids, rec.logprobs):
            tok = self.tok.decode([t])
            out.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode()), "top_logprobs": []})
        return out

    @staticmethod
    def _usage(recs: Sequence[RecordedCompletion]) -> dict[str, int]:
        p = len(recs[0].prompt_ids) if recs else 0
        c = sum(len(r.output_ids) for r in recs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        req: ChatRequest = parse_chat(await self._json(request), self.cfg.model_name, self.cfg.max_n)
        messages = normalize_messages(req.messages)
        tools = req.tools
        try:
            text = self.chat.render(messages, tools)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"the chat template could not render these messages: {e}",
                           param="messages") from None
        sp = self.chat.splice_chat(messages, tools, text, s.turns)
        ids, images = sp.ids, None
        urls = message_images(req.messages)
        if urls:
            ids, pixels = await self._images(ids, urls)
            images = (pixels, urls)
        rid, recs = await self._run(s, req, ids, sp.parent, "chatcmpl", images)
        choices = []
        for rec in recs:
            visible, finish = self._visible(rec, req.stop)
            content, calls = parse_tool_calls(visible) if tools else (visible, [])
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"], finish = calls, "tool_calls"
            s.turns.append(self.chat.new_turn(rec.order, messages, tools, text, rec.prompt_ids, rec.output_ids,
                                              msg))
            choices.append({"index": rec.choice, "message": msg, "finish_reason": finish,
                            "logprobs": {"content": self._logprob_items(rec)} if req.logprobs else None})
        created = int(time.time())
        if req.stream:
            return await self._stream_chat(request, rid, created, choices, recs, req.include_usage)
        return web.json_response({"id": rid, "object": "chat.completion", "created": created,
                                  "model": self.cfg.model_name, "choices": choices, "usage": self._usage(recs),
                                  "system_fingerprint": None})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        req: CompletionRequest = parse_completion(await self._json(request), self.cfg.model_name, self.cfg.max_n)
        if isinstance(req.prompt, str):
            prior = [(r.order, r.prompt_ids, r.output_ids) for r in s.records]
            sp = self.chat.splice_text(req.prompt, prior)
            ids, parent = sp.ids, sp.parent
        else:
            ids, parent = list(req.prompt), None
            for r in sorted(s.records, key=lambda r: -r.order):
                n = len(r.prompt_ids) + len(r.output_ids)
                if r.prompt_ids and ids[:n] == r.prompt_ids + r.output_ids:
                    parent = r.order
                    break
        rid, recs = await self._run(s, req, ids, parent, "cmpl")
        choices = []
        for rec in recs:
            text, finish = self._visible(rec, req.stop)
            lp = None
            if req.logprobs:
                toks = [self.tok.decode([t]) for t in rec.output_ids]
                offsets, pos = [], 0
                for t in toks:
                    offsets.append(pos)
                    pos += len(t)
                lp = {"tokens": toks, "token_logprobs": [float(x) for x in rec.logprobs],
                      "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": rec.choice, "text": text, "finish_reason": finish, "logprobs": lp})
        created = int(time.time())
        if req.stream:
            return await self._stream_text(request, rid, created, choices, recs, req.include_usage)
        return web.json_response({"id": rid, "object": "text_completion", "created": created,
                                  "model": self.cfg.model_name, "choices": choices, "usage": self._usage(recs)})

    # ------------------------------------------------------------ streaming (server-sent events)

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, obj: Any) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _pieces(self, rec: RecordedCompletion, text: str) -> list[str]:
        """``text`` in token-sized deltas (decoded incrementally, so multi-byte characters stay whole)."""
        out, shown = [], ""
        for k in range(1, len(rec.output_ids) + 1):
            now = self.tok.decode(rec.output_ids[:k], skip_special_tokens=True)
            now = now[:len(text)] if len(now) > len(text) else now
            if now.startswith(shown) and len(now) > len(shown) and not now.endswith("\ufffd"):
                out.append(now[len(shown):])
                shown = now
        if shown != text:
            out.append(text[len(shown):] if text.startswith(shown) else text)
        return [p for p in out if p]

    async def _end_stream(self, resp: web.StreamResponse, head: dict, recs: Sequence[RecordedCompletion],
                          usage: bool) -> web.StreamResponse:
        if usage:
            await self._send(resp, {**head, "choices": [], "usage": self._usage(recs)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _stream_chat(self, request: web.Request, rid: str, created: int, choices: list[dict],
                           recs: Sequence[RecordedCompletion], usage: bool) -> web.StreamResponse:
        resp = await self._sse(request)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_name}
        for ch, rec in zip(choices, recs):
            msg, i = ch["message"], ch["index"]
            await self._send(resp, {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "finish_reason": None}]})
            for piece in self._pieces(rec, msg["content"] or "") if not msg.get("tool_calls") else (
                    [msg["content"]] if msg["content"] else []):
                await self._send(resp, {**head, "choices": [{"index": i, "delta": {"content": piece},
                                                             "finish_reason": None}]})
            for k, tc in enumerate(msg.get("tool_calls") or []):
                await self._send(resp, {**head, "choices": [{"index": i, "delta": {"tool_calls": [
                    {"index": k, **tc}]}, "finish_reason": None}]})
            await self._send(resp, {**head, "choices": [{"index": i, "delta": {}, "finish_reason": ch["finish_reason"],
                                                         "logprobs": ch["logprobs"]}]})
        return await self._end_stream(resp, head, recs, usage)

    async def _stream_text(self, request: web.Request, rid: str, created: int, choices: list[dict],
                           recs: Sequence[RecordedCompletion], usage: bool) -> web.StreamResponse:
        resp = await self._sse(request)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_name}
        for ch, rec in zip(choices, recs):
            for piece in self._pieces(rec, ch["text"]):
                await self._send(resp, {**head, "choices": [{"index": ch["index"], "text": piece,
                                                             "finish_reason": None, "logprobs": None}]})
            await self._send(resp, {**head, "choices": [{"index": ch["index"], "text": "",
                                                         "finish_reason": ch["finish_reason"],
                                                         "logprobs": ch["logprobs"]}]})
        return await self._end_stream(resp, head, recs, usage)
