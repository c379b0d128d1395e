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
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.generation.adapters import AdapterMerger
from parallel.generation.blocks import BlockAllocator
from parallel.generation.cuda_graphs import DecodeGraphs, decode_graphs_for
from parallel.generation.decoder import Decoder, KVCache
from parallel.generation.paged_cache import PagedKVCache
from parallel.generation.pager import Pager
from parallel.generation.weight_updates import WeightUpdatesMixin
from parallel.generation.kv_budget import kv_layout
from parallel.generation.routing import new_buffer
from parallel.generation.sampler import SampleBatch, sample
from parallel.generation.sequence import RowFlags, Seq
from parallel.generation.stepping import SteppingMixin
from parallel.generation.vision import EngineVision, shared_tower, vision_tower_for
from parallel.generation.weights import DecoderWeights, ModelSpec, load_hf_weights
from parallel.vision import vision_arch
from realflow.api.generation import (GenerationFailed, GenerationResult, SamplingParams, check_inference_memory,
                                     validate_input_ids)
from realflow.api.images import ImageInputs
from realflow.base.devices import worker_device

__all__ = ["EngineConfig", "GenerationEngine"]


DECODE_ATTENTION = ("auto", "contiguous", "paged")


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
    # where decode reads keys and values: "paged" gathers each row's blocks (the GPU's path),
    # "contiguous" keeps a per-row copy of the blocks (the CPU's: ~8x cheaper attention there);
    # "auto": contiguous on a CPU, paged on a GPU
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


class GenerationEngine(SteppingMixin, WeightUpdatesMixin):
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
        for i, r in enumerate(rids):
            seq = Seq(r, rid, i, prompt, params, base + i, frozenset(stop_ids))
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

    def _set_slots(self, row0: int, joined: list[Seq]) -> None:
        """Write the joining requests' settings into their slots' rows."""
        J, dev = len(joined), self._pos.device
        rows = slice(row0, row0 + J)
        ps = [s.params for s in joined]
        self._temp[rows] = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in ps])
        self._top_k[rows] = torch.tensor([p.top_k for p in ps], dtype=torch.long)
        self._top_p[rows] = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        self._min_p[rows] = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
        self._lp_sampling[rows] = torch.tensor([p.logprob_mode != "raw" for p in ps])
        self._budget[rows] = torch.tensor(
            [min(p.max_new_tokens, self._max_context - len(s.prompt)) - len(s.out)
             for s, p in zip(joined, ps)], dtype=torch.long)
        width = max(len(s.stop_ids) for s in joined)
        if width > self._stops.shape[1]:
            with torch.inference_mode(False):  # engine state: a normal tensor, writable anywhere
                grown = torch.full((self._stops.shape[0], width), -1, dtype=torch.long, device=dev)
                grown[:, : self._stops.shape[1]] = self._stops
            self._stops = grown
        table = torch.full((J, self._stops.shape[1]), -1, dtype=torch.long)
        for i, s in enumerate(joined):
            if s.stop_ids:
                table[i, : len(s.stop_ids)] = torch.tensor(sorted(s.stop_ids), dtype=torch.long)
        self._stops[rows] = table.to(dev)

    def _slot_tensors(self) -> tuple[torch.Tensor, ...]:
        state = (self._last, self._pos, self._temp, self._top_k, self._top_p, self._min_p, self._lp_sampling,
                 self._budget, self._stops, self._tables)
        return state if self._delta is None else state + (self._delta,)

    def _row_flags(self, row0: int, B: int) -> "RowFlags":
        """What rows ``row0..row0+B-1`` need beyond greedy decoding; cached until the running
        set changes (a steady decode step then loops over no request in Python)."""
        key = (row0, B)
        flags = self._flags.get(key)
        if flags is None:
            seqs = self._running[row0:row0 + B]
            sampled = [i for i, s in enumerate(seqs) if s.samples]
            rows = None
            if sampled and len(sampled) < B:
                rows = torch.tensor(sampled, device=self._pos.device)
            flags = RowFlags(sampled, rows, any(seqs[i].truncates for i in sampled),
                              any(s.params.logprob_mode != "raw" for s in seqs),
                              any(s.stop_ids for s in seqs),
                              [i for i, s in enumerate(seqs) if s.params.stop])
            self._flags[key] = flags
        return flags

    def _sample_batch(self, row0: int, seqs: list[Seq], flags: "RowFlags") -> Optional[SampleBatch]:
        if not flags.sampled:
            return None
        uniform = torch.tensor([seqs[i].rng.random() for i in flags.sampled], dtype=torch.float64,
                               device=self._pos.device)
        sl = slice(row0, row0 + len(seqs))
        temp, top_k, top_p, min_p = self._temp[sl], self._top_k[sl], self._top_p[sl], self._min_p[sl]
        if flags.rows is not None:
            temp, top_k, top_p, min_p = temp[flags.rows], top_k[flags.rows], top_p[flags.rows], min_p[flags.rows]
        return SampleBatch(flags.rows, temp, top_k, top_p, min_p, uniform, truncate=flags.truncate)

    def _accept(self, row0: int, logits: torch.Tensor, finished: dict[int, dict[str, Any]],
                decode: bool) -> None:
        """Sample rows ``row0..row0+B-1``, append to their sequences, find the finished ones.

        Stop ids and length limits are tested for all rows at once on the
        per-slot tensors; only rows that may have finished (and rows with stop
        strings, which need the tokenizer) go through :meth:`_finish_reason`.
        """
        B = logits.shape[0]
        sl = slice(row0, row0 + B)
        seqs = self._running[sl]
        flags = self._row_flags(row0, B)
        finite = torch.isfinite(logits).all(-1)  # a NaN/inf row would sample garbage: that request fails
        bad_rows = [] if bool(finite.all()) else (~finite).nonzero().flatten().tolist()
        if bad_rows:
            logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        tokens, raw, proc = sample(logits, self._sample_batch(row0, seqs, flags))
        logprobs = torch.where(self._lp_sampling[sl], proc, raw) if flags.lp_sampling else raw
        self._last[sl] = tokens
        if decode:  # the fed token now sits in the cache
            self._pos[sl] += self._one
        maybe_done = self._budget[sl].sub_(self._one) <= self._zero
        if flags.stop_ids:
            maybe_done |= (tokens[:, None] == self._stops[sl]).any(-1)
        toks, lps, version = tokens.tolist(), logprobs.tolist(), self.version
        for i in bad_rows:  # the request fails now; nothing sampled from these logits is kept
            finished[row0 + i] = {"type": "error", "message": f"non-finite logits at output token "
                                  f"{len(seqs[i].out)} of request {seqs[i].request_rid or seqs[i].rid} "
                                  f"(weight version {version})", "weight_version": version}
            self.nonfinite_requests += 1
        skip = set(bad_rows)
        for i, (seq, tok, lp) in enumerate(zip(seqs, toks, lps)):
            if i in skip:
                continue
            seq.out.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(version)
        self.tokens_generated += B - len(bad_rows)
        check = flags.stop_strings
        if bool(maybe_done.any()):
            check = sorted(set(check).union(maybe_done.nonzero().flatten().tolist()))
        for i in check:
            if i in skip:
                continue
            reason = self._finish_reason(seqs[i], toks[i])
            if reason is not None:
                finished[row0 + i] = reason

    def _finish_reason(self, seq: Seq, tok: int) -> Optional[dict[str, Any]]:
        if tok in seq.stop_ids:
            return {"type": "stop", "matched": tok}
        if seq.params.stop:
            text = self.tokenizer.decode(seq.out[-seq.stop_window:])
            for s in seq.params.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(seq.out) >= seq.params.max_new_tokens:
            return {"type": "length", "length": len(seq.out)}
        if len(seq.prompt) + len(seq.out) >= self._max_context:
            return {"type": "length", "length": len(seq.out)}
        return None

    @torch.inference_mode()
    def _remove_rows(self, finished: dict[int, dict[str, Any]]) -> list[tuple[int, GenerationResult]]:
        """Remove rows, moving the last surviving rows into the holes (a compact batch); all
        the moves are one indexed copy per tensor, whatever the number of rows."""
        if not finished:
            return []
        self._flags.clear()
        n = len(self._running)
        n_new = n - len(finished)
        out = []
        for row in sorted(finished):
            seq = self._running[row]
            self.pager.release(seq)
            self._ids.discard(seq.rid)
            out.append((row, seq.result(finished[row])))
        holes = [r for r in sorted(finished) if r < n_new]
        movers = [r for r in range(n_new, n) if r not in finished]
        if holes:
            dev = self._pos.device
            src, dst = torch.tensor(movers, device=dev), torch.tensor(holes, device=dev)
            if self.cache is not None:
                self.cache.move_rows(src, dst, int(self._pos[src].max()))
            for t in self._slot_tensors():
                t[dst] = t[src]
            for h, m in zip(holes, movers):
                self._running[h] = self._running[m]
        del self._running[n_new:]
        return out

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
                "kv_cache_bytes": float(self.pool.nbytes + (self.cache.nbytes if self.cache is not None else 0)),
                "kv_blocks": float(self.pager.alloc.num_blocks), "kv_blocks_used": float(self.pager.alloc.used_blocks),
                "prefill_tokens": float(self.prefill_tokens), "prefix_shared_tokens": float(self.prefix_shared_tokens),
                "prefix_cache_hits": float(self.pager.alloc.hits), "preempted_requests": float(self.preempted),
                "cuda_graphs": float(self.graphs.captured if self.graphs is not None else 0)}


def _try_tokenizer(path: str) -> Any:
    import os

    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from realflow.base.tokenizer_loading import load_tokenizer

    return load_tokenizer(path)
