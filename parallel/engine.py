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
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.cpu_compat import apply_cpu_compat
from parallel.engine_hf import EngineHFMixin
from parallel.engine_lora import load_adapter
from parallel.engine_infer import EngineInferenceMixin
from parallel.engine_step import EngineStepMixin
from parallel.groups import ModelGroups, agree_or_raise
from parallel.hf_io import CheckpointError
from parallel.hf_layout import execute_hf_load, plan_hf_load
from parallel.lora import LoRAModel, attach_lora
from parallel.mcore_globals import seed_megatron_rng
from parallel.model import build_gpt_model
from parallel.model_config import recompute_overrides
from parallel.moe_step import build_moe_step
from parallel.nonfinite import NonFinitePolicy
from parallel.optim import EngineOptimizerConfig, build_optimizer
from parallel.flops import TokenFlops, causal_pairs
from parallel.packed_batch import resolve_pad_free
from parallel.shared_prefix import resolve_shared_prefix
from parallel.optim_offload import OptimizerOffload
from parallel.outputs import TokenOutputs
from parallel.pipeline import MicroBatch, ScheduleRunner, share_from_last_stage
from parallel.packing import check_packed
from parallel.vision_step import VisionStep
from realflow.api.allocation import ParallelStrategy
from realflow.api.engine import LossFn, MicroBatches
from realflow.api.images import IMAGES_EXTRA
from realflow.api.keys import ROUTED_EXPERTS
from realflow.api.model_options import LoRAConfig, MoEConfig, TrainingMemoryConfig
from realflow.base.devices import to_device

__all__ = ["MegatronEngine", "EngineOptimizerConfig", "TokenOutputs", "LossFn"]


def _load_hf_config(hf_config: Any) -> Any:
    if isinstance(hf_config, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(hf_config)
    return hf_config


class MegatronEngine(EngineInferenceMixin, EngineStepMixin, EngineHFMixin):
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
