"""GenerationEngine: continuous batching over a KV cache, for RL rollouts.

One :meth:`GenerationEngine.step` = prefill of the requests that join (up to a
token budget and the free slots), then one decode token for every request that
was already running; finished sequences leave at the end of the step and their
slots are reused.  Everything RL needs is per sequence: logprobs of the sampled
tokens (``SamplingParams.logprob_mode``, see :mod:`realflow.api.generation`),
the weight version of every token, and interruption:

* ``pause("abort")`` / :meth:`abort` finish requests now with what they have;
* ``pause("retract")``, :meth:`flush_cache` and every weight update put the
  running requests back at the head of the queue with their output so far; the
  next step re-prefills prompt + output under the weights then in force and
  generation goes on, accumulating output, logprobs and versions.

Vision-language models (Qwen2.5-VL): a request may carry its prompt's images
(:class:`realflow.api.images.ImageInputs`, placeholders already expanded in its ids);
:mod:`parallel.generation.vision` runs the tower at prefill and M-RoPE. Text models never
reach that code.

Under tensor parallelism every rank of ``tp_group`` must make the same calls
in the same order (same requests, same seeds): the steps run in lockstep.
Not thread-safe: one thread drives an engine (the gen server holds a lock).
"""
from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.generation.adapters import AdapterMerger
from parallel.generation.blocks import BlockAllocator
from parallel.generation.cuda_graphs import DecodeGraphs, decode_graphs_for
from parallel.generation.decoder import Decoder, KVCache
from parallel.generation.paged_attention import kernel_for
from parallel.generation.paged_cache import PagedKVCache
from parallel.generation.pager import Pager
from parallel.generation.weight_updates import WeightUpdatesMixin
from parallel.generation.kv_budget import kv_layout
from parallel.generation.routing import new_buffer
from parallel.generation.sequence import RowFlags, Seq
from parallel.generation.rows import RowsMixin
from parallel.generation.stepping import SteppingMixin
from parallel.generation.vision import EngineVision, shared_tower, vision_tower_for
from parallel.generation.weights import DecoderWeights, ModelSpec, load_hf_weights
from parallel.vision import vision_arch
from realflow.api.generation import (GenerationFailed, GenerationResult, SamplingParams, check_inference_memory,
                                     validate_input_ids)
from realflow.api.images import ImageInputs
from realflow.base.devices import worker_device

__all__ = ["EngineConfig", "GenerationEngine"]


DECODE_ATTENTION = ("auto", "contiguous", "paged", "gather")
UNIFORMS_AHEAD = 16  # sampling uniforms hashed ahead per slot (see RowsMixin._uniform)


@dataclass
class EngineConfig:
    """Capacity of the engine (the KV pool is allocated once from these)."""

    max_running_requests: int = 64  # sequences decoded together (rows of a decode step)
    # prompt + output of one sequence; default max_position_embeddings
    max_model_len: Optional[int] = None
    # tokens prefilled per step; a longer prompt is prefilled in chunks over several steps while
    # the running sequences keep decoding (chunked prefill)
    max_prefill_tokens: int = 8192
    seed: int = 0  # seeds of requests that bring none
    # the KV pool may take this fraction of the device's free memory at build time (see
    # parallel.generation.kv_budget); at least one max_model_len sequence must fit
    gpu_memory_utilization: float = 0.9
    block_size: int = 16  # tokens per KV block (a power of two)
    # a request's n samples prefill their prompt once and share its blocks; prompts that start
    # with blocks cached under the current weights (agent turns, retracted requests) reuse them
    prefix_sharing: bool = True
    # where decode reads keys and values: "paged" attends over each row's blocks in place (the
    # GPU's path: a Triton kernel, parallel.generation.paged_attention; where it cannot run, and
    # with "gather", each row's blocks are gathered first), "contiguous" keeps a per-row copy of
    # the blocks (the CPU's: ~8x cheaper attention there); "auto": contiguous on a CPU, paged on a GPU
    decode_attention: str = "auto"
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode (they are captured per batch size)
    kv_blocks: Optional[int] = None  # the pool's size in blocks (default: from gpu_memory_utilization)

    def validate(self) -> "EngineConfig":
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests}: must be >= 1")
        check_inference_memory(self.gpu_memory_utilization, self.max_model_len)
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens}: must be >= 1")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"block_size={b!r}: must be a power of two (1, 2, 4, ... tokens per KV block; "
                             f"16 is the usual choice)")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r}: expected one of {DECODE_ATTENTION}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"kv_blocks={self.kv_blocks}: must be >= 1 (or unset to size it from memory)")
        return self


def _tp_info(tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


class GenerationEngine(SteppingMixin, RowsMixin, WeightUpdatesMixin):
    """KV-cache generation on one tp rank's megatron-layout weights (see module docstring)."""

    def __init__(self, hf_config: Any, weights: Mapping[str, torch.Tensor],
                 config: Optional[EngineConfig] = None, *,
                 tp_group: Optional[dist.ProcessGroup] = None, tokenizer: Any = None,
                 version: int = 0, vision_tower: Optional[torch.nn.Module] = None) -> None:
        """``weights``: megatron LOCAL param name -> tensor (pp = 1); kept by reference.
        ``vision_tower``: a VL model's tower (transformers' module, kept by reference)."""
        self.config = (config or EngineConfig()).validate()
        self.hf_config = hf_config
        tp_rank, tp_size = _tp_info(tp_group)
        self.spec = ModelSpec.from_hf(hf_config, tp_rank, tp_size)
        self.weights = DecoderWeights(self.spec, weights)
        ctx = self.spec.arch.max_position_embeddings
        check_inference_memory(self.config.gpu_memory_utilization, self.config.max_model_len, ctx)
        self._max_context = self.config.max_model_len or ctx
        self.decoder = Decoder(self.weights, self._max_context, tp_group)
        arch = vision_arch(hf_config)
        if arch is not None and vision_tower is None:
            raise ValueError(f"{arch.model_type}: a vision-language model needs its vision tower (vision_tower=...)")
        self.vision: Optional[EngineVision] = None if arch is None else EngineVision(
            arch, vision_tower, self.spec.head_dim, self.weights.device)
        dev = self.weights.device
        cfg = self.config
        contiguous = cfg.decode_attention == "contiguous" or (cfg.decode_attention == "auto" and dev.type == "cpu")
        slots, blocks = kv_layout(self.spec, cfg.max_running_requests, self._max_context, cfg.block_size,
                                  self.weights.dtype, dev, cfg.gpu_memory_utilization, contiguous, cfg.kv_blocks)
        self.config = dataclasses.replace(cfg, max_running_requests=slots)
        self.pool = PagedKVCache(self.spec, blocks, cfg.block_size, self.weights.dtype, dev)
        self.pager = Pager(BlockAllocator(blocks, cfg.block_size), self.pool, cfg.prefix_sharing)
        # contiguous decode: each running row's keys and values also in slot i (the pool's per-row copy)
        self.cache: Optional[KVCache] = KVCache(self.spec, slots, self._max_context, self.weights.dtype, dev) \
            if contiguous else None
        if not contiguous and cfg.decode_attention != "gather":
            self.decoder.paged_kernel = kernel_for(dev, cfg.block_size)
        self.tokenizer = tokenizer
        self.version = int(version)
        self._rng = random.Random(self.config.seed)
        self._running: list[Seq] = []  # row i of a decode step (slot i of the contiguous copy)
        self._partial: Optional[Seq] = None  # a prompt prefilled in chunks, not yet decoding
        self._waiting: deque[Seq] = deque()
        self._done: list[GenerationResult] = []
        slots, dev = self.config.max_running_requests, self.weights.device
        self._last = torch.zeros(slots, dtype=torch.long, device=dev)  # token to feed next
        self._pos = torch.zeros(slots, dtype=torch.long, device=dev)  # its position
        # per-slot sampling settings and finish conditions (set when a request joins, so a
        # step tests every row at once instead of looping over requests in Python)
        self._temp = torch.ones(slots, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(slots, dtype=torch.long, device=dev)
        self._top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self._min_p = torch.zeros(slots, dtype=torch.float32, device=dev)
        self._lp_sampling = torch.zeros(slots, dtype=torch.bool, device=dev)
        self._budget = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens it may still add
        # sampling streams: the seed's 32-bit words and the next draw (= tokens sampled so far)
        self._seed_lo = torch.zeros(slots, dtype=torch.long, device=dev)
        self._seed_hi = torch.zeros(slots, dtype=torch.long, device=dev)
        self._draws = torch.zeros(slots, dtype=torch.long, device=dev)
        # the next UNIFORMS_AHEAD uniforms of each slot's stream (draws _ubase..), hashed for many
        # draws at once: one batched hash per UNIFORMS_AHEAD steps instead of ~45 small ops a step
        self._uniforms = torch.zeros((slots, UNIFORMS_AHEAD), dtype=torch.float64, device=dev)
        self._ubase = torch.zeros(slots, dtype=torch.long, device=dev)
        # block tables of the running rows (block 0 past a row's own blocks: masked reads)
        self._tables = torch.zeros((slots, -(-self._max_context // cfg.block_size)), dtype=torch.long, device=dev)
        self._stops = torch.full((slots, 4), -1, dtype=torch.long, device=dev)  # stop ids, -1 pad
        # VL models only: rotary position - cache position of every slot's next token (M-RoPE delta)
        self._delta = None if self.vision is None else torch.zeros(slots, dtype=torch.long, device=dev)
        # 0-dim operands: a Python number costs a scalar-to-tensor wrap per op on CPU
        self._one = torch.tensor(1, dtype=torch.long, device=dev)
        self._zero = torch.tensor(0, dtype=torch.long, device=dev)
        self._ids: set[str] = set()
        self._flags: dict[tuple[int, int], RowFlags] = {}  # see _row_flags
        self.tokens_generated = 0
        self.prefill_tokens = 0  # token rows prefills ran through the layers
        self.prefix_shared_tokens = 0  # prompt tokens whose keys/values came from shared or cached blocks
        self.preempted = 0  # sequences sent back to the queue for want of KV blocks
        self.nonfinite_requests = 0  # sequences failed for non-finite logits (see _accept)
        self.steps = 0
        self.busy_seconds = 0.0
        self._staged: Optional[tuple[int, DecoderWeights, Optional[dict]]] = None  # see stage_weights_from_tensors
        self.adapters = AdapterMerger("")  # LoRA updates merge into the base (set by from_hf)
        self.adapter_scaling: Optional[float] = None  # alpha / r of a LoRA run's adapter updates
        self.graphs: Optional[DecodeGraphs] = decode_graphs_for(self)  # GPU: CUDA graphs of the paged decode

    # ------------------------------------------------------------ construction

    @classmethod
    def from_hf(cls, path: str, config: Optional[EngineConfig] = None, *,
                tp_group: Optional[dist.ProcessGroup] = None, tokenizer: Any = "auto",
                dtype: torch.dtype = torch.float32, version: int = 0,
                device: Optional[torch.device] = None) -> "GenerationEngine":
        """Load this tp rank's shard of an HF checkpoint directory (and its tokenizer if any)
        onto ``device`` (default: this process's GPU if it has one, else the CPU)."""
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
        tp_rank, tp_size = _tp_info(tp_group)
        spec = ModelSpec.from_hf(hf_config, tp_rank, tp_size)
        if tokenizer == "auto":
            tokenizer = _try_tokenizer(path)
        weights = load_hf_weights(path, hf_config, spec, dtype)
        target = worker_device() if device is None else torch.device(device)
        if target.type != "cpu":
            weights = {k: v.to(target) for k, v in weights.items()}
        tower = vision_tower_for(hf_config, path, dtype, target)
        engine = cls(hf_config, weights, config, tp_group=tp_group, tokenizer=tokenizer, version=version,
                     vision_tower=tower)
        engine.adapters = AdapterMerger(path)
        return engine

    @classmethod
    def from_megatron(cls, engine: Any, config: Optional[EngineConfig] = None, *,
                      tokenizer: Any = None) -> "GenerationEngine":
        """Share the parameters of a :class:`parallel.engine.MegatronEngine` (pp = 1), and a VL
        model's vision tower (the module its GPTModel holds as ``visual``: shared, not copied)."""
        groups = engine.groups
        tp_group = groups.tp_group if groups.strategy.tp > 1 else None
        weights = engine.generation_weights()  # LoRA: merged copies of the adapted linears
        return cls(engine.hf_config, weights, config, tp_group=tp_group, tokenizer=tokenizer,
                   version=getattr(engine, "version", 0), vision_tower=shared_tower(engine))

    # ------------------------------------------------------------ properties

    @property
    def weight_version(self) -> int:
        return self.version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def model_context(self) -> int:
        """The model's own longest sequence (``max_position_embeddings``)."""
        return int(self.spec.arch.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return self.spec.arch.vocab_size

    @property
    def image_tokens(self) -> Optional[tuple[int, int]]:
        """``(image_token_id, spatial merge size)`` of a VL model (how many placeholders an image
        takes); None for a text model. Servers read it to expand and check prompts."""
        return None if self.vision is None else (self.vision.image_token_id, self.vision.merge_size)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, and a prompt being prefilled in chunks."""
        return len(self._waiting) + (self._partial is not None)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._done or self._partial is not None)

    # ------------------------------------------------------------ requests

    def add_request(self, rid: str, input_ids: Sequence[int], params: SamplingParams,
                    images: Optional[ImageInputs] = None) -> list[str]:
        """Queue a prompt; returns its sequence ids (``rid``, or ``rid-i`` for n > 1).

        ``images`` (VL models): the prompt's images in order; ``input_ids`` hold each one's
        expanded placeholders (:func:`realflow.api.images.expand_image_tokens`).
        Raises ValueError (and changes nothing) on a bad prompt or bad params.
        """
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty string, got {rid!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        prompt = validate_input_ids(list(input_ids) if isinstance(input_ids, torch.Tensor)
                                    else input_ids, self.vocab_size, self._max_context)
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop (stop strings) needs a tokenizer; this engine "
                             "has none (pass tokenizer=..., or use stop_token_ids)")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"sampling_params.stop_token_ids: {t} is not in [0, {self.vocab_size})")
        if self.vision is not None:
            seq_images = self.vision.prepare(prompt, images)
        elif images is not None and images.num_images:
            raise ValueError(f"this model ({self.spec.arch.model_type}) is text-only: it takes no images")
        rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        clash = [r for r in rids if r in self._ids]
        if clash:
            raise ValueError(f"rid {clash[0]!r} is already in use by a running request")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.spec.eos_token_ids)
        base = params.seed if params.seed is not None else self._rng.randrange(2 ** 62)
        moe = self.spec.arch.moe
        record = moe is not None and params.return_routed_experts is not False
        stop_ids = frozenset(stop_ids)
        for i, r in enumerate(rids):
            seq = Seq(r, rid, i, prompt, params, base + i, stop_ids)
            if self.vision is not None:
                seq.images = seq_images
            if record:
                seq.routed = new_buffer(self.decoder.routing_dtype, self.spec.num_layers, moe.topk,
                                        min(len(prompt) + params.max_new_tokens, self._max_context))
            self._ids.add(r)
            if params.max_new_tokens == 0:
                self._finish_now(seq, {"type": "length", "length": 0})
            else:
                self._waiting.append(seq)
        return rids

    def _finish_now(self, seq: Seq, reason: dict[str, Any]) -> None:
        self._ids.discard(seq.rid)
        self._done.append(seq.result(reason))

    def abort(self, rid: str) -> list[GenerationResult]:
        """Finish the request (all its samples) now; returns what they generated."""
        out = [r for r in self._done if r.request_rid == rid or r.rid == rid]
        self._done = [r for r in self._done if r not in out]
        mine = [s for s in self._waiting if s.request_rid == rid or s.rid == rid]
        p = self._partial
        if p is not None and (p.request_rid == rid or p.rid == rid):
            self._partial = None
            mine.insert(0, p)
        for seq in mine:
            if seq is not p:
                self._waiting.remove(seq)
            self.pager.release(seq)
            self._ids.discard(seq.rid)
            out.append(seq.result({"type": "abort"}))
        rows = [i for i, s in enumerate(self._running) if s.request_rid == rid or s.rid == rid]
        out += [r for _, r in self._remove_rows({i: {"type": "abort"} for i in rows})]
        return out

    def pause(self, mode: str = "abort") -> list[GenerationResult]:
        """``abort``: finish everything now (returned); ``retract``: hold everything
        for re-prefill at the next step (returns [])."""
        if mode == "retract":
            self._retract()
            return []
        if mode != "abort":
            raise ValueError(f"pause mode={mode!r}: expected 'abort' or 'retract'")
        self._unpartial()
        out, self._done = self._done, []
        for seq in list(self._waiting):
            self.pager.release(seq)
            self._ids.discard(seq.rid)
            out.append(seq.result({"type": "abort"}))
        self._waiting.clear()
        out += [r for _, r in self._remove_rows({i: {"type": "abort"}
                                                 for i in range(len(self._running))})]
        return out

    def _unpartial(self) -> None:
        """A prompt half prefilled goes back to the queue head (its blocks freed)."""
        if self._partial is not None:
            self.pager.release(self._partial)
            self._waiting.appendleft(self._partial)
            self._partial = None

    def _retract(self) -> None:
        """Running requests go back to the head of the queue (KV recomputed when they rejoin,
        from the prefix cache where the weights have not changed)."""
        self._unpartial()
        for seq in self._running:
            self.pager.release(seq)
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._flags.clear()

    def _new_weights(self, version: int) -> None:
        """After any weight write: cached KV blocks are stale, and CUDA graphs captured on weight
        tensors that have since moved (a staged swap, an offload and reload) are dropped."""
        self.pager.set_version(version)
        if self.graphs is not None:
            self.graphs.check_weights()

    def flush_cache(self) -> None:
        """Drop every KV entry, cached prefixes too; running requests are re-prefilled at the next step."""
        self._retract()
        self.pager.alloc.clear_cache()

    # ------------------------------------------------------------ stepping

    def step(self) -> list[GenerationResult]:
        """Prefill joiners, decode one token for the others; return finished sequences.

        Runs under ``torch.inference_mode`` (no version counters or autograd views: about
        5% of a tiny model's decode step on CPU).  The engine's own state tensors are
        created outside it and only written in place, so none becomes an inference tensor.
        """
        with torch.inference_mode():
            return self._step()

    # ------------------------------------------------------------ helpers

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 images: Optional[Sequence[Optional[ImageInputs]]] = None) -> list[GenerationResult]:
        """Run prompts to completion; results in prompt order (samples of a prompt by index).
        ``images``: each prompt's images (None for a text prompt), VL models only."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ilist = list(images) if images is not None else [None] * len(prompts)
        if len(ilist) != len(prompts):
            raise ValueError(f"{len(ilist)} image entries for {len(prompts)} prompts")
        base = f"gen{self._rng.randrange(2 ** 32):08x}"
        order: dict[str, int] = {}
        for i, (p, sp, im) in enumerate(zip(prompts, plist, ilist)):
            for r in self.add_request(f"{base}-{i}", p, sp, **({} if im is None else {"images": im})):
                order[r] = len(order)
        results: list[GenerationResult] = []
        while len(results) < len(order):
            results += [r for r in self.step() if r.rid in order]
        failed = [r.finish_reason["message"] for r in results if r.finish_reason.get("type") == "error"]
        if failed:
            raise GenerationFailed(f"{len(failed)} of {len(results)} sequences failed: {failed[0]}")
        return sorted(results, key=lambda r: order[r.rid])

    def decode(self, ids: Sequence[int]) -> Optional[str]:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def stats(self) -> dict[str, float]:
        return {"tokens_generated": float(self.tokens_generated), "steps": float(self.steps),
                "nonfinite_requests": float(self.nonfinite_requests),
                "busy_seconds": self.busy_seconds, "running_requests": float(len(self._running)),
                "queued_requests": float(len(self._waiting)), "weight_version": float(self.version),
                "kv_cache_bytes": float(self.pool.nbytes + (self.cache.max_nbytes if self.cache is not None else 0)),
                "kv_blocks": float(self.pager.alloc.num_blocks), "kv_blocks_used": float(self.pager.alloc.used_blocks),
                "prefill_tokens": float(self.prefill_tokens), "prefix_shared_tokens": float(self.prefix_shared_tokens),
                "prefix_cache_hits": float(self.pager.alloc.hits), "preempted_requests": float(self.preempted),
                "cuda_graphs": float(self.graphs.captured if self.graphs is not None else 0),
                "paged_attention_kernel": float(self.decoder.paged_kernel is not None)}


def _try_tokenizer(path: str) -> Any:
    import os

    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from realflow.base.tokenizer_loading import load_tokenizer

    return load_tokenizer(path)
