"""MegatronEngine: one model's forward / train step / generate / HF save on its ranks.

Built from an HF config and the model's :class:`parallel.groups.ModelGroups`.
Training uses megatron DDP (grad buffers, reduce in fp32) + DistributedOptimizer
and megatron's forward-backward schedule, so pipeline parallelism (issue 3)
plugs into the same loop.

Loss normalisation: the caller's ``loss_fn`` returns a SUM over tokens and
``loss_weight_fn`` the weight of a micro-batch (e.g. its number of loss tokens).
The engine all-reduces the total weight ``W`` over the dp group and back-props
``loss_sum * dp * n_mb / W`` per micro-batch: megatron's schedule divides by the
local micro-batch count ``n_mb`` and DDP averages over dp, so the update is the
gradient of ``sum(all loss sums) / W``, independent of the dp size and of how
the batch is split into micro-batches.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel.cpu_compat import apply_cpu_compat
from parallel.groups import ModelGroups
from parallel.hf_io import gather_hf_state, load_hf_checkpoint, save_hf_checkpoint
from parallel.mcore_globals import seed_megatron_rng
from parallel.model import build_gpt_model
from parallel.optim import OptimizerConfig, build_optimizer
from parallel.packing import check_packed, pad_packed, split_by_token_budget

__all__ = ["MegatronEngine", "OptimizerConfig"]

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]
_RESERVED = ("loss", "grad_norm", "lr", "n_tokens", "loss_weight", "n_mbs", "update_successful")


@dataclass
class _MicroBatch:
    input_ids: torch.Tensor
    seqlens: list[int]
    extra: Any = None


def _load_hf_config(hf_config: Any) -> Any:
    if isinstance(hf_config, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(hf_config)
    return hf_config


class MegatronEngine:
    """A megatron GPTModel (+ optimizer when trainable) on this rank's model groups."""

    def __init__(
        self,
        hf_config: Any,
        groups: ModelGroups,
        init_checkpoint: Optional[str] = None,
        optimizer_config: Optional[OptimizerConfig] = None,
        seed: int = 1,
        *,
        config_overrides: Optional[dict[str, Any]] = None,
        attention: str = "sdpa",
    ) -> None:
        if not groups.is_member:
            raise ValueError(f"MegatronEngine: this rank is not one of the model ranks {groups.ranks}")
        apply_cpu_compat()
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.hf_config = _load_hf_config(hf_config)
        self.groups = groups
        self.version = 0
        # Same seed on every rank: replicated params start identical even without
        # a checkpoint; the tracker gives tp ranks distinct model-parallel streams.
        seed_megatron_rng(seed, groups.tp_rank)
        self.module, self.arch = build_gpt_model(self.hf_config, groups, attention=attention,
                                                 config_overrides=config_overrides)
        self.config = self.module.config
        self.device = next(self.module.parameters()).device
        if init_checkpoint:
            load_hf_checkpoint(self.module, init_checkpoint, self.hf_config, self.arch,
                               groups.tp_rank, groups.strategy.tp)
        self.optimizer_config = optimizer_config
        self.optimizer = self.scheduler = None
        self.model: torch.nn.Module = self.module
        if optimizer_config is not None:
            self._setup_training(optimizer_config)
        self._fwd_bwd = get_forward_backward_func(pp_size=groups.strategy.pp, vp_size=None)

    # ------------------------------------------------------------------ setup

    def _setup_training(self, cfg: OptimizerConfig) -> None:
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

    # ------------------------------------------------------------------ helpers

    def _logits(self, model: torch.nn.Module, mb: _MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded forward of one micro-batch -> (logits [B, S, V] fp32, valid mask)."""
        pb = pad_packed(mb.input_ids.to(self.device), mb.seqlens)
        logits = model(pb.input_ids, pb.position_ids, None)  # causal mask built by megatron
        if self.groups.strategy.tp > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits, self.groups.tp_group)
        return logits[..., : self.arch.vocab_size].float(), pb.valid

    def _schedule(self, model: torch.nn.Module, mbs: list[_MicroBatch], step_fn: Callable,
                  forward_only: bool) -> list[Any]:
        return self._fwd_bwd(
            forward_step_func=step_fn,
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(max(mb.seqlens) for mb in mbs),
            micro_batch_size=max(len(mb.seqlens) for mb in mbs),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
            pg_collection=self.groups.pg_collection,
        )

    def dp_sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over this model's data-parallel group (identity when dp == 1)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.groups.strategy.dp > 1:
            dist.all_reduce(t, group=self.groups.dp_group)
        return t.tolist()

    # ------------------------------------------------------------------ API

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, seqlens: list[int],
                max_tokens_per_mb: Optional[int] = None) -> torch.Tensor:
        """Packed fp32 logits ``[sum(seqlens), vocab_size]`` (HF vocab, padding cut)."""
        seqlens = [int(n) for n in seqlens]
        check_packed(input_ids, seqlens)
        bounds = split_by_token_budget(seqlens, max_tokens_per_mb)
        offs = [0]
        for n in seqlens:
            offs.append(offs[-1] + n)
        mbs = [_MicroBatch(input_ids[offs[a]:offs[b]], seqlens[a:b]) for a, b in bounds]

        def step(data_iter, model):
            mb = next(data_iter)
            logits, valid = self._logits(model, mb)
            return logits, partial(self._collect, valid)

        self.model.eval()
        outs = self._schedule(self.model, mbs, step, forward_only=True)
        return torch.cat(outs, 0)

    @staticmethod
    def _collect(valid: torch.Tensor, logits: torch.Tensor, non_loss_data: bool = True):
        return logits[valid]

    def train_batch(self, micro_batches: list[tuple[torch.Tensor, list[int], Any]],
                    loss_fn: LossFn, loss_weight_fn: Callable[[Any], float]) -> dict[str, float]:
        """One optimizer step over this dp rank's micro-batches (see module docstring).

        Returns ``loss`` (global weighted mean), ``grad_norm`` (before clipping),
        ``lr`` (used by this step), ``n_tokens``, ``loss_weight`` and ``n_mbs`` (all
        global over dp), ``update_successful`` and the caller's stats, each SUMMED
        over all micro-batches of all dp ranks (divide by ``loss_weight`` or
        ``n_tokens`` for means).  ``loss_fn`` must return the same stat keys on every
        call and every rank.  Collective over the model's ranks; bad input on any
        dp rank makes every rank raise (nobody is left waiting in a collective).
        """
        if self.optimizer is None:
            raise RuntimeError("train_batch on an inference-only MegatronEngine "
                               "(built with optimizer_config=None)")
        mbs, weights, problem = [], [], ""
        try:
            if not micro_batches:
                raise ValueError("train_batch needs at least one micro-batch on every dp rank")
            for i, (ids, lens, extra) in enumerate(micro_batches):
                lens = [int(n) for n in lens]
                check_packed(ids, lens, what=f"micro_batches[{i}].input_ids")
                mbs.append(_MicroBatch(ids, lens, extra))
                weights.append(float(loss_weight_fn(extra)))
        except (ValueError, TypeError) as e:
            problem = str(e)
        n_tokens_local = sum(sum(mb.seqlens) for mb in mbs)
        total_w, n_tokens, n_mbs, n_bad = self.dp_sum(
            [sum(weights), n_tokens_local, len(mbs), float(bool(problem))])
        if n_bad:
            raise ValueError(problem or f"train_batch: bad input on {int(n_bad)} other dp rank(s)")
        if total_w <= 0:
            raise ValueError(f"train_batch: total loss weight over the dp group is {total_w}")
        scale = self.groups.strategy.dp * len(mbs) / total_w
        loss_sums: list[torch.Tensor] = []
        stats: list[dict[str, float]] = []

        def loss_func(mb: _MicroBatch, valid: torch.Tensor, logits: torch.Tensor):
            loss_sum, st = loss_fn(logits[valid], mb.extra)
            if not (isinstance(loss_sum, torch.Tensor) and loss_sum.dim() == 0):
                raise TypeError("loss_fn must return (scalar tensor loss_sum, dict of stats)")
            loss_sums.append(loss_sum.detach().double())
            stats.append({k: float(v) for k, v in st.items()})
            return loss_sum * scale, {}

        def step(data_iter, model):
            mb = next(data_iter)
            logits, valid = self._logits(model, mb)
            return logits, partial(loss_func, mb, valid)

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(self.model, mbs, step, forward_only=False)
        keys = self._agreed_stat_keys(stats)  # before stepping: a bad loss_fn changes nothing
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()  # norm is computed even without clipping
        self.scheduler.step(increment=1)
        if ok:
            self.version += 1
        red = self.dp_sum([float(sum(loss_sums))] + [sum(s[k] for s in stats) for k in keys])
        out = {"loss": red[0] / total_w, "grad_norm": float(grad_norm or 0.0), "lr": lr,
               "n_tokens": n_tokens, "loss_weight": total_w, "n_mbs": n_mbs,
               "update_successful": float(bool(ok))}
        out.update(zip(keys, red[1:]))
        return out

    def _agreed_stat_keys(self, stats: list[dict[str, float]]) -> list[str]:
        """The stat keys, checked to be the same for every micro-batch on every dp rank."""
        keys = sorted(stats[0]) if stats else []
        problem = ""
        if any(sorted(s) != keys for s in stats):
            problem = f"loss_fn returned different stat keys across micro-batches: " \
                      f"{[sorted(s) for s in stats]}"
        elif any(k in _RESERVED for k in keys):
            problem = f"loss_fn stat keys {[k for k in keys if k in _RESERVED]} clash with " \
                      f"engine keys {_RESERVED}"
        sig = -1 if problem else zlib.crc32("\0".join(keys).encode())
        t = torch.tensor([sig, -sig], dtype=torch.int64)
        if self.groups.strategy.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups.dp_group)
        if problem:
            raise ValueError(problem)
        if int(t[0]) != sig or int(t[1]) != -sig:
            raise ValueError(f"loss_fn stat keys differ across dp ranks (this rank: {keys})")
        return keys

    @torch.no_grad()
    def greedy_generate(self, prompts: list[list[int]], max_new_tokens: int,
                        eos_token_id: Optional[int] = None,
                        max_tokens_per_mb: Optional[int] = None) -> list[list[int]]:
        """Greedy continuation of each prompt (batched, no KV cache).

        Returns the NEW tokens of each prompt, ending with ``eos_token_id`` when it
        was generated.
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("greedy_generate: empty prompt")
        seqs = [list(map(int, p)) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not active:
                break
            lens = [len(seqs[i]) for i in active]
            ids = torch.tensor([t for i in active for t in seqs[i]], dtype=torch.long)
            logits = self.forward(ids, lens, max_tokens_per_mb)
            last = torch.tensor(lens).cumsum(0) - 1
            nxt = logits[last].argmax(-1).tolist()
            still = []
            for i, tok in zip(active, nxt):
                seqs[i].append(tok)
                new[i].append(tok)
                if eos_token_id is None or tok != eos_token_id:
                    still.append(i)
            active = still
        return new

    def save_hf(self, path: str, tokenizer_dir: Optional[str] = None) -> None:
        """Save as an HF checkpoint. Collective over the model's ranks: every rank
        calls it, dp rank 0 writes, and all return once the files exist."""
        s = self.groups.strategy
        if s.tp > 1 or s.pp > 1:
            raise NotImplementedError("save_hf with tp > 1 or pp > 1 (gathering shards) "
                                      "is not implemented yet")
        if self.groups.dp_rank == 0:
            state = gather_hf_state(self.module, self.hf_config, self.arch)
            save_hf_checkpoint(path, state, self.hf_config, tokenizer_dir)
        if len(self.groups.ranks) > 1:
            dist.barrier(group=self.groups.model_group)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under HF names (CPU copies; tp = pp = 1)."""
        return gather_hf_state(self.module, self.hf_config, self.arch)
