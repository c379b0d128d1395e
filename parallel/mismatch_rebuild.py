"""Both sides of a run, rebuilt in one process from an HF checkpoint: what the doctor replays.

Why in one process: a replay of a handful of samples needs neither the run's layouts nor its
workers, only the same weights, precision and micro-batching; one process with a world of one
(gloo on 127.0.0.1) builds the trainer's megatron engine (tp = pp = dp = 1) next to the
generation engine, so a user can run the doctor on a laptop after the run is gone.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Optional

import torch

__all__ = ["PRECISIONS", "dtype_of", "ensure_process_group", "build_trainer", "build_generator"]

PRECISIONS = ("fp32", "bf16")
_GROUPS: dict[str, Any] = {}


def dtype_of(precision: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def ensure_process_group() -> Any:
    """A world of one (this process), created once; the model groups of a one-rank layout."""
    import torch.distributed as dist

    from parallel.groups import ParallelStrategy, build_model_groups
    from realflow.base.devices import distributed_backend

    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(distributed_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"the mismatch replay runs in one process; this one is rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}")
    if "groups" not in _GROUPS:
        _GROUPS["groups"] = build_model_groups([0], ParallelStrategy(1, 1, 1))
    return _GROUPS["groups"]


def build_trainer(path: str, precision: str) -> Any:
    """The trainer's megatron engine of checkpoint ``path`` at ``precision`` (inference only)."""
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.model_config import precision_overrides

    dtype_of(precision)
    groups = ensure_process_group()
    return MegatronEngine(AutoConfig.from_pretrained(path), groups, path, optimizer_config=None, seed=1,
                          config_overrides=precision_overrides(precision))


def build_generator(path: str, precision: str, slots: int, max_len: int,
                    device: Optional[torch.device] = None) -> Any:
    """The built-in generation engine of ``path`` at ``precision``, with ``slots`` KV-cache slots of
    ``max_len`` positions (enough for a teacher-forced replay of that many samples)."""
    from parallel.generation import EngineConfig, GenerationEngine

    cfg = EngineConfig(max_running_requests=max(1, slots), max_model_len=max(2, max_len))
    return GenerationEngine.from_hf(path, cfg, tokenizer=None, dtype=dtype_of(precision), device=device)
