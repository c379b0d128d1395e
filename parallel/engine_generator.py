"""The sampler a :class:`parallel.engine.MegatronEngine` owns: realflow's generation engine on its weights.

Why the train engine owns it: the generation engine shares the megatron parameters (no
copy), so it belongs to exactly one train engine, must see every in-place change of its
weights (a reallocation into the layout, an optimizer step) and must be freed before a
larger KV cache is made. Keeping it inside the engine (``MegatronEngine.generator``)
lets algorithms ask for "a sampler over these weights" through the typed seam
(:class:`realflow.api.engine.TrainEngine`) without importing ``parallel.generation`` or
storing anything on the engine.
"""
from __future__ import annotations

from typing import Any

__all__ = ["COLOCATED_KV_MEMORY_FRACTION", "build_colocated_generator"]

#: the KV cache of a generator inside a model worker stays allocated between steps, beside the
#: trainer's state and activations: it may take at most this fraction of the free memory when built
COLOCATED_KV_MEMORY_FRACTION = 0.5


def build_colocated_generator(engine: Any, context: int, tokenizer: Any, max_running: int) -> Any:
    """A :class:`parallel.generation.GenerationEngine` over ``engine``'s parameters.

    ``context``: the longest prompt + new tokens the caller needs. The KV cache is sized for it
    (the next power of two, at most the model's context), not for the model's whole context
    (32k tokens for a 7B Qwen2.5: ~1.9 GB per slot).
    """
    from parallel.generation import EngineConfig, GenerationEngine

    if engine.is_critic:
        raise TypeError("generator() on a critic engine (a value model does not generate)")
    if engine.strategy.pp > 1:
        raise ValueError(f"generation needs a layout with pp=1, got {engine.strategy}; give the "
                         f"generate MFC its own allocation (e.g. actor_gen:d2)")
    size = 1 << max(int(context) - 1, 1).bit_length()
    return GenerationEngine.from_megatron(
        engine, EngineConfig(max_running_requests=max_running, max_seq_len=size,
                             kv_cache_memory_fraction=COLOCATED_KV_MEMORY_FRACTION),
        tokenizer=tokenizer)
