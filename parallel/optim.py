"""Optimizer settings and their megatron-core objects.

We always use megatron's DistributedOptimizer (optimizer states sharded over
the data-parallel group) with AdamW, its gradient clipping, and its
OptimizerParamScheduler.  LR schedule semantics are megatron's: the update of
step ``k`` (0-based) uses ``lr(k)``; with warmup, ``lr(k) = lr * k / warmup``
for ``k <= warmup`` (so step 0 has lr 0, as in transformers' schedules), then
cosine / linear decay to ``lr * min_lr_ratio`` at ``total_train_steps``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from parallel.mcore_globals import world_collectives_on
from realflow.api.experiment import OptimizerConfig

__all__ = ["EngineOptimizerConfig", "build_optimizer"]


@dataclass
class EngineOptimizerConfig(OptimizerConfig):
    """The experiment's optimizer settings (one definition, with its defaults and checks, in
    ``realflow.api.experiment``) plus the schedule length, which only the runtime knows: it
    counts the data before the models are built."""

    total_train_steps: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total_train_steps < 1:
            raise ValueError(f"EngineOptimizerConfig.total_train_steps={self.total_train_steps} < 1")

    @classmethod
    def for_run(cls, optimizer: OptimizerConfig, total_train_steps: int) -> "EngineOptimizerConfig":
        return cls(**asdict(optimizer), total_train_steps=max(int(total_train_steps), 1))

    @property
    def warmup_steps(self) -> int:
        return min(int(self.warmup_steps_proportion * self.total_train_steps),
                   self.total_train_steps - 1)


def build_optimizer(cfg: EngineOptimizerConfig, ddp_model: Any, pg_collection: Any,
                    params_dtype: torch.dtype) -> tuple[Any, Any]:
    """Megatron DistributedOptimizer (AdamW) and OptimizerParamScheduler for ``ddp_model``."""
    from megatron.core.optimizer import OptimizerConfig as MOptConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    mcfg = MOptConfig(
        optimizer="adam",  # AdamW: decoupled_weight_decay=True
        lr=cfg.lr,
        min_lr=cfg.lr * cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        clip_grad=max(cfg.gradient_clipping, 0.0),
        use_distributed_optimizer=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    with world_collectives_on(pg_collection.intra_dist_opt):  # all ranks of the model
        optimizer = get_megatron_optimizer(
            mcfg, [ddp_model], use_gloo_process_groups=False, pg_collection=pg_collection
        )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.lr * cfg.min_lr_ratio,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.total_train_steps,
        lr_decay_style=cfg.lr_scheduler_type,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.total_train_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler
