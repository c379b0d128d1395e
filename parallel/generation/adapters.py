"""LoRA weight updates on a generation engine: adapters in, merged weights out.

A LoRA run sends generation servers only its adapters (PEFT-named ``lora_A``/``lora_B``: a few
MB instead of the model). The engine merges them into the BASE weights it was started from,
``W = W_base + (alpha / r) B A`` exactly as PEFT's merge and realflow's merged checkpoint compute
it (:func:`parallel.lora_io.merge_into_hf`), so a server updated with adapters holds the same
bytes as one loaded from the merged checkpoint, and decodes at the base model's cost.

Why merge rather than a separate low-rank path at decode time: measured on the tiny default
model (benchmarks/bench_memory.py, LoRA section), the extra two skinny matmuls per adapted linear
per token cost more than re-merging once per weight version, and a merged engine is bit-identical
to a server loaded with merged weights (the low-rank path rounds differently). The price is
keeping the base tensors of the adapted linears (all parts of a fused one: q, k and v for any of
them) on the host, read once from the base checkpoint at the first adapter update.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from parallel.hf_io import CheckpointError, read_hf_tensors

__all__ = ["AdapterMerger", "is_adapter_update"]

_MODULE = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.(?:self_attn|mlp)\.)([a-z_]+)\.lora_([AB])\.weight$")
#: HF modules merged into one megatron linear: an update of one part rebuilds the whole linear
_FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
          "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
          "up_proj": ("gate_proj", "up_proj")}


def is_adapter_update(tensors: Mapping[str, Any]) -> bool:
    """True when every name is a PEFT LoRA factor (an adapter-only update)."""
    return bool(tensors) and all(_MODULE.match(n) for n in tensors)


class AdapterMerger:
    """Base tensors of the adapted linears of one checkpoint, and the merge of an adapter update."""

    def __init__(self, base_path: str) -> None:
        self.base_path = base_path
        self._base: dict[str, torch.Tensor] = {}

    def _needed(self, adapters: Mapping[str, torch.Tensor]) -> list[str]:
        names: set[str] = set()
        for n in adapters:
            m = _MODULE.match(n)
            if m is None:
                raise CheckpointError(f"adapter update: {n} is not a PEFT LoRA factor "
                                      f"(base_model.model.<module>.lora_A|lora_B.weight)")
            prefix, module = m.group(1), m.group(2)
            for part in _FUSED.get(module, (module,)):
                names.add(f"{prefix}{part}.weight")
        return sorted(names)

    @torch.no_grad()
    def merged(self, adapters: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
        """Full HF tensors of every linear the adapters touch: base + merged update."""
        from parallel.lora_io import merge_into_hf

        need = self._needed(adapters)
        missing = [n for n in need if n not in self._base]
        if missing:
            if not self.base_path:
                raise CheckpointError("adapter update on a generation engine that was not loaded from a "
                                      "checkpoint directory (its base weights are unknown)")
            try:
                self._base.update({k: v.clone() for k, v in read_hf_tensors(self.base_path, missing).items()})
            except KeyError as e:
                raise CheckpointError(f"adapter update: base tensor {e.args[0]} is not in {self.base_path} "
                                      f"(adapters of another model?)") from None
        for n, t in adapters.items():
            if n.endswith(".lora_A.weight"):
                module = n[len("base_model.model."):-len(".lora_A.weight")]
                b = adapters.get(f"base_model.model.{module}.lora_B.weight")
                w = self._base[f"{module}.weight"]
                if b is None or t.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or b.shape[1] != t.shape[0]:
                    raise CheckpointError(
                        f"adapter update: {module} lora_A {list(t.shape)} / lora_B "
                        f"{list(b.shape) if b is not None else 'missing'} do not fit its weight {list(w.shape)}")
        out = {n: self._base[n] for n in need}
        out.update(merge_into_hf(self._base, adapters, scaling))
        return out
