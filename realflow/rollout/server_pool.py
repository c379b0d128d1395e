"""The generation servers as the rollout controller sees them: routing, failover, resumption.

* Routing: a request goes to the live server with the fewest outstanding tokens
  (prompt + remaining new tokens of the requests it is serving), so a server busy
  with long answers gets fewer new ones.
* Interruption: in ``abort`` mode a weight-update round aborts running requests;
  each comes back with what it generated, and :meth:`ServerPool.complete` resubmits
  prompt + prefix for the remaining tokens, keeping every token once with its
  behaviour log-prob and version. In ``recompute`` mode the server itself holds the
  requests and re-prefills them under the new weights; nothing to do here.
* Failover: a request whose server stops answering (connection refused or reset)
  is resubmitted, with the prefix it had, to another live server; the dead server is
  marked and named in the log. With none left, :class:`NoServerError` names them all.
"""
from __future__ import annotations

import asyncio
import time
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import aiohttp

from realflow.api.routing import decode_routed_experts
from realflow.rollout.gen_client import parse_prometheus

__all__ = ["ServerState", "ServerPool", "NoServerError", "Completed"]

logger = logging.getLogger("realflow.rollout.servers")

MAX_RESUBMITS = 1000  # a request interrupted more often than this is failing, not being updated


def _retry_after(resp: aiohttp.ClientResponse) -> Optional[float]:
    """Seconds of a 429's ``Retry-After`` header (None: absent or not a number of seconds)."""
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "")))
    except ValueError:
        return None


class NoServerError(RuntimeError):
    """No generation server is alive; the message names each and why it was lost."""


@dataclass
class ServerState:
    name: str
    url: str
    alive: bool = True
    outstanding_tokens: int = 0
    in_flight: int = 0
    version: int = 0
    lost_reason: str = ""
    served: int = 0
    busy_s: float = 0.0  # seconds the server spent stepping its engine (from its /metrics)
    can_stage: bool = False  # its /health says weight_staging (see the controller's rounds)
    hostname: str = ""  # from its /health: servers on the trainer writer's host read shared memory
    joining: bool = False  # a replacement: takes weight rounds, gets no requests until it holds the current version
    delta_base: Optional[int] = None  # the version a delta update may be based on (its /health; None: full only)


@dataclass
class Completed:
    """A finished request, whole: every generated token once, whatever happened on the way."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    resubmits: int = 0
    servers: list[str] = field(default_factory=list)
    #: MoE policy: numpy [len(prompt_ids) + len(output_ids) - 1, layers, topk] (realflow.api.routing);
    #: after an interruption, the last answer's: it covers the whole sequence, prefix included
    routed_experts: Any = None


class ServerPool:
    """Async HTTP access to every server of one run (one event loop uses it)."""

    def __init__(self, urls: list[str], api_key: Optional[str], request_timeout: float = 600.0,
                 call_timeout: float = 60.0) -> None:
        self.servers = [ServerState(f"gen_server/{i}", u.rstrip("/")) for i, u in enumerate(urls)]
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.request_timeout = request_timeout
        self.call_timeout = call_timeout
        self.session: Optional[aiohttp.ClientSession] = None
        self.tokens_generated = 0
        self.requests_failed_over = 0
        self.overloaded_retries = 0  # 429 answers waited out (Retry-After)
        self.rejoin_wait_s = 0.0  # how long a request waits for a replacement when no server is up
        #: SGLang serving a LoRA policy: the adapter's name, sent with every request (``lora_path``)
        #: and loaded by name at each weight update (realflow.weights.rounds)
        self.lora_name: Optional[str] = None
        self.lora_loaded = False  # until the first update the servers run the base: requests name no adapter
        #: MoE policy (routing replay): (num_experts, topk) of the model. Set, every request asks for
        #: the routed experts (SGLang returns them only when asked and only in a format that needs
        #: topk to be read); None: none are asked for (the builtin server still returns them for MoE)
        self.moe_routing: Optional[tuple[int, int]] = None

    async def start(self) -> None:
        # limit=0: as many connections as requests in flight (each waits for a whole generation)
        self.session = aiohttp.ClientSession(headers=self.headers, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ server calls

    def alive(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive]

    def mark_lost(self, server: ServerState, reason: str) -> None:
        if server.alive:
            server.alive = False
            server.lost_reason = reason
            logger.error("generation server %s (%s) lost: %s; %d left", server.name, server.url, reason,
                         len(self.alive()))

    def routable(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive and not s.joining]

    def pick(self) -> ServerState:
        live = self.routable()
        if not live:
            detail = "; ".join(f"{s.name} at {s.url}: {s.lost_reason or 'joining'}" for s in self.servers)
            raise NoServerError(f"no generation server is alive ({detail})")
        return min(live, key=lambda s: (s.outstanding_tokens, s.in_flight, s.name))

    async def pick_waiting(self, timeout: float) -> ServerState:
        """:meth:`pick`, but while every server is lost or joining, wait up to ``timeout`` for a
        replacement to come up (the launcher restarts dead servers) before giving up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.pick()
            except NoServerError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    def replace(self, index: int, url: str, version_needed: int) -> ServerState:
        """A new server at ``url`` takes the place of lost server ``index``; it is routed to once it
        holds ``version_needed`` (the next weight-update round brings it there)."""
        old = self.servers[index]
        new = ServerState(old.name, url.rstrip("/"), joining=version_needed > 0)
        self.servers[index] = new
        logger.warning("generation server %s replaced: %s -> %s%s", old.name, old.url, new.url,
                       f" (joins at weight version {version_needed})" if new.joining else "")
        return new

    def admit_joined(self, version: int) -> None:
        """Route to replacements that now hold ``version``."""
        for s in self.servers:
            if s.joining and s.alive and s.version >= version:
                s.joining = False
                logger.info("generation server %s (%s) joined at weight version %d", s.name, s.url, s.version)

    async def call(self, server: ServerState, endpoint: str, body: Optional[dict] = None,
                   timeout: Optional[float] = None, method: str = "POST") -> Any:
        """One JSON call; connection errors mark the server lost and re-raise.

        A full server (429) is asked again after its ``Retry-After`` until ``timeout`` has passed."""
        assert self.session is not None, "ServerPool.start() first"
        total = timeout or self.call_timeout
        deadline = time.monotonic() + total
        while True:
            t = aiohttp.ClientTimeout(total=max(0.1, deadline - time.monotonic()))
            try:
                async with self.session.request(method, server.url + endpoint, json=body, timeout=t) as resp:
                    data = await resp.json(content_type=None)
                    retry_after = _retry_after(resp) if resp.status == 429 else None
                    if retry_after is not None and time.monotonic() + retry_after < deadline:
                        self.overloaded_retries += 1
                    elif resp.status >= 400:
                        raise RuntimeError(f"{server.name} {endpoint} -> {resp.status}: "
                                           f"{data.get('error') if isinstance(data, dict) else data}")
                    else:
                        return data
            except (aiohttp.ClientConnectionError, ConnectionError) as e:
                self.mark_lost(server, f"{type(e).__name__}: {e}")
                raise
            await asyncio.sleep(retry_after)

    async def call_text(self, server: ServerState, endpoint: str) -> str:
        assert self.session is not None, "ServerPool.start() first"
        async with self.session.get(server.url + endpoint, timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
            return await resp.text()

    async def check_health(self) -> None:
        """Probe every live server once; one that does not answer is marked lost."""
        async def probe(s: ServerState) -> None:
            try:
                h = await self.call(s, "/health", timeout=10.0, method="GET")
                s.version = int(h.get("weight_version", s.version))
                s.can_stage = h.get("weight_staging") is True
                s.hostname = str(h.get("hostname") or "")
                base = h.get("weight_delta_base")
                s.delta_base = base if isinstance(base, int) and not isinstance(base, bool) else None
                m = parse_prometheus(await self.call_text(s, "/metrics"))
                tps = m.get("realflow_gen_busy_tokens_per_second", 0.0)
                if tps > 0:
                    s.busy_s = m.get("realflow_gen_tokens_generated_total", 0.0) / tps
            except (aiohttp.ClientConnectionError, ConnectionError):
                pass  # marked by call()
            except (asyncio.TimeoutError, RuntimeError) as e:
                self.mark_lost(s, f"health check failed: {type(e).__name__}: {e}")
        await asyncio.gather(*(probe(s) for s in self.alive()))

    async def broadcast(self, endpoint: str, body: Optional[dict] = None, timeout: Optional[float] = None,
                        only: Optional[Sequence[ServerState]] = None) -> dict[str, Any]:
        """The same call on every live server (of ``only``, if given), concurrently; a server
        that fails is marked lost."""
        chosen = None if only is None else {id(s) for s in only}
        live = [s for s in self.alive() if chosen is None or id(s) in chosen]

        async def one(s: ServerState) -> Any:
            try:
                return await self.call(s, endpoint, body, timeout)
            except (aiohttp.ClientConnectionError, ConnectionError) as e:
                return e
            except (asyncio.TimeoutError, RuntimeError) as e:
                self.mark_lost(s, f"{endpoint} failed: {type(e).__name__}: {e}")
                return e
        results = await asyncio.gather(*(one(s) for s in live))
        return {s.name: r for s, r in zip(live, results)}

    # ------------------------------------------------------------ generation

    async def complete(self, rid: str, prompt_ids: list[int], params: dict[str, Any],
                       image_data: Optional[list[str]] = None) -> Completed:
        """Generate one sequence to its end, across interruptions and server failures.
        ``image_data`` (VL policies: base64 / data URLs) goes with every (re)submission."""
        out = Completed(list(prompt_ids))
        budget = int(params.get("max_new_tokens", 128))
        base_seed = params.get("seed")
        while True:
            remaining = budget - len(out.output_ids)
            if remaining <= 0:
                out.finish_reason = "length"
                return out
            sp = dict(params, max_new_tokens=remaining, n=1)
            if base_seed is not None:  # a resumed request draws a fresh stream, not the start's again
                sp["seed"] = int(base_seed) + len(out.output_ids)
            server = await self.pick_waiting(self.rejoin_wait_s)
            charge = len(prompt_ids) + len(out.output_ids) + remaining
            server.outstanding_tokens += charge
            server.in_flight += 1
            try:
                body = {"input_ids": out.prompt_ids + out.output_ids, "sampling_params": sp, "return_logprob": True,
                        "rid": f"{rid}-r{out.resubmits}"}
                if self.lora_name is not None and self.lora_loaded:
                    body["lora_path"] = self.lora_name
                if self.moe_routing is not None:
                    body["return_routed_experts"] = True
                if image_data:
                    body["image_data"] = list(image_data)
                res = await self.call(server, "/generate", body, timeout=self.request_timeout)
            except (aiohttp.ClientConnectionError, ConnectionError):
                self.requests_failed_over += 1
                out.resubmits += 1
                if out.resubmits > MAX_RESUBMITS:
                    raise
                continue  # the server was marked lost; resubmit the prefix elsewhere
            finally:
                server.outstanding_tokens -= charge
                server.in_flight -= 1
            meta = res["meta_info"]
            ids = list(res["output_ids"])
            out.output_ids += ids
            out.logprobs += [float(lp[0]) for lp in meta["output_token_logprobs"]]
            out.versions += [int(v) for v in meta["output_token_weight_versions"]]
            experts, topk = self.moe_routing or (None, None)
            routed = decode_routed_experts(meta, len(out.prompt_ids) + len(out.output_ids) - 1, topk, experts)
            if routed is not None and routed.shape[0]:  # an answer that ran nothing keeps the earlier record
                out.routed_experts = routed
            out.servers.append(server.name)
            server.served += 1
            self.tokens_generated += len(ids)
            reason = meta["finish_reason"]["type"] if isinstance(meta["finish_reason"], dict) else "stop"
            if reason != "abort":
                out.finish_reason = reason
                return out
            out.resubmits += 1  # aborted by a weight-update round: go on under the new weights
            if out.resubmits > MAX_RESUBMITS:
                raise RuntimeError(f"request {rid} was aborted {out.resubmits} times "
                                   f"(last on {server.name}); giving up")
