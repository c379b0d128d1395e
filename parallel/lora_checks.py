"""The megatron backend's LoRA settings per model and their plan-time checks.

What a layout builds (a starting PEFT adapter's own r/alpha/targets win, a layout fed by
reallocation does not read the adapter), what a reallocation moves (both layouts' adapters must
agree), and what is refused before any worker starts: LoRA on a critic whose value head has no
base weights, and a starting adapter that does not fit the model.
"""
from __future__ import annotations

import json
import os
from typing import Any

from parallel.model_config import hf_arch
from realflow.api.backend import LayoutError

__all__ = ["resolved_lora", "lora_for_layout", "check_lora", "lora_of_pair"]


def resolved_lora(spec: Any) -> Any:
    """The model's LoRA settings (None when off). Starting from a PEFT adapter (``lora.path``), its
    ``adapter_config.json`` decides r, alpha and the target modules: the run continues that adapter."""
    lora = getattr(spec, "lora", None)
    if lora is None or not lora.enabled:
        return None
    if not lora.path:
        return lora
    import dataclasses

    from parallel.lora_io import read_adapter_config

    saved = read_adapter_config(lora.path, dropout=lora.dropout)
    return dataclasses.replace(lora, r=saved.r, alpha=saved.alpha, target_modules=saved.target_modules)


def lora_for_layout(spec: Any, load_weights: bool) -> Any:
    """The model's LoRA settings; a layout whose weights arrive by reallocation does not read
    the starting adapter (it receives the trained one)."""
    lora = resolved_lora(spec)
    if lora is None or load_weights or not lora.path:
        return lora
    import dataclasses

    return dataclasses.replace(lora, path="")


def check_lora(spec: Any, cfg: dict[str, Any], what: str) -> None:
    """Plan-time checks of a LoRA model: a critic needs base weights for its head, and a starting
    adapter must fit the model (names and shapes from its file header)."""
    from parallel.hf_io import CheckpointError

    try:
        lora = resolved_lora(spec)
    except CheckpointError as e:
        raise LayoutError(f"{what}: {e}") from None
    if lora is None:
        return
    if spec.backend_args.get("critic"):
        index = os.path.join(spec.path, "model.safetensors.index.json")
        names: set[str] = set()
        if os.path.isfile(index):
            with open(index) as f:
                names = set(json.load(f).get("weight_map", {}))
        elif os.path.isfile(os.path.join(spec.path, "model.safetensors")):
            from safetensors import safe_open

            with safe_open(os.path.join(spec.path, "model.safetensors"), "pt") as f:
                names = set(f.keys())
        if "score.weight" not in names:
            raise LayoutError(f"{what}: LoRA on a critic whose value head has no base weights ({spec.path} has "
                              f"no score.weight: the head would be a frozen random projection); train the "
                              f"critic fully or start it from a trained critic checkpoint")
    if lora.path:
        from safetensors import safe_open

        from parallel.lora import lora_param_table
        from parallel.lora_io import ADAPTER_WEIGHTS, read_adapter_tensors

        file = os.path.join(lora.path, ADAPTER_WEIGHTS)
        if not os.path.isfile(file):
            try:
                read_adapter_tensors(lora.path)  # raises the precise message
            except CheckpointError as e:
                raise LayoutError(f"{what}: {e}") from None
        with safe_open(file, "pt") as f:
            shapes = {n.replace(".default.", "."): tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        for e in lora_param_table(cfg, hf_arch(cfg), lora):
            got = shapes.get(e.hf_names[0])
            if got != tuple(e.hf_shapes[0]):
                raise LayoutError(f"{what}: PEFT adapter {lora.path} does not fit this model: {e.hf_names[0]} is "
                                  f"{'missing' if got is None else list(got)}, expected {list(e.hf_shapes[0])} "
                                  f"(an adapter of another model?)")


def lora_of_pair(src_spec: Any, dst_spec: Any) -> Any:
    """The adapters a reallocation moves: both sides must agree on them (one model, two layouts)."""
    a, b = resolved_lora(src_spec), resolved_lora(dst_spec)
    if (a is None) != (b is None) or (a is not None and a.as_dict() != b.as_dict()):
        raise LayoutError(f"reallocation {src_spec.role} -> {dst_spec.role}: LoRA settings differ "
                          f"({a.as_dict() if a else 'off'} vs {b.as_dict() if b else 'off'}); a model's layouts share "
                          f"its adapters, and a LoRA model cannot feed a full model's weights")
    return a
