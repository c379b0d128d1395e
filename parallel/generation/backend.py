"""Registers the built-in engine as the ``builtin`` generation backend.

The gen server knows engines only through :data:`realflow.api.generation.generation_backends`
(``realflow/system`` never imports ``parallel/``); :class:`GenerationEngine` already
implements :class:`realflow.api.generation.GenerationBackend`, so the factory only
translates the server's :class:`BackendConfig`.
"""
from __future__ import annotations

import torch

from parallel.generation.engine import EngineConfig, GenerationEngine, _try_tokenizer
from realflow.api.generation import BackendConfig, generation_backends

__all__ = ["build_builtin_backend"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_builtin_backend(cfg: BackendConfig) -> GenerationEngine:
    """A single-process (tp = 1) :class:`GenerationEngine` on ``cfg.model_path``."""
    if cfg.dtype not in _DTYPES:
        raise ValueError(f"dtype={cfg.dtype!r}: expected one of {sorted(_DTYPES)}")
    unknown = sorted(set(cfg.extra) - {"max_prefill_tokens", "decode_attention", "kv_blocks"})
    if unknown:
        raise ValueError(f"builtin backend: unknown option(s) {unknown}")
    tokenizer = _try_tokenizer(cfg.tokenizer_path or cfg.model_path)
    econf = EngineConfig(max_running_requests=cfg.max_running_requests, max_model_len=cfg.max_model_len,
                         gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed,
                         block_size=cfg.kv_block_size, prefix_sharing=cfg.prefix_sharing,
                         enforce_eager=cfg.enforce_eager, **cfg.extra)
    engine = GenerationEngine.from_hf(cfg.model_path, econf, tokenizer=tokenizer, dtype=_DTYPES[cfg.dtype])
    if cfg.lora:
        engine.adapter_scaling = float(cfg.lora["alpha"]) / float(cfg.lora["r"])
    return engine


generation_backends.register("builtin", build_builtin_backend)
