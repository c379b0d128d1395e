"""Optimizer state (and optionally fp32 master weights) in pinned host memory between train steps.

``training.optimizer_offload`` / ``training.offload_master_weights``: Adam keeps two fp32 moments
per parameter (8 bytes) and, for bf16 parameters, an fp32 master copy (4 more) -- 12 of the
16-18 bytes per parameter a trained model holds beyond its weights.  They are read only inside
the optimizer step, so between steps (the forward/backward of the next batch, generation,
inference MFCs of other models on the same device) they can live on the host.

Why our own mover and not megatron-core's two facilities (0.16.1):

* ``OptimizerConfig.optimizer_cpu_offload`` builds a ``HybridDeviceOptimizer`` that runs Adam
  itself on the CPU every step (device -> host gradients, a CPU Adam, host -> device
  parameters): the optimizer's arithmetic moves to the host and the masters are always there,
  so states and masters cannot be offloaded separately;
* ``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` move the moments and the
  optimizer's parameters (masters) together, into pageable memory (``.cpu()``), and allocate a
  new host tensor on every offload.

This module follows ``offload_to_cpu``'s approach (``state`` tensors and ``param.data`` swapped
in place, so the optimizer's parameter objects, its state keys and megatron's range maps stay
valid) with pinned host buffers allocated once and reused, asynchronous copies, and the masters
optional.  The step itself runs on the device, unchanged: :meth:`OptimizerOffload.resident`
brings everything back before megatron copies gradients to the main shards and sends it out
again after the step (applied or skipped).

Masters exist only for bf16/fp16 parameters (``shard_fp32_from_float16_groups``); an fp32
model's main shards are views of its own parameters, which stay on the device (one log line).
On a CPU-only host there is no device memory to free: the keys are accepted, nothing moves,
one log line says so.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import torch

__all__ = ["OptimizerOffload"]

logger = logging.getLogger("realflow.parallel")


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """megatron's per-buffer optimizers (a ChainedOptimizer holds several)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


class OptimizerOffload:
    """Moves one megatron optimizer's Adam moments (and fp32 masters) between device and pinned host."""

    def __init__(self, optimizer: Any, device: torch.device, master_weights: bool) -> None:
        self.optimizer = optimizer
        self.device = device
        self.master_weights = bool(master_weights)
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), key | "param") -> pinned buffer
        self._away: set[tuple[int, str]] = set()  # what is on the host now
        self.on_host = False

    @classmethod
    def build(cls, optimizer: Any, training: Any, device: torch.device) -> Optional["OptimizerOffload"]:
        """The mover for ``training`` (a :class:`realflow.api.model_options.TrainingMemoryConfig`),
        or None when nothing is to be offloaded (also on a CPU-only host, with one log line)."""
        if training is None or not training.optimizer_offload:
            return None
        if device.type != "cuda":
            logger.info("training.optimizer_offload=true: no accelerator here, the optimizer state already "
                        "lives in host memory (nothing to offload)")
            return None
        mover = cls(optimizer, device, training.offload_master_weights)
        if mover.master_weights and not mover._masters():
            logger.info("training.offload_master_weights=true: this model's parameters are fp32, so the "
                        "optimizer updates them in place and keeps no separate master copy to offload")
        return mover

    # ------------------------------------------------------------------ what moves

    def _masters(self) -> list[torch.Tensor]:
        """The fp32 master shards of bf16/fp16 parameters (distinct tensors, safe to move)."""
        out: list[torch.Tensor] = []
        for opt in _inner_optimizers(self.optimizer):
            for group in getattr(opt, "shard_fp32_from_float16_groups", None) or []:
                out.extend(group)
        return out

    def _states(self) -> Iterator[tuple[dict[str, Any], str, tuple[int, str]]]:
        for opt in _inner_optimizers(self.optimizer):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for param, state in inner.state.items():
                for k, v in state.items():
                    if torch.is_tensor(v) and v.numel() > 1:  # not Adam's scalar "step"
                        yield state, k, (id(param), k)

    def _pinned(self, key: tuple[int, str], like: torch.Tensor) -> torch.Tensor:
        buf = self._host.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._host[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf

    # ------------------------------------------------------------------ moves

    def to_host(self) -> None:
        """Copy the state out to pinned host buffers and drop the device copies."""
        for state, k, key in self._states():
            v = state[k]
            if v.device.type == "cuda":
                state[k] = self._pinned(key, v).copy_(v, non_blocking=True)
                self._away.add(key)
        if self.master_weights:
            for p in self._masters():
                key = (id(p), "param")
                if p.data.device.type == "cuda":
                    p.data = self._pinned(key, p.data).copy_(p.data, non_blocking=True)
                    self._away.add(key)
        torch.cuda.synchronize(self.device)  # the host buffers are complete before the device memory is reused
        self.on_host = True

    def to_device(self) -> None:
        """Bring back what :meth:`to_host` moved (a state replaced meanwhile, e.g. by a recover point, stays)."""
        for state, k, key in self._states():
            v = state[k]
            if key in self._away and v.device.type != "cuda":
                state[k] = v.to(self.device, non_blocking=True)
        if self.master_weights:
            for p in self._masters():
                if (id(p), "param") in self._away and p.data.device.type != "cuda":
                    p.data = p.data.to(self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        self._away.clear()
        self.on_host = False

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The optimizer's state on the device for the step inside; on the host again after it,
        whether the step applied, was skipped or raised."""
        self.to_device()
        try:
            yield
        finally:
            self.to_host()

    def host_bytes(self) -> int:
        """Bytes of pinned host memory this mover holds (its buffers are reused from step to step)."""
        return sum(t.numel() * t.element_size() for t in self._host.values())
