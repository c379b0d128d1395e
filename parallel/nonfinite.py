"""Non-finite losses, gradients and parameters: found on the step they appear, never trained on.

Why in the engine: only the engine sees every micro-batch's loss, the gradient norm after the
data-parallel reduction (so every rank of a model decides the same) and the parameters it
just wrote. Megatron's own checks (``check_for_nan_in_grad``, the loss scaler's inf check)
either crash one rank mid-collective or exist only for fp16; here every rank takes the same
decision before the optimizer touches anything:

* ``stop`` (default): the update is not applied and the step raises :class:`NonFiniteError`
  naming the first non-finite quantity (loss of which micro-batch and samples, or gradient
  norm). One rank reports it (the output rank of the data-parallel replica that holds the
  micro-batch); the others return their step's stats flagged, so the master sees one error.
* ``skip``: the update is not applied -- parameters, optimizer states and the learning-rate
  schedule stay bit for bit as they were -- and the step's stats say ``nonfinite_skipped``;
  more than ``max_skips`` consecutive skips stop the run as in ``stop``.

The parameters are checked after each applied update (one sum per tensor: a NaN or inf
anywhere makes it non-finite). With a finite gradient that means the optimizer itself
overflowed (a learning rate or epsilon that cannot work); the update is already in, so this
always stops, whatever the mode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from realflow.api.backend import NonFiniteError

__all__ = ["MODES", "NonFiniteError", "NonFinitePolicy", "first_nonfinite", "params_finite", "clip_with_norm",
           "describe_micro_batch"]

MODES = ("stop", "skip")


@dataclass
class NonFinitePolicy:
    mode: str = "stop"
    max_skips: int = 3  # consecutive skipped steps tolerated in skip mode

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"on_nonfinite={self.mode!r} must be one of {MODES}")
        if self.max_skips < 0:
            raise ValueError(f"max_nonfinite_skips={self.max_skips} must be >= 0")


def first_nonfinite(values: Sequence[float]) -> Optional[int]:
    """Index of the first value that is NaN or infinite, else None."""
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


def params_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite: one reduction per tensor, one sync."""
    sums = [p.detach().float().sum() for p in params]
    return bool(torch.stack(sums).sum().isfinite()) if sums else True


def suboptimizers(optimizer: Any) -> list[Any]:
    """The optimizers inside megatron's ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def clip_with_norm(optimizer: Any, max_norm: float, total_norm: float) -> None:
    """Clip every main gradient by the already computed global norm (what megatron's own
    ``step`` does after computing it; here the norm is computed once and checked first)."""
    # the name megatron's optimizer module calls (the CPU compatibility layer replaces it there)
    from megatron.core.optimizer import optimizer as mopt

    for opt in suboptimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params:
            mopt.clip_grad_by_total_norm_fp32(params, max_norm, total_norm,
                                              opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def describe_micro_batch(index: int, dp_rank: int, value: float, sample_ids: Optional[Sequence[Any]]) -> str:
    ids = f" (samples {list(sample_ids)[:16]}{' ...' if len(sample_ids) > 16 else ''})" if sample_ids else ""
    return f"non-finite loss ({value}) in micro-batch {index} of data-parallel rank {dp_rank}{ids}"
