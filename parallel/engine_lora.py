"""What a :class:`parallel.engine.MegatronEngine` does differently when it trains LoRA adapters.

Kept beside the engine so the engine reads as the full-model path with a few ``if lora`` turns:
loading a PEFT adapter into any layout (every rank reads the small file and keeps its tp shard),
gathering the adapters under PEFT's names (to save them, or to send them to generation servers
instead of the whole model), saving (the adapter directory, plus a merged HF checkpoint with
``save_merged``), and the merged weights the engine's own generator samples from.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.groups import agree_or_raise
from parallel.hf_io import CheckpointError, copy_tokenizer_files, save_hf_checkpoint, tp_shard
from parallel.hf_layout import gather_hf_state_any
from parallel.lora import LoRAModel, merged_local_weight
from parallel.lora_io import merge_into_hf, read_adapter_tensors, write_peft_adapter

__all__ = ["load_adapter", "adapter_hf_state", "save_lora", "generation_weights", "refresh_merged"]


def load_adapter(engine: Any, path: str) -> None:
    """Copy a PEFT adapter into this rank's adapter shards; every rank validates, all agree first."""
    lora: LoRAModel = engine.lora
    g = engine.groups
    problem, tensors = "", {}
    try:
        tensors = read_adapter_tensors(path)
        want = {e.hf_names[0]: e.hf_shapes[0] for e in lora.table}
        missing = sorted(set(want) - set(tensors))
        extra = sorted(set(tensors) - set(want))
        if missing or extra:
            raise CheckpointError(f"PEFT adapter {path} does not fit model.lora "
                                  f"(r={lora.cfg.r}, target_modules={lora.cfg.target_modules}): "
                                  f"missing {missing[:2]}{'...' if len(missing) > 2 else ''}, "
                                  f"unexpected {extra[:2]}{'...' if len(extra) > 2 else ''}")
        for name, shape in want.items():
            if tuple(tensors[name].shape) != tuple(shape):
                raise CheckpointError(f"PEFT adapter {path}: {name} has shape {list(tensors[name].shape)}, "
                                      f"the model expects {list(shape)}")
    except CheckpointError as e:
        problem = str(e)
    agree_or_raise(g, problem, f"adapter {path}", CheckpointError)
    params = dict(engine.module.named_parameters())
    offset = engine.module.decoder.layers[0].layer_number - 1 if len(engine.module.decoder.layers) else 0
    with torch.no_grad():
        for e in lora.table:
            local = e.mcore_name.replace(f"decoder.layers.{e.layer}.", f"decoder.layers.{e.layer - offset}.", 1)
            if local not in params:
                continue  # another pipeline stage's layer
            t = tp_shard(e, tensors[e.hf_names[0]], g.tp_rank, g.strategy.tp)
            params[local].copy_(t.to(params[local].dtype))


def adapter_hf_state(engine: Any, grads: bool = False) -> Optional[dict[str, torch.Tensor]]:
    """Adapters (or their last reduced gradients) under PEFT's names on the writer; None elsewhere."""
    kw: dict[str, Any] = {}
    if grads:
        kw = {"tensor_of": lambda p: p.main_grad, "dtype": torch.float32}
    return gather_hf_state_any(engine.module, engine.groups, engine.hf_config, engine.arch,
                               table=engine.lora.table, **kw)


def save_lora(engine: Any, path: str, tokenizer_dir: Optional[str], base_path: str) -> None:
    """The adapter directory at ``path`` (PEFT's format) and, with ``save_merged``, ``path/merged``.
    Collective over the model's ranks."""
    adapters = adapter_hf_state(engine)
    base = engine.full_hf_state(adapters_merged=False) if engine.lora.cfg.save_merged else None
    if adapters is not None:
        write_peft_adapter(path, adapters, engine.lora.cfg, base_model=base_path)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, path)
        if base is not None:
            merged = dict(base)
            merged.update(merge_into_hf(base, adapters, engine.lora.cfg.scaling))
            save_hf_checkpoint(os.path.join(path, "merged"), merged, engine.hf_config, tokenizer_dir)
    if len(engine.groups.ranks) > 1:
        dist.barrier(group=engine.groups.model_group)


def generation_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's parameters with every adapted linear replaced by its merged weight (new
    tensors, refreshed by :func:`refresh_merged` after each update): the colocated generator
    samples from the model being trained, at the base model's decode cost."""
    named = {n: p for n, p in engine.module.named_parameters() if ".lora_" not in n}
    merged = engine._lora_merged = {}
    for name, adapter in engine.lora.adapters.items():
        local = _local_name(engine, name) + ".weight"
        merged[local] = merged_local_weight(adapter).contiguous()
        named[local] = merged[local]
    return named


def refresh_merged(engine: Any) -> None:
    """Recompute the merged weights in place (the generator's tensors alias them)."""
    merged = getattr(engine, "_lora_merged", None)
    if not merged:
        return
    with torch.no_grad():
        for name, adapter in engine.lora.adapters.items():
            merged[_local_name(engine, name) + ".weight"].copy_(merged_local_weight(adapter))


def _local_name(engine: Any, global_name: str) -> str:
    layers = engine.module.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0
    parts = global_name.split(".")
    parts[2] = str(int(parts[2]) - offset)
    return ".".join(parts)
