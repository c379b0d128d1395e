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

from typing import Any, Optional

__all__ = ["COLOCATED_GPU_MEMORY_UTILIZATION", "build_colocated_generator", "colocated_generator"]

#: the KV cache of a generator inside a model worker stays allocated between steps, beside the
#: trainer's state and activations: by default it may take at most this fraction of the free memory
#: when built (``ppo.gpu_memory_utilization`` sets another)
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5


def colocated_generator(engine: Any, context: int, *, version: int, tokenizer: Any, max_running: int,
                        gpu_memory_utilization: Optional[float], max_model_len: Optional[int],
                        enforce_eager: Optional[bool] = None, kv_block_size: Optional[int] = None,
                        prefix_sharing: Optional[bool] = None) -> Any:
    """``engine``'s generator (kept on it as ``engine._generator``), rebuilt when the caller needs a
    longer context than its KV cache holds or asks for other settings (the old cache is freed
    before the new one is made); told ``version`` when the weights moved since."""
    gen = engine._generator
    want = (gpu_memory_utilization, max_model_len, enforce_eager, kv_block_size, prefix_sharing)
    if gen is not None and (getattr(gen, "settings", want) != want
                            or gen.max_context < min(max_model_len or context, gen.model_context)):
        engine._generator = gen = None
    if gen is None:
        gen = engine._generator = build_colocated_generator(engine, context, tokenizer, max_running,
                                                            gpu_memory_utilization, max_model_len,
                                                            enforce_eager, kv_block_size, prefix_sharing)
        gen.settings = want
    if gen.weight_version != version:
        if getattr(engine, "lora", None) is not None:
            from parallel.engine_lora import refresh_merged

            refresh_merged(engine)  # the generator samples from W + (alpha/r) B A
        from parallel.engine_experts import needs_expert_gather, refresh_gathered_experts

        if needs_expert_gather(engine):
            refresh_gathered_experts(engine)  # every expert on every rank (collective over ep)
        gen.weights_updated(version)
    return gen


def build_colocated_generator(engine: Any, context: int, tokenizer: Any, max_running: int,
                              gpu_memory_utilization: Optional[float] = None,
                              max_model_len: Optional[int] = None, enforce_eager: Optional[bool] = None,
                              kv_block_size: Optional[int] = None, prefix_sharing: Optional[bool] = None) -> Any:
    """A :class:`parallel.generation.GenerationEngine` over ``engine``'s parameters.

    ``context``: the longest prompt + new tokens the caller needs. The KV cache is sized for it
    (the next power of two, at most the model's context), not for the model's whole context
    (32k tokens for a 7B Qwen2.5: ~1.9 GB per slot), unless ``max_model_len`` says how long.
    """
    from parallel.generation import EngineConfig, GenerationEngine

    if engine.is_critic:
        raise TypeError("generator() on a critic engine (a value model does not generate)")
    if engine.strategy.pp > 1:
        raise ValueError(f"generation needs a layout with pp=1, got {engine.strategy}; give the "
                         f"generate MFC its own allocation (e.g. actor_gen:d2)")
    size = max_model_len or min(1 << max(int(context) - 1, 1).bit_length(), engine.arch.max_position_embeddings)
    fraction = COLOCATED_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    engine_kw = {k: v for k, v in (("enforce_eager", enforce_eager), ("block_size", kv_block_size),
                                   ("prefix_sharing", prefix_sharing)) if v is not None}
    return GenerationEngine.from_megatron(
        engine, EngineConfig(max_running_requests=max_running, max_model_len=size,
                             gpu_memory_utilization=fraction, **engine_kw),
        tokenizer=tokenizer)
