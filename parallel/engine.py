"""MegatronEngine: one model's forward / logprobs / values / train step / HF save, any layout.

Built from an HF config and the model's :class:`parallel.groups.ModelGroups`
(dp x tp x pp).  Training uses megatron DDP (grad buffers, reduce in fp32) +
DistributedOptimizer and megatron's forward-backward schedule (1F1B when pp > 1,
see :mod:`parallel.pipeline`); tensor parallelism runs with sequence parallelism.

Who gets what (``is_output_rank`` = last pipeline stage and tp rank 0, i.e. the
data-parallel head of each dp replica, ``Layout.dp_head`` in the plan):

* ``forward`` / ``logprobs`` / ``values`` return host tensors on output ranks and
  ``None`` on every other rank (on a GPU the model's outputs are copied back once, as
  the data layer holds host tensors);
* ``train_batch`` returns the same stats dict on every rank of the model;
* ``greedy_generate`` returns the new tokens on every rank of the replica;
* ``generator`` returns the engine's own sampler (:mod:`parallel.engine_generator`), which
  shares these parameters;
* ``save_hf`` / ``full_hf_state`` gather to one writer (dp 0, tp 0, pp 0).

Every method is collective over the ranks of one dp replica (``forward``,
``logprobs``, ``values``, ``greedy_generate``) or of the whole model (the rest),
and all tp and pp ranks of a replica pass the same inputs.

The class implements :class:`realflow.api.engine.TrainEngine` (what algorithms may call)
and :class:`realflow.api.engine.NonFiniteConfigurable`.

Loss normalisation: the caller's ``loss_fn`` returns a SUM over tokens and
``loss_weight_fn`` the weight of a micro-batch (e.g. its number of loss tokens).
The engine all-reduces the total weight ``W`` over the dp group and back-props
``loss_sum * dp * n_mb / W`` per micro-batch: megatron's schedule divides by the
local micro-batch count ``n_mb`` and DDP averages over dp, so the update is the
gradient of ``sum(all loss sums) / W``, independent of the layout and of how the
batch is split into micro-batches.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.cpu_compat import apply_cpu_compat
from parallel.engine_generator import colocated_generator
from parallel.engine_hf import EngineHFMixin
from parallel.engine_lora import load_adapter
from parallel.groups import ModelGroups, agree_or_raise
from parallel.hf_io import CheckpointError
from parallel.hf_layout import execute_hf_load, plan_hf_load
from parallel.lora import LoRAModel, attach_lora
from parallel.mcore_globals import seed_megatron_rng
from parallel.model import build_gpt_model
from parallel.model_config import recompute_overrides
from parallel.moe_step import build_moe_step
from parallel.nonfinite import (
    NonFiniteError,
    NonFinitePolicy,
    clip_with_norm,
    describe_micro_batch,
    first_nonfinite,
    params_finite,
)
from parallel.optim import EngineOptimizerConfig, build_optimizer
from parallel.flops import TokenFlops, causal_pairs
from parallel.packed_batch import resolve_pad_free
from parallel.shared_prefix import resolve_shared_prefix
from parallel.optim_offload import OptimizerOffload
from parallel.outputs import TokenOutputs
from parallel.pipeline import (
    MicroBatch,
    ScheduleRunner,
    next_token_targets,
    share_from_last_stage,
    split_packed,
)
from parallel.packing import check_packed
from parallel.vision import image_layout
from parallel.vision_step import VisionStep
from realflow.api.allocation import ParallelStrategy
from realflow.api.engine import BatchGenerator, LossFn, MicroBatches
from realflow.api.images import IMAGES_EXTRA
from realflow.api.keys import ROUTED_EXPERTS
from realflow.api.model_options import LoRAConfig, MoEConfig, TrainingMemoryConfig
from realflow.api.padded_partition import padded_partition
from realflow.base.devices import to_device, to_host

__all__ = ["MegatronEngine", "EngineOptimizerConfig", "TokenOutputs", "LossFn"]

_RESERVED = ("loss", "grad_norm", "lr", "n_tokens", "n_computed_tokens", "flops_useful", "flops_computed",
             "loss_weight", "n_mbs", "update_successful", "nonfinite_skipped")


def _load_hf_config(hf_config: Any) -> Any:
    if isinstance(hf_config, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(hf_config)
    return hf_config


def _mb_signature(mbs: list[MicroBatch]) -> int:
    """crc32 of the micro-batch structure (what every rank of a replica must agree on)."""
    return zlib.crc32(";".join(",".join(map(str, mb.seqlens)) for mb in mbs).encode())


class MegatronEngine(EngineHFMixin):
    """A megatron GPTModel (LM or critic; + optimizer when trainable) on one model's groups."""

    def __init__(
        self,
        hf_config: Any,
        groups: ModelGroups,
        init_checkpoint: Optional[str] = None,
        optimizer_config: Optional[EngineOptimizerConfig] = None,
        seed: int = 1,
        *,
        config_overrides: Optional[dict[str, Any]] = None,
        attention: str = "sdpa",
        critic: bool = False,
        lora: Optional[LoRAConfig] = None,
        training: Optional[TrainingMemoryConfig] = None,
        moe: Optional[MoEConfig] = None,
        freeze_vision: bool = False,
    ) -> None:
        """``training``: activation recompute and optimizer offload (``training.*``, see
        :class:`realflow.api.model_options.TrainingMemoryConfig`); ``config_overrides`` win over
        the recompute fields it sets.  ``moe``: routing replay and the load-balancing loss of an
        MoE model (:class:`realflow.api.model_options.MoEConfig`).  ``freeze_vision``: a
        vision-language model's tower is not trained (no gradients, no optimizer state)."""
        if not groups.is_member:
            raise ValueError(f"MegatronEngine: this rank is not one of the model ranks {groups.ranks}")
        apply_cpu_compat()
        self.hf_config = _load_hf_config(hf_config)
        self.groups = groups
        self.critic = critic
        self.training = training or TrainingMemoryConfig()
        self.version = 0
        self.nonfinite_policy = NonFinitePolicy()  # the run's: configure_nonfinite (on_nonfinite)
        self.nonfinite_run = 0  # consecutive steps skipped for a non-finite loss or gradient
        # Same seed on every rank: replicated params start identical even without
        # a checkpoint; the tracker gives tp ranks distinct model-parallel streams.
        seed_megatron_rng(seed, groups.tp_rank)
        lora = lora if lora is not None and lora.enabled else None
        overrides = {**recompute_overrides(self.training.gradient_checkpointing), **(config_overrides or {})}
        self.module, self.arch = build_gpt_model(self.hf_config, groups, attention=attention,
                                                 config_overrides=overrides, critic=critic,
                                                 use_te=False if lora else None)
        self.config = self.module.config
        self.device = next(self.module.parameters()).device
        self.base_path = init_checkpoint or ""
        self.lora: Optional[LoRAModel] = None
        if lora is not None:
            self.lora = attach_lora(self.module, lora, self.hf_config, self.arch, groups, seed)
        if init_checkpoint:
            self._load(init_checkpoint)
        if freeze_vision and getattr(self.module, "visual", None) is not None:
            self.module.visual.requires_grad_(False)
        if self.lora is not None and lora.path:
            load_adapter(self, lora.path)
        self.optimizer_config = optimizer_config
        self.optimizer = self.scheduler = None
        self.offload: Optional[OptimizerOffload] = None  # training.optimizer_offload on a GPU
        self._storage: Optional[list[torch.Tensor]] = None  # the parameters' storage (_param_storage)
        self.model: torch.nn.Module = self.module
        if optimizer_config is not None:
            self._setup_training(optimizer_config)
        self.moe_step = build_moe_step(self.module, self.arch, groups, self.config, self.hf_config, moe)
        self.vision_step = None if self.arch.vision is None else \
            VisionStep(self.module, self.arch.vision, bool(self.config.sequence_parallel), groups.tp_group)
        # training.pad_free: concatenated micro-batches where the model supports them (packed_batch.py)
        self.pad_free = resolve_pad_free(self.training.pad_free, self.module, moe=self.moe_step,
                                         vision=self.vision_step)
        # training.shared_prefix: a sample group's common prompt once per micro-batch (shared_prefix.py)
        self.shared_prefix = resolve_shared_prefix(self.training.shared_prefix, pad_free=self.pad_free,
                                                   module=self.module, moe=self.moe_step, vision=self.vision_step)
        self._flops = TokenFlops.from_hf(self.hf_config)  # the step's FLOPs, useful and computed (flops.py)
        self._runner = ScheduleRunner(groups, self.config, self.moe_step, self.vision_step, pad_free=self.pad_free,
                                      shared_prefix=self.shared_prefix)
        self._generator: Optional[Any] = None  # parallel.generation.GenerationEngine, built by generator()

    @contextlib.contextmanager
    def without_shared_prefix(self) -> Iterator[None]:
        """Every sequence in rows of its own inside (a probe that reads each sample's rows whole)."""
        mode, self._runner.shared_prefix = self._runner.shared_prefix, "off"
        try:
            yield
        finally:
            self._runner.shared_prefix = mode

    # ------------------------------------------------------------------ setup

    def _load(self, path: str) -> None:
        """Validate on every rank, agree over the model's ranks, then copy (sliced reads)."""
        g = self.groups
        problem, plan = "", None
        try:
            plan = plan_hf_load(self.module, path, self.hf_config, self.arch, g.tp_rank,
                                g.strategy.tp, critic=self.critic)
        except CheckpointError as e:
            problem = str(e)
        agree_or_raise(g, problem, f"checkpoint {path}", CheckpointError)
        execute_hf_load(self.module, plan, self.hf_config, self.arch, g.tp_rank, g.strategy.tp)

    def _setup_training(self, cfg: EngineOptimizerConfig) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=True,
        )
        self.model = DistributedDataParallel(
            self.config, ddp_config, self.module, pg_collection=self.groups.pg_collection
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.optimizer, self.scheduler = build_optimizer(
            cfg, self.model, self.groups.pg_collection, self.config.params_dtype
        )
        if self.config.fp16:  # dynamic loss scaling (bf16 / fp32 need none)
            self.config.grad_scale_func = self.optimizer.scale_loss
        self.offload = OptimizerOffload.build(self.optimizer, self.training, self.device)

    # ------------------------------------------------------------------ helpers

    @property
    def strategy(self) -> ParallelStrategy:
        """The layout this engine runs in (data, tensor and pipeline parallel degrees)."""
        return self.groups.strategy

    @property
    def is_critic(self) -> bool:
        """True for a value model (built with ``critic=True``)."""
        return bool(self.critic)

    @property
    def computed_tokens(self) -> int:
        """Token rows (real + padding) the last schedule of this dp replica ran: forward passes'
        counterpart of ``train_batch``'s ``n_computed_tokens``."""
        return int(self._runner.computed_tokens)

    @property
    def is_output_rank(self) -> bool:
        """True where forward / logprobs / values return tensors: last stage, tp rank 0."""
        return self.groups.is_last_stage and self.groups.tp_rank == 0

    def _token_outputs(self, valid: torch.Tensor, output: torch.Tensor) -> TokenOutputs:
        shard = output.shape[-1]
        start = 0 if self.critic else self.groups.tp_rank * shard
        return TokenOutputs(output, valid, self.groups.tp_group, start, self.arch.vocab_size,
                            self.critic)

    @torch.no_grad()
    def _infer(self, input_ids: torch.Tensor, seqlens: list[int], max_tokens_per_mb: Optional[int],
               fn: Callable[[TokenOutputs, MicroBatch], Any], routes: Optional[torch.Tensor] = None,
               images: Optional[list[Any]] = None) -> list[Any]:
        """Forward-only schedule over contiguous micro-batches; ``fn`` per micro-batch on the
        last stage ([] elsewhere)."""
        mbs = split_packed(input_ids, seqlens, max_tokens_per_mb, routes, images)
        self.model.eval()
        return self._runner.run(self.model, mbs,
                                lambda mb, valid, out: fn(self._token_outputs(valid, out), mb),
                                forward_only=True, device=self.device)

    @torch.no_grad()
    def _infer_tokens(self, input_ids: torch.Tensor, seqlens: list[int], max_tokens_per_mb: Optional[int],
                      fn: Callable[[TokenOutputs, MicroBatch], Any], routes: Optional[torch.Tensor] = None,
                      images: Optional[list[Any]] = None) -> Any:
        """Forward-only, ``fn`` returning per-token tensors (or a tuple of them): the packed
        result in the input's order, on output ranks (None elsewhere).

        Under a budget, sequences of similar length share a micro-batch (each runs padded
        to its longest; see realflow.api.padded_partition), and the outputs are put back
        in the input's order; pad-free, contiguous runs of sequences fill the budget.
        """
        seqlens = [int(n) for n in seqlens]
        if self.pad_free:  # cost = real tokens: contiguous runs under the budget, no reordering
            return self._packed_result(self._infer(input_ids, seqlens, max_tokens_per_mb, fn, routes, images))
        parts = [list(range(len(seqlens)))] if max_tokens_per_mb is None or not seqlens else \
            padded_partition([[n] for n in seqlens], 1, max_tokens_per_mb)
        if len(parts) == 1:
            return self._packed_result(self._infer(input_ids, seqlens, None, fn, routes, images))
        check_packed(input_ids, seqlens)
        offs = [0]
        for n in seqlens:
            offs.append(offs[-1] + n)
        mbs = [MicroBatch(torch.cat([input_ids[offs[i]:offs[i + 1]] for i in p]), [seqlens[i] for i in p],
                          routes=None if routes is None else torch.cat([routes[offs[i]:offs[i + 1]] for i in p]),
                          images=None if images is None else [images[i] for i in p])
               for p in parts]
        self.model.eval()
        outs = self._runner.run(self.model, mbs, lambda mb, valid, out: fn(self._token_outputs(valid, out), mb),
                                forward_only=True, device=self.device)
        result = self._packed_result(outs)
        if result is None:
            return None
        where = torch.cat([torch.arange(offs[i], offs[i + 1]) for p in parts for i in p])

        def unpermute(t: torch.Tensor) -> torch.Tensor:
            back = torch.empty_like(t)
            back[where.to(t.device)] = t
            return back
        return tuple(unpermute(t) for t in result) if isinstance(result, tuple) else unpermute(result)

    def _packed_result(self, parts: list[Any]) -> Any:
        if not self.is_output_rank:
            return None
        if parts and isinstance(parts[0], tuple):
            return tuple(to_host(torch.cat(p)) for p in zip(*parts))
        return to_host(torch.cat(parts))

    def dp_sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over this model's data-parallel group (identity when dp == 1)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.groups.strategy.dp > 1:
            dist.all_reduce(t, group=self.groups.dp_group)
        return t.tolist()

    def _dp_sum_and_max(self, sums: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
        """:meth:`dp_sum` of ``sums`` and :meth:`dp_max` of ``maxima`` in one collective (an all-gather:
        each small collective costs a round trip); the sums add the ranks in rank order."""
        if self.groups.strategy.dp == 1 or not (sums or maxima):
            return [float(v) for v in sums], [float(v) for v in maxima]
        if not maxima:
            return self.dp_sum(sums), []
        t = torch.tensor(sums + maxima, dtype=torch.float64)
        out = torch.empty(self.groups.strategy.dp * t.numel(), dtype=torch.float64)
        dist.all_gather_into_tensor(out, t, group=self.groups.dp_group)
        out = out.view(self.groups.strategy.dp, -1)
        red = out[0, :len(sums)].clone()
        for r in range(1, out.shape[0]):
            red += out[r, :len(sums)]
        return red.tolist(), out[:, len(sums):].max(0).values.tolist()

    def dp_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over this model's data-parallel group."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.groups.strategy.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups.dp_group)
        return t.tolist()

    # ------------------------------------------------------------------ inference

    def forward(self, input_ids: torch.Tensor, seqlens: list[int],
                max_tokens_per_mb: Optional[int] = None, *,
                routed_experts: Optional[torch.Tensor] = None,
                images: Optional[list[Any]] = None) -> Optional[torch.Tensor]:
        """Packed fp32 logits ``[sum(seqlens), vocab_size]`` (HF vocab) on output ranks.

        Gathers the full vocabulary over tp: for log-probs use :meth:`logprobs`.
        A critic returns its values ``[sum(seqlens), 1]``.  ``routed_experts``, ``images``: see
        :meth:`logprobs`.
        """
        def fn(out: TokenOutputs, mb: MicroBatch) -> torch.Tensor:
            return out.values()[:, None] if self.critic else out.logits()

        return self._infer_tokens(input_ids, seqlens, max_tokens_per_mb, fn, self._routes(routed_experts),
                                  self._images(images, seqlens, input_ids))

    def _images(self, images: Optional[list[Any]], seqlens: list[int],
                input_ids: Optional[torch.Tensor] = None) -> Optional[list[Any]]:
        """Per-sequence images of a VL model, checked against ``input_ids``' placeholders here, before
        any collective (a mismatch found inside one rank's forward would leave its peers waiting in
        the gradient all-reduce); images given to a text-only model are refused."""
        if images is None:
            return None
        if self.vision_step is None:
            if any(img is not None and img.num_images for img in images):
                raise ValueError(f"images given to a text-only model (model_type={self.arch.model_type!r}); "
                                 f"use a vision-language model such as Qwen2.5-VL")
            return None
        if len(images) != len(seqlens):
            raise ValueError(f"images: {len(images)} entries for {len(seqlens)} sequences")
        if input_ids is not None:
            off = 0
            for i, (n, img) in enumerate(zip(seqlens, images)):
                grid = None if img is None or img.num_images == 0 else img.grid_thw
                try:
                    image_layout(input_ids[off:off + int(n)].cpu(), grid, self.arch.vision)
                except ValueError as e:
                    raise ValueError(f"sequence {i}: {e}") from None
                off += int(n)
        return list(images)

    def _routes(self, routed_experts: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Replayed experts for an MoE model with replay on (else ignored: a dense model has none)."""
        if routed_experts is None or self.moe_step is None or not self.moe_step.replay:
            return None
        return routed_experts

    def logprobs(self, input_ids: torch.Tensor, seqlens: list[int],
                 max_tokens_per_mb: Optional[int] = None, *, temperature: float = 1.0,
                 with_entropy: bool = False, routed_experts: Optional[torch.Tensor] = None,
                 images: Optional[list[Any]] = None) -> Any:
        """Log-prob of each next token, packed fp32 ``[sum(seqlens)]``, on output ranks.

        ``out[t] = log p(input_ids[t + 1] | input_ids[..t])`` within each sequence; the
        last position of every sequence has no next token and holds 0.  Computed on
        the vocab shards (no full-vocab gather).  ``with_entropy=True`` returns
        ``(logprobs, entropy)``, entropy of the next-token distribution at every
        position.  Logits are divided by ``temperature`` first.  ``routed_experts`` (MoE,
        routing replay): packed ``[sum(seqlens), layers, k]`` expert ids the generator chose per
        token (``-1`` rows: the router's own choice), used instead of the router's top-k.
        ``images`` (VL models): one :class:`realflow.api.images.ImageInputs` (or None) per
        sequence, whose placeholders (already expanded) in ``input_ids`` get the tower's features.
        """
        if self.critic:
            raise TypeError("logprobs() on a critic engine (use values())")

        def fn(out: TokenOutputs, mb: MicroBatch) -> Any:
            targets, valid = next_token_targets(mb.input_ids.to(self.device), mb.seqlens)
            lp, ent = out.logprobs_and_entropy(targets, temperature) if with_entropy else \
                (out.logprobs(targets, temperature), None)
            lp = torch.where(valid, lp, torch.zeros_like(lp))
            return (lp, ent) if with_entropy else lp

        return self._infer_tokens(input_ids, seqlens, max_tokens_per_mb, fn, self._routes(routed_experts),
                                  self._images(images, seqlens, input_ids))

    def values(self, input_ids: torch.Tensor, seqlens: list[int],
               max_tokens_per_mb: Optional[int] = None, *,
               images: Optional[list[Any]] = None) -> Optional[torch.Tensor]:
        """Critic values per token, packed fp32 ``[sum(seqlens)]``, on output ranks."""
        if not self.critic:
            raise TypeError("values() on an LM engine (build it with critic=True)")
        return self._infer_tokens(input_ids, seqlens, max_tokens_per_mb, lambda out, mb: out.values(),
                                  images=self._images(images, seqlens, input_ids))

    @torch.no_grad()
    def greedy_generate(self, prompts: list[list[int]], max_new_tokens: int,
                        eos_token_id: Optional[int] = None,
                        max_tokens_per_mb: Optional[int] = None, *,
                        images: Optional[list[Any]] = None) -> list[list[int]]:
        """Greedy continuation of each prompt (batched, no KV cache), on every rank of
        the replica.  Returns the NEW tokens of each prompt, ending with
        ``eos_token_id`` when it was generated.  ``images``: one ImageInputs (or None) per prompt."""
        if self.critic:
            raise TypeError("greedy_generate() on a critic engine")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("greedy_generate: empty prompt")
        seqs = [list(map(int, p)) for p in prompts]
        images = self._images(images, [len(p) for p in prompts])
        new: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not active:
                break
            lens = [len(seqs[i]) for i in active]
            ids = torch.tensor([t for i in active for t in seqs[i]], dtype=torch.long)

            def last_argmax(out: TokenOutputs, mb: MicroBatch) -> torch.Tensor:
                ends = torch.tensor(mb.seqlens).cumsum(0) - 1
                return out.argmax()[ends]

            parts = self._infer(ids, lens, max_tokens_per_mb, last_argmax,
                                images=None if images is None else [images[i] for i in active])
            nxt = to_host(torch.cat(parts)) if parts else torch.empty(len(active), dtype=torch.long)
            if self.groups.strategy.pp > 1:  # the last stage tells the others
                src = self.groups.rank_at(dp=self.groups.dp_rank, tp=self.groups.tp_rank,
                                          pp=self.groups.strategy.pp - 1)
                dist.broadcast(nxt, src=src, group=self.groups.pp_group)
            still = []
            for i, tok in zip(active, nxt.tolist()):
                seqs[i].append(tok)
                new[i].append(tok)
                if eos_token_id is None or tok != eos_token_id:
                    still.append(i)
            active = still
        return new

    def generator(self, context: int, *, version: int, tokenizer: Any = None, max_running: int = 256,
                  gpu_memory_utilization: Optional[float] = None,
                  max_model_len: Optional[int] = None) -> BatchGenerator:
        """The generation engine over this engine's parameters (built once, then reused; pp = 1, LM only).

        ``context``: the longest prompt + new tokens the caller needs; a later call that needs
        more frees the old KV cache and builds a larger one. ``version``: the model's weight
        version; when it differs from the generator's, the weights moved in place since the
        last call (an optimizer step, a reallocation) and the generator refreshes what it
        derives from them. ``tokenizer`` (for stop strings) is taken when the generator is built.
        ``gpu_memory_utilization`` / ``max_model_len`` size its KV cache (``ppo.*`` keys; see
        :mod:`parallel.engine_generator` for the defaults).
        """
        return colocated_generator(self, context, version=version, tokenizer=tokenizer, max_running=max_running,
                                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)

    # ------------------------------------------------------------------ training

    def train_batch(self, micro_batches: MicroBatches,
                    loss_fn: LossFn, loss_weight_fn: Callable[[Any], float],
                    sample_ids: Optional[list[Sequence[Any]]] = None) -> dict[str, float]:
        """One optimizer step over this dp replica's micro-batches (see module docstring).

        ``micro_batches``: ``(packed input_ids, seqlens, extra)`` each, the same on
        every tp/pp rank of the replica (a VL model's ``extra["images"]``: one ImageInputs or
        None per sequence, as :meth:`logprobs` takes them).  ``loss_fn(outputs, extra)`` gets a
        :class:`TokenOutputs` of the micro-batch's real tokens (packed order:
        ``outputs.logprobs(targets)``, ``.entropy()``, ``.values()``, ...) and returns
        ``(loss SUM as a scalar tensor, stats)``; it runs on the last pipeline stage
        only, on every tp rank there.

        Returns, on every rank: ``loss`` (global weighted mean), ``grad_norm`` (before
        clipping), ``lr`` (used by this step), ``n_tokens``, ``n_computed_tokens`` (the token
        rows the layers ran: real + padding; ``n_tokens / n_computed_tokens`` is the real
        fraction, 1 pad-free up to the sp / pp filler; fewer with shared prefixes),
        ``flops_useful`` / ``flops_computed`` (:mod:`parallel.flops`), ``loss_weight`` and
        ``n_mbs`` (all global over dp), ``update_successful`` and the caller's stats,
        each SUMMED over all micro-batches of all dp ranks (a stat named ``*_max``: the
        maximum).  ``loss_fn`` must return
        the same stat keys on every call and every rank.  Bad input or a failing
        ``loss_fn`` on any rank makes every rank raise ValueError before the
        optimizer step (nobody is left waiting in a collective).
        ``sample_ids`` (one list per micro-batch) only serve the message when a micro-batch's
        loss is not finite (see :mod:`parallel.nonfinite`: such a step applies no update; it
        raises on one rank in ``stop`` mode, returns ``nonfinite_skipped`` = 1 in ``skip``).
        """
        if self.optimizer is None:
            raise RuntimeError("train_batch on an inference-only MegatronEngine "
                               "(built with optimizer_config=None)")
        g = self.groups
        mbs, weights, problem = [], [], ""
        try:
            if not micro_batches:
                raise ValueError("train_batch needs at least one micro-batch on every dp rank")
            for i, (ids, lens, extra) in enumerate(micro_batches):
                lens = [int(n) for n in lens]
                check_packed(ids, lens, what=f"micro_batches[{i}].input_ids")
                weights.append(float(loss_weight_fn(extra)))
                routes = extra.get(ROUTED_EXPERTS) if isinstance(extra, dict) else None
                images = extra.get(IMAGES_EXTRA) if isinstance(extra, dict) else None
                if images is not None:  # host-side inputs of the forward, not tensors of the loss
                    extra = {k: v for k, v in extra.items() if k != IMAGES_EXTRA}
                mbs.append(MicroBatch(ids, lens, to_device(extra, self.device),  # once, not per use
                                      routes=self._routes(routes), images=self._images(images, lens, ids)))
        except (ValueError, TypeError) as e:
            problem = str(e)
        problem = self._check_replica_agrees(mbs, problem)
        n_tokens_local = sum(sum(mb.seqlens) for mb in mbs)
        total_w, n_tokens, n_mbs, n_bad = self.dp_sum(
            [sum(weights), n_tokens_local, len(mbs), float(bool(problem))])
        if n_bad:
            raise ValueError(problem or f"train_batch: bad input on {int(n_bad)} other dp rank(s)")
        if total_w <= 0:
            raise ValueError(f"train_batch: total loss weight over the dp group is {total_w}")
        scale = g.strategy.dp * len(mbs) / total_w
        loss_sums: list[float] = []
        stats: list[dict[str, float]] = []
        errors: list[str] = []

        def loss_func(mb: MicroBatch, valid: torch.Tensor, output: torch.Tensor):
            try:
                loss_sum, st = loss_fn(self._token_outputs(valid, output), mb.extra)
                if not (isinstance(loss_sum, torch.Tensor) and loss_sum.dim() == 0):
                    raise TypeError("loss_fn must return (scalar tensor loss_sum, dict of stats)")
                st = {k: float(v) for k, v in st.items()}
            except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                errors.append(f"loss_fn failed: {type(e).__name__}: {e}")
                return output.sum() * 0.0, {}  # keep the schedule (and its p2p) in step
            loss_sums.append(float(loss_sum.detach()))
            stats.append(st)
            return loss_sum * scale, {}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._runner.run(self.model, mbs, loss_func, forward_only=False, device=self.device,
                         aux_scale_of=lambda i: weights[i] * g.strategy.dp / total_w)
        payload = None
        useful_pairs = sum(causal_pairs(n) for mb in mbs for n in mb.seqlens)
        work = [float(self._runner.computed_tokens), self._flops.train(n_tokens_local, useful_pairs),
                self._flops.train(self._runner.computed_tokens, self._runner.computed_pairs)]
        if g.is_last_stage:
            keys, err = self._agreed_stat_keys(stats, errors)
            payload = {"error": err, "keys": keys}
            if not err:  # stats named *_max are maxima (over micro-batches and dp), the rest sums
                sums = [k for k in keys if not k.endswith("_max")]
                maxima = [k for k in keys if k.endswith("_max")]
                red, top = self._dp_sum_and_max(
                    [sum(loss_sums)] + [sum(s[k] for s in stats) for k in sums] + work,
                    [max((s[k] for s in stats), default=0.0) for k in maxima])
                red, work = red[:-len(work)], red[-len(work):]
                payload["keys"] = keys = sums + maxima
                payload["sums"] = red + top
                if not math.isfinite(red[0]):  # every last-stage rank knows: locate it (collective)
                    payload["bad"] = self._locate_nonfinite_loss(loss_sums, sample_ids)
            else:
                work = self.dp_sum(work)
        else:
            work = self.dp_sum(work)
        n_computed, flops_useful, flops_computed = work
        payload = share_from_last_stage(g, payload)
        if payload["error"]:  # before stepping: a bad loss_fn changes nothing
            raise ValueError(payload["error"])
        lr = float(self.optimizer.param_groups[0]["lr"])
        with self.offload.resident() if self.offload is not None else contextlib.nullcontext():
            ok, grad_norm = self._checked_step(payload.get("bad"))
        red = payload["sums"]
        out = {"loss": red[0] / total_w, "grad_norm": grad_norm, "lr": lr,
               "n_tokens": n_tokens, "n_computed_tokens": n_computed, "flops_useful": flops_useful,
               "flops_computed": flops_computed, "loss_weight": total_w, "n_mbs": n_mbs,
               "update_successful": float(ok), "nonfinite_skipped": float(not ok)}
        out.update(zip(payload["keys"], red[1:]))
        if self.moe_step is not None:
            out.update(self.moe_step.reduced_stats())
        return out

    def configure_nonfinite(self, mode: str, max_skips: int) -> None:
        """What a step with a non-finite loss or gradient does: ``stop`` or ``skip`` (see
        :mod:`parallel.nonfinite`)."""
        self.nonfinite_policy = NonFinitePolicy(mode, int(max_skips))
        self.nonfinite_run = 0

    def _locate_nonfinite_loss(self, loss_sums: list[float], sample_ids: Optional[list[Sequence[Any]]]
                               ) -> dict[str, Any]:
        """The dp rank whose micro-batch is first non-finite reports it (the lowest such rank)."""
        g = self.groups
        local = first_nonfinite(loss_sums)
        t = torch.tensor([g.dp_rank if local is not None else g.strategy.dp], dtype=torch.int64)
        if g.strategy.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g.dp_group)
        reporter = int(t[0])
        text = None
        if reporter == g.dp_rank and local is not None:
            ids = sample_ids[local] if sample_ids is not None and local < len(sample_ids) else None
            text = describe_micro_batch(local, g.dp_rank, loss_sums[local], ids)
        return {"dp_rank": reporter, "text": text}

    def _checked_step(self, bad_loss: Optional[dict[str, Any]]) -> tuple[bool, float]:
        """The optimizer step, unless the loss or the gradient norm is not finite (then nothing
        changes: see :mod:`parallel.nonfinite`). Returns (applied, gradient norm)."""
        g = self.groups
        opt = self.optimizer
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm() or 0.0)  # over every rank of the model: all agree
        problem, reporter = None, False
        if bad_loss is not None:
            problem = bad_loss["text"] or f"non-finite loss on data-parallel rank {bad_loss['dp_rank']}"
            reporter = bad_loss["text"] is not None and self.is_output_rank
        elif found_inf or not math.isfinite(grad_norm):
            problem = f"non-finite gradient norm ({grad_norm}) after the data-parallel reduction"
            reporter = g.global_rank == g.ranks[0]
        if problem is None:
            clip = float(opt.config.clip_grad or 0.0)
            if clip > 0:
                clip_with_norm(opt, clip, grad_norm)
            opt.step_with_ready_grads()
            self.scheduler.step(increment=1)
            self.version += 1
            self.nonfinite_run = 0
            if not params_finite(self._param_storage()):
                raise NonFiniteError(f"parameters not finite after an update with finite loss and gradient norm "
                                     f"({grad_norm}) on rank {g.global_rank}: the optimizer overflowed (check lr "
                                     f"and eps); the update is applied, so the run stops")
            return True, grad_norm
        self.nonfinite_run += 1
        pol = self.nonfinite_policy
        if reporter and (pol.mode == "stop" or self.nonfinite_run > pol.max_skips):
            why = "" if pol.mode == "stop" else \
                f"; {self.nonfinite_run} consecutive steps skipped > max_nonfinite_skips={pol.max_skips}"
            raise NonFiniteError(f"{problem}; the update was not applied{why}")
        return False, grad_norm

    def _param_storage(self) -> list[torch.Tensor]:
        """Every parameter, as few tensors as possible: the DDP buffers the trained ones are views of
        (one reduction each instead of one per parameter), then any parameter outside them."""
        if self._storage is None:
            bufs = [b.param_data for b in [*getattr(self.model, "buffers", []),
                                           *getattr(self.model, "expert_parallel_buffers", [])]
                    if getattr(b, "param_data", None) is not None]
            held = {t.untyped_storage().data_ptr() for t in bufs}
            outside = [p for p in self.module.parameters() if p.untyped_storage().data_ptr() not in held]
            self._storage = bufs + outside
        return self._storage

    def _check_replica_agrees(self, mbs: list[MicroBatch], problem: str) -> str:
        """All tp/pp ranks of a dp replica must hold the same micro-batch structure."""
        mp = self.groups.pg_collection.mp
        if mp is None or mp.size() == 1:
            return problem
        sig = -1 if problem else _mb_signature(mbs)
        t = torch.tensor([sig, -sig], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mp)
        if problem:
            return problem
        if int(t[0]) != sig or int(t[1]) != -sig:
            return (f"train_batch: the tp/pp ranks of dp replica {self.groups.dp_rank} were "
                    f"given different micro-batches (or one had bad input); every rank of a "
                    f"replica must pass the same micro-batches")
        return ""

    def _agreed_stat_keys(self, stats: list[dict[str, float]], errors: list[str]
                          ) -> tuple[list[str], str]:
        """The stat keys, checked to be the same for every micro-batch on every dp rank.

        Runs on the last stage (collective over its dp group); returns (keys, error).
        """
        keys = sorted(stats[0]) if stats else []
        problem = errors[0] if errors else ""
        if not problem and any(sorted(s) != keys for s in stats):
            problem = f"loss_fn returned different stat keys across micro-batches: " \
                      f"{[sorted(s) for s in stats]}"
        elif not problem and any(k in _RESERVED for k in keys):
            problem = f"loss_fn stat keys {[k for k in keys if k in _RESERVED]} clash with " \
                      f"engine keys {_RESERVED}"
        sig = -1 if problem else zlib.crc32("\0".join(keys).encode())
        t = torch.tensor([sig, -sig], dtype=torch.int64)
        if self.groups.strategy.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups.dp_group)
        if problem:
            return keys, problem
        if int(t[0]) != sig or int(t[1]) != -sig:
            return keys, (f"loss_fn stat keys differ across dp ranks (this rank: {keys}) or "
                          f"loss_fn failed on another dp rank")
        return keys, ""
