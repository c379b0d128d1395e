"""The optimizer step of :class:`parallel.engine.MegatronEngine`, guarded, and the checks that
keep every rank in step before it.

* :meth:`EngineStepMixin._checked_step`: the step applies only when the loss and the gradient
  norm are finite (else nothing changes and the policy of :mod:`parallel.nonfinite` decides
  whether the run stops or skips); a parameter that overflows after a finite step stops the run.
* :meth:`EngineStepMixin._check_replica_agrees` / :meth:`EngineStepMixin._agreed_stat_keys`: the
  tp/pp ranks of a replica got the same micro-batches, and ``loss_fn`` returned the same stat
  keys everywhere -- checked with one small collective each, so a mistake is a ValueError on
  every rank instead of a hang in the schedule.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.nonfinite import (
    NonFiniteError,
    NonFinitePolicy,
    clip_with_norm,
    describe_micro_batch,
    first_nonfinite,
    params_finite,
)
from parallel.pipeline import MicroBatch

__all__ = ["EngineStepMixin", "RESERVED_STATS"]

#: the keys train_batch returns itself (a loss_fn's stats may not reuse them)
RESERVED_STATS = ("loss", "grad_norm", "lr", "n_tokens", "n_computed_tokens", "flops_useful", "flops_computed",
                  "loss_weight", "n_mbs", "update_successful", "nonfinite_skipped")


def _mb_signature(mbs: list[MicroBatch]) -> int:
    """crc32 of the micro-batch structure (what every rank of a replica must agree on)."""
    return zlib.crc32(";".join(",".join(map(str, mb.seqlens)) for mb in mbs).encode())

class EngineStepMixin:
    """Needs the engine's ``groups``, ``optimizer``, ``scheduler``, ``model``, ``module``, ``version``,
    ``is_output_rank``, ``nonfinite_policy`` / ``nonfinite_run`` and ``_storage``."""

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
        elif not problem and any(k in RESERVED_STATS for k in keys):
            problem = f"loss_fn stat keys {[k for k in keys if k in RESERVED_STATS]} clash with " \
                      f"engine keys {RESERVED_STATS}"
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
