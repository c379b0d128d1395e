"""Where a worker's tensors live: its GPU when there is one, else the CPU.

One module decides what differs between a GPU and a CPU worker, so the engine, the
workers, the gen servers and the test harness agree:

* :func:`resolve_precision` -- ``precision=auto`` is bf16 parameters on GPUs, fp32 on CPUs;
* :func:`distributed_backend` -- ``"cpu:gloo,cuda:nccl"`` on GPUs (torch then sends a
  collective on CUDA tensors through NCCL and one on host tensors through gloo, in the
  same process groups), plain ``"gloo"`` without CUDA.  The control messages every
  rank exchanges (agreement flags, stat sums, sample counts) stay host tensors; the
  model's own collectives (tensor-parallel all-reduces, the distributed optimizer's
  reduce-scatter) run on the GPU tensors megatron gives them.
* :func:`select_device` -- the GPU of a worker, by its local index on the host
  (``LOCAL_RANK``, else ``SLURM_LOCALID``, else the caller's index), modulo the GPUs
  this process sees, so a scheduler that hands each task its own GPU through
  ``CUDA_VISIBLE_DEVICES`` and one that shows every task all GPUs both work.
* :func:`to_device` / :func:`to_host` -- what crosses the engine boundary: inputs and
  loss inputs move to the model's device once per micro-batch; results go back to
  host memory, because the data layer (shared memory, msgpack frames) holds host
  tensors only.
"""
from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["PRECISIONS", "resolve_precision", "distributed_backend", "select_device", "worker_device",
           "to_device", "to_host", "local_index"]


PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str) -> str:
    """``fp32`` or ``bf16`` for a model's parameters; ``auto`` = bf16 on a GPU, fp32 on a CPU.

    Why auto differs: GPUs run bf16 matrix products an order of magnitude faster than fp32
    (tensor cores), and megatron keeps fp32 master weights and gradients, so training stays
    stable; CPUs without bf16 units run it slower than fp32 and gain nothing."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {' | '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    return precision


def distributed_backend() -> str:
    """The torch.distributed backend string for this process (see module docstring)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def local_index(default: int) -> int:
    """This process's index among the workers of its host (scheduler's word first)."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return int(default)


def select_device(default_local_index: int) -> torch.device:
    """Bind this process to its GPU (``torch.cuda.set_device``) and return it; CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_index(default_local_index) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def worker_device() -> torch.device:
    """This process's compute device: its current GPU when there is one, else the CPU.

    Also where a point-to-point buffer between two workers lives (NCCL between GPUs, gloo
    between CPU workers): both ends must agree, so it depends on the process alone, not on
    where the tensors being sent happen to be (an offloaded model's are on the host)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (dicts, lists, tuples) on ``device``; others unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=device.type == "cuda")
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return obj._make(to_device(v, device) for v in obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor in host memory (see :func:`to_device`)."""
    return to_device(obj, torch.device("cpu"))

