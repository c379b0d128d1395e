"""A rollout worker: runs agents on data rows and pushes finished trajectories to the trainer.

Per admitted rollout (``/admit`` on the controller, which bounds staleness and numbers
the prompts it hands out, so that a recover point knows exactly which were handed out
and which of those were trained), the worker takes the row of that number (the data
set in a seeded order per epoch, the same in every worker), runs the registered
agent on it (``await agent.run(row, ctx)``), turns the trajectories into a one-sample
:class:`~realflow.api.batch.SequenceBatch` (:func:`~realflow.api.rollout.rollout_to_batch`)
and sends it to a trainer model worker's trajectory inbox over the signed ZMQ data
plane (msgpack + raw tensor frames, no pickle). Then it tells the controller the
rollout is done, so the exact counts stay exact. An agent that raises is logged
(with its row), counted and reported as failed; the worker goes on.

Rewards run in a process pool (``reward_processes`` children, started with *spawn*
so they hold no sockets or threads of this process), each call bounded by
``reward_timeout_s``: a reward that does not answer in time fails that rollout with a
:class:`~realflow.api.agent.RewardTimeout` naming the reward, and the pool is
replaced (its stuck child killed) so later rollouts are not held up.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import logging
import multiprocessing
import traceback
import zlib
from typing import Any, Optional, Sequence

import aiohttp
import zmq
import zmq.asyncio

from realflow.api.agent import Completion, RewardTimeout, make_agent
from realflow.api.images import ImageInputs
from realflow.data.source import load_tokenized
from realflow.api.experiment import DatasetSpec, ExperimentSetup
from realflow.api.rollout import rollout_to_batch
from realflow.api.routing import decode_routed_experts
from realflow.base.fault_injection import fault_point
from realflow.comm.auth import Signer
from realflow.comm.codec import encode

__all__ = ["RolloutWorker", "RewardPool", "ControllerError"]

logger = logging.getLogger("realflow.rollout.worker")
for _chatty in ("httpx", "httpx2", "openai"):  # agents' OpenAI clients log every request at INFO
    logging.getLogger(_chatty).setLevel(logging.WARNING)

ADMIT_TIMEOUT_S = 30.0  # one /admit HTTP call (the controller long-polls for at most 5 s)
PUSH_TIMEOUT_S = 300.0  # the trainer's inbox must take a trajectory within this time


class ControllerError(RuntimeError):
    """The rollout controller answered an error status (kept, so the proxy can pass 4xx on)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _child_init(imports: list[str]) -> None:
    from realflow.plugins import load_plugins

    load_plugins(imports)


def _score_in_child(reward: str, samples: list[dict], args: dict) -> list[float]:
    """Runs in a pool process: the registered reward on each sample (fault-isolated per sample)."""
    from realflow.api.reward import RewardConfig, RewardInput, compute_rewards

    fields = set(RewardInput.__dataclass_fields__)
    inputs = [RewardInput(**{k: v for k, v in s.items() if k in fields}) for s in samples]
    return compute_rewards(inputs, RewardConfig(name=reward, args=dict(args))).rewards


def _ready() -> bool:
    return True


class RewardPool:
    """Process pool for rewards with a per-call timeout (a stuck child is killed with its pool).

    The timeout covers the reward's own work only: at most ``n`` calls are handed to the
    pool at once (the others wait their turn outside the clock), and a new pool is
    warmed up (children started, modules imported) before calls are timed on it.
    """

    STARTUP_TIMEOUT_S = 300.0  # spawning children that import the reward modules

    def __init__(self, n: int, imports: list[str], timeout: float) -> None:
        self.n, self.imports, self.timeout = n, list(imports), timeout
        self.timeouts = 0
        self._slots: Optional[asyncio.Semaphore] = None
        self._pool, self._warm = self._new(), None

    def _new(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(self.n, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_child_init, initargs=(self.imports,))

    async def _warm_up(self, pool: cf.ProcessPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(asyncio.gather(*(loop.run_in_executor(pool, _ready) for _ in range(self.n))),
                               self.STARTUP_TIMEOUT_S)

    async def score(self, reward: str, samples: Sequence[dict], args: Optional[dict] = None) -> list[float]:
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.n)
        async with self._slots:
            for attempt in range(2):
                pool = self._pool
                if self._warm is None:
                    self._warm = asyncio.ensure_future(self._warm_up(pool))
                await asyncio.shield(self._warm)
                fut = loop.run_in_executor(pool, _score_in_child, reward, list(samples), dict(args or {}))
                try:
                    return await asyncio.wait_for(fut, self.timeout)
                except asyncio.TimeoutError:
                    self.timeouts += 1
                    self._replace(pool)
                    raise RewardTimeout(f"reward {reward!r} did not finish {len(samples)} samples within "
                                        f"reward_timeout_s={self.timeout:g}s") from None
                except cf.process.BrokenProcessPool:
                    if attempt:  # replaced under us by another call's timeout: retry once on the new pool
                        raise
        raise AssertionError("unreachable")

    def _replace(self, pool: cf.ProcessPoolExecutor) -> None:
        if pool is not self._pool:
            return
        self._pool, self._warm = self._new(), None
        for p in list(getattr(pool, "_processes", {}).values()):
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        for p in list(getattr(self._pool, "_processes", {}).values()):
            p.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _routed(r: dict[str, Any]) -> Any:
    """The routed experts of one controller answer (MoE policies), None when it has none."""
    meta = r.get("routed_experts")
    if meta is None:
        return None
    return decode_routed_experts(meta, len(r["prompt_ids"]) + len(r["output_ids"]) - 1)


class _Context:
    """The :class:`AgentContext` of one rollout."""

    def __init__(self, worker: "RolloutWorker", seed: int, rid: str) -> None:
        self.tokenizer = worker.tokenizer
        self.seed = seed
        self._w = worker
        self._rid = rid
        self._n = itertools.count()

    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any],
                       n: int = 1, image_data: Optional[Sequence[Any]] = None) -> list[Completion]:
        body: dict[str, Any] = {"input_ids": list(map(int, input_ids)), "sampling_params": dict(sampling_params, n=n),
                                "rid": f"{self._rid}-g{next(self._n)}"}
        images = None
        if image_data:  # VL policy: expanded ids and the trainer's pixels, made here as the server makes them
            body["input_ids"], images, body["image_data"] = await asyncio.to_thread(self._w.prompt_images,
                                                                                    input_ids, image_data)
        out = await self._w.controller_call("/generate", body, timeout=self._w.spec.request_timeout_s)
        return [Completion(r["prompt_ids"], r["output_ids"], r["logprobs"], r["versions"], r["finish_reason"],
                           info={"resubmits": r["resubmits"], "servers": r["servers"]},
                           routed_experts=_routed(r), images=images) for r in out]

    async def score(self, reward: str, samples: Sequence[dict[str, Any]],
                    args: Optional[dict[str, Any]] = None) -> list[float]:
        return await self._w.rewards.score(reward, samples, args)

    async def open_session(self, seed: int) -> Any:
        proxy = await self._w.proxy()
        s = proxy.open_session(seed)
        self._w.session_keys.setdefault(self._rid, set()).add(s.key)
        return s

    def close_session(self, key: str) -> list:
        self._w.session_keys.get(self._rid, set()).discard(key)
        return self._w.openai_proxy.close_session(key) if self._w.openai_proxy is not None else []


class RolloutWorker:
    def __init__(self, setup: ExperimentSetup, index: int, secret: bytes, controller_url: str,
                 inbox_addresses: dict[int, str], api_key: Optional[str], tokenizer: Any,
                 imports: Sequence[str] = ()) -> None:
        assert setup.rollout is not None
        self.setup, self.spec, self.index = setup, setup.rollout, index
        self.name = f"rollout_worker/{index}"
        self.controller_url = controller_url.rstrip("/")
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.agent = make_agent(self.spec.agent, self.spec.agent_args)
        self.rewards = RewardPool(self.spec.reward_processes, list(imports), self.spec.reward_timeout_s)
        self.signer = Signer(secret, self.name)
        self.inboxes = sorted(inbox_addresses.items())
        self.ctx = zmq.asyncio.Context()
        self.socks: list[tuple[str, zmq.asyncio.Socket]] = []
        for w, addr in self.inboxes:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, int(PUSH_TIMEOUT_S * 1000))
            s.connect(addr)
            self.socks.append((f"model_worker/{w}", s))
        self._next_sock = itertools.cycle(range(len(self.socks)))
        self.rows = self._load_rows()
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its seeded permutation of the rows)
        self.session: Optional[aiohttp.ClientSession] = None
        self.n_ok = self.n_failed = self.n_timed_out = 0
        self.openai_proxy: Any = None  # started on the first agent session (FunctionAgent)
        self.session_keys: dict[str, set[str]] = {}  # rollout -> its open proxy sessions
        self._proxy_lock: Optional[asyncio.Lock] = None

    async def proxy(self) -> Any:
        """This worker's OpenAI-compatible proxy (loopback), started on first use."""
        from realflow.rollout.openai_proxy import OpenAIProxy, ProxyConfig

        if self._proxy_lock is None:
            self._proxy_lock = asyncio.Lock()
        async with self._proxy_lock:
            if self.openai_proxy is None:
                opts = dict(getattr(self.agent, "proxy_options", {}) or {})
                if self.spec.dataset_args.get("chat_template_text"):  # dataset.chat_template=PATH.jinja
                    opts.setdefault("chat_template", self.spec.dataset_args["chat_template_text"])
                from realflow.rollout.image_prompts import image_tokens_of

                tokens = image_tokens_of(self.spec.model_path)
                if tokens is not None:  # a VL policy: image_url parts, expanded as the servers expand them
                    lim = self.spec.server_limits
                    opts.setdefault("image_token_id", tokens[0])
                    opts.setdefault("image_merge_size", tokens[1])
                    opts.setdefault("min_pixels", lim.min_pixels)
                    opts.setdefault("max_pixels", lim.max_pixels)
                try:
                    cfg = ProxyConfig(**opts)
                except TypeError as e:
                    raise ValueError(f"agent {self.spec.agent!r}: bad proxy option in {opts}: {e}") from None
                proxy = OpenAIProxy(self._proxy_generate, self.tokenizer, cfg)
                url = await proxy.start()
                logger.info("%s: OpenAI-compatible proxy for agent sessions at %s", self.name, url)
                self.openai_proxy = proxy
        return self.openai_proxy

    async def _proxy_generate(self, input_ids: list[int], params: dict[str, Any], n: int, rid: str,
                              image_data: Optional[list[str]] = None) -> list:
        from realflow.rollout.openai_proxy import UpstreamError

        body: dict[str, Any] = {"input_ids": list(map(int, input_ids)), "sampling_params": dict(params, n=n),
                                "rid": rid}
        if image_data:  # the proxy expanded the ids; servers check them against these images
            body["image_data"] = list(image_data)
        try:
            out = await self.controller_call("/generate", body, timeout=self.spec.request_timeout_s)
        except ControllerError as e:
            if 400 <= e.status < 500:
                raise UpstreamError(e.status, str(e)) from None
            raise
        return [Completion(r["prompt_ids"], r["output_ids"], r["logprobs"], r["versions"], r["finish_reason"],
                           info={"resubmits": r["resubmits"], "servers": r["servers"]},
                           routed_experts=_routed(r)) for r in out]

    def prompt_images(self, ids: Sequence[int], sources: Sequence[Any]) -> tuple[list[int], Any, list[str]]:
        """(expanded ids, ImageInputs, wire form) of an image prompt, with the servers' pixel budget
        (``rollout.server_limits.min_pixels`` / ``max_pixels``): the trainer sees the pixels they saw."""
        from realflow.api.images import ImageProcessing
        from realflow.rollout.image_prompts import image_tokens_of, prompt_images, wire_images

        lim = self.spec.server_limits
        tokens = image_tokens_of(self.spec.model_path)
        expanded, images = prompt_images(ids, sources, tokens, ImageProcessing(lim.min_pixels, lim.max_pixels))
        return expanded, images, wire_images(sources)

    def _load_rows(self) -> list:
        spec = self.spec  # tokenized exactly as the trainer's data sets are (one rendering: chat_render)
        args = {"seed": spec.seed, **dict(spec.dataset_args)}
        ds = load_tokenized(DatasetSpec(format=spec.dataset_format, path=spec.dataset_path, args=args),
                            self.tokenizer)
        if self.index == 0:
            logger.info("prompt data set %s (%s): %s", spec.dataset_path, spec.dataset_format, ds.report)
        return ds

    def _images(self, row: Any) -> Any:
        """The prompt's images for its trajectory batch: a VL run's samples all carry the image keys
        (a row without images: empty ones), a text-only run's none (realflow.data.source)."""
        if getattr(row, "images", None) is not None:
            return row.images
        if not hasattr(self, "_with_images"):  # as realflow.data.source decides it for a data set
            self._with_images = bool(self.spec.dataset_args.get("image_inputs")) or any(
                getattr(r, "images", None) is not None for r in self.rows)
        return ImageInputs.empty() if self._with_images else None

    def _row(self, index: int) -> tuple[int, Any]:
        """(epoch, row) of the ``index``-th prompt the run hands out (the controller numbers them)."""
        epoch, i = divmod(int(index), len(self.rows))
        if self._order[0] != epoch:
            self._order = (epoch, self.rows.epoch_order(epoch))
        return epoch, self.rows[self._order[1][i]]

    # ------------------------------------------------------------ controller

    async def controller_call(self, endpoint: str, body: dict, timeout: float = 60.0) -> Any:
        assert self.session is not None
        try:
            async with self.session.post(self.controller_url + endpoint, json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                data = await resp.json(content_type=None)
                if resp.status >= 400:
                    raise ControllerError(resp.status, f"rollout controller {endpoint} -> {resp.status}: "
                                          f"{data.get('error') if isinstance(data, dict) else data}")
                return data
        except asyncio.TimeoutError:
            raise TimeoutError(f"rollout controller at {self.controller_url} did not answer {endpoint} "
                               f"within {timeout:.0f}s") from None

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        self.session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
        sem = asyncio.Semaphore(self.spec.max_concurrent_rollouts)
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                await sem.acquire()
                adm = await self.controller_call("/admit", {"worker": self.name}, timeout=ADMIT_TIMEOUT_S)
                if not adm.get("admitted"):
                    sem.release()
                    if adm.get("stop"):
                        logger.info("%s: controller says stop (%s)", self.name, adm.get("reason"))
                        break
                    continue
                index = int(adm["index"])
                epoch, row = self._row(index)
                t = asyncio.create_task(self._rollout(row, epoch, index, int(adm["version"]), sem))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.openai_proxy is not None:  # before the controller session its handlers use
                await self.openai_proxy.stop()
            await self.session.close()
            self.rewards.close()
            for _, s in self.socks:
                s.close(0)
            self.ctx.term()

    async def _rollout(self, row: Any, epoch: int, index: int, version: int, sem: asyncio.Semaphore) -> None:
        sid = f"{row.id}/e{epoch}"
        seed = zlib.crc32(f"{self.spec.seed}/{sid}".encode())
        ok, err, timed_out, filtered = False, "", False, False
        try:
            data = {"id": sid, "prompt_ids": list(row.prompt_ids), "answer": row.answer, **dict(row.meta)}
            if getattr(row, "image_bytes", None):  # a VL data set's encoded images (agents pass them to ctx.generate)
                data["image_data"] = list(row.image_bytes)
            # not wait_for: an agent's own TimeoutError (a RewardTimeout) must not read as its timeout
            task = asyncio.ensure_future(self.agent.run(data, _Context(self, seed, sid)))
            try:
                done, _ = await asyncio.wait({task}, timeout=self.spec.agent_timeout_s)
            finally:
                if not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if not done:
                timed_out = True
                raise TimeoutError(f"agent {self.spec.agent!r} did not return within "
                                   f"agent_timeout_s={self.spec.agent_timeout_s:g}s")
            trajs = task.result()
            rewards = {float(t.reward) for t in trajs}
            if self.spec.dynamic_sampling and len(trajs) > 1 and len(rewards) == 1:
                filtered = True  # no learning signal: never sent, frees its place under the staleness bound
            else:
                batch = rollout_to_batch(sid, trajs, version, answer=row.answer, images=self._images(row))
                await self._push(batch.to_wire())
                ok = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an agent's failure is counted, never fatal
            err = f"{type(e).__name__}: {e}"
            self.n_failed += 1
            self.n_timed_out += timed_out
            logger.warning("%s: agent %r failed on row %s (version %d): %s\n%s", self.name, self.spec.agent,
                           sid, version, err, "" if timed_out else traceback.format_exc(limit=4))
        finally:
            sem.release()
            for key in self.session_keys.pop(sid, ()):  # sessions of an agent that timed out or raised
                self.openai_proxy.close_session(key)
        if ok:
            self.n_ok += 1
        await self.controller_call("/done", {"version": version, "ok": ok, "error": err[:500], "index": index,
                                             "id": sid, "timed_out": timed_out, "filtered": filtered})

    async def _push(self, wire: dict) -> None:
        fault_point("rollout")  # (tests only: realflow.base.fault_injection)
        to, sock = self.socks[next(self._next_sock)]
        frames = self.signer.sign(encode(wire), to)
        try:
            await sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise TimeoutError(f"{to}'s trajectory inbox did not take a trajectory within "
                               f"{PUSH_TIMEOUT_S:.0f}s") from None
