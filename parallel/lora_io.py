"""PEFT's adapter format: ``adapter_config.json`` + ``adapter_model.safetensors``, read and written
without importing peft, and merging adapters into HF weights.

What realflow writes, ``peft.PeftModel.from_pretrained(base, path)`` loads; what PEFT saves for
a Qwen2/Qwen3/Llama causal LM with plain LoRA, realflow resumes from. Variants realflow does
not compute (DoRA, rsLoRA scaling is supported; per-module ranks, bias adapters, fan-in-fan-out
layouts, layer subsets, modules_to_save) are refused with the field named, not approximated.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Optional

import torch

from parallel.hf_io import CheckpointError
from parallel.lora import PEFT_PREFIX, TARGET_LINEARS
from realflow.api.model_options import LoRAConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "is_peft_adapter", "read_adapter_config",
           "read_adapter_tensors", "write_peft_adapter", "merge_into_hf"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER_NAME = re.compile(r"\.lora_([AB])\.(?:[A-Za-z0-9_]+\.)?weight$")


def is_peft_adapter(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def _refuse(path: str, field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{os.path.join(path, ADAPTER_CONFIG)}: {field}={value!r} is not supported ({why})")


def read_adapter_config(path: str, dropout: Optional[float] = None) -> LoRAConfig:
    """The adapter's LoRA settings as a :class:`LoRAConfig` (``dropout``: the run's, for training)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"model.lora.path={path}: no {ADAPTER_CONFIG} there (a PEFT adapter directory "
                              f"holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        with open(file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}:{e.lineno}: invalid JSON ({e.msg})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, "peft_type", raw.get("peft_type"), "only LORA adapters")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)):
        if raw.get(key, ok) != ok:
            raise _refuse(path, key, raw.get(key), f"realflow computes plain LoRA ({key}={ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save", "layer_replication"):
        if raw.get(key):
            raise _refuse(path, key, raw.get(key), "every targeted module must share r and alpha")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        targets = list(TARGET_LINEARS) if targets == "all-linear" else \
            [t for t in TARGET_LINEARS if re.search(targets, t)]
    cfg = LoRAConfig(enabled=True, r=int(raw["r"]), alpha=float(raw.get("lora_alpha", 8)),
                     dropout=float(raw.get("lora_dropout", 0.0)) if dropout is None else dropout,
                     target_modules=sorted(set(targets), key=list(TARGET_LINEARS).index)
                     if all(t in TARGET_LINEARS for t in targets) else list(targets),
                     init="default", path=path)
    if raw.get("use_rslora"):
        cfg.alpha = cfg.alpha * cfg.r ** 0.5  # rsLoRA: scaling alpha / sqrt(r) == (alpha sqrt r) / r
    return cfg


def read_adapter_tensors(path: str) -> dict[str, torch.Tensor]:
    """Adapter tensors under realflow's names (PEFT's, without an adapter name such as ``.default``)."""
    from safetensors.torch import load_file

    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        bin_file = os.path.join(path, "adapter_model.bin")
        hint = " (a pickled adapter_model.bin is not read: re-save it with safe_serialization=True)" \
            if os.path.isfile(bin_file) else ""
        raise CheckpointError(f"PEFT adapter {path}: {ADAPTER_WEIGHTS} is missing{hint}")
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(file).items():
        m = _ADAPTER_NAME.search(name)
        if m is None:
            raise CheckpointError(f"{file}: tensor {name} is not a LoRA A/B weight")
        key = name[:m.start()] + f".lora_{m.group(1)}.weight"
        if not key.startswith(PEFT_PREFIX):
            key = PEFT_PREFIX + key
        out[key] = t
    return out


def write_peft_adapter(path: str, tensors: Mapping[str, torch.Tensor], cfg: LoRAConfig,
                       base_model: str = "", task_type: str = "CAUSAL_LM") -> None:
    """Write ``tensors`` (PEFT names) and the config PEFT reads back (``LoraConfig`` fields)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    conf = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model or None,
        "r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True if cfg.init == "default" else cfg.init,
        "modules_to_save": None, "inference_mode": True, "revision": None,
    }
    tmp = os.path.join(path, ADAPTER_WEIGHTS + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, ADAPTER_WEIGHTS))
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(conf, f, indent=2)


@torch.no_grad()
def merge_into_hf(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                  scaling: float) -> dict[str, torch.Tensor]:
    """HF weights with every adapter merged as PEFT merges: ``W + (B @ A) * scaling``.

    ``base``: HF-named weights (any subset containing the adapted modules); returns the merged
    tensors of the adapted modules only, in ``base``'s dtype. One function for the merged
    checkpoint and the generation server's update, so both produce the same bytes.
    """
    out: dict[str, torch.Tensor] = {}
    for name_a, a in adapters.items():
        if not name_a.endswith(".lora_A.weight"):
            continue
        module = name_a[len(PEFT_PREFIX):-len(".lora_A.weight")]
        b = adapters[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        w = base[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + (b.float() @ a.float()) * scaling).to(w.dtype)
    return out
