"""LoRA adapters on megatron's fused linears, sharded with tensor parallelism like their base weights.

PEFT's LoRA adds ``(alpha / r) * B(A(dropout(x)))`` to each targeted HF linear. Megatron fuses
HF linears (``q/k/v_proj`` -> ``linear_qkv`` grouped per query group, ``gate/up_proj`` ->
``linear_fc1``), so an adapter here keeps one (A, B) pair PER HF MODULE and writes each part's
update into its rows of the fused output. That keeps the adapters exactly PEFT's (same tensors,
same maths), and every adapter tensor is a plain ``copy`` row of the mapping table
(:func:`lora_param_table`) with the tp split of its base weight:

* column-parallel linears (qkv, fc1): ``A`` ``[r, in]`` replicated, ``B`` ``[out, r]`` split on
  dim 0 like the weight's rows (whole query groups / this rank's ffn columns);
* row-parallel linears (proj, fc2): ``A`` ``[r, in]`` split on dim 1 like the weight's input
  columns, ``B`` ``[out, r]`` replicated.

Communication mirrors megatron's own: with sequence parallelism a column adapter computes
``A x`` on its sequence shard and all-gathers the rank-``r`` activation (r numbers per token
instead of the hidden size); a row adapter reduce-scatters its partial ``A x``. The replicated
factor then sees a different part of the sequence on each tp rank, so it is marked
``sequence_parallel`` and ``finalize_model_grads`` sums its gradient over tp, as megatron does
for norms.

The adapters are parameters of the linear modules themselves (``linear_qkv.lora_A.q_proj``):
base parameter names do not change, so checkpoints, reallocation tables and the generation
engine see the model they always saw, and a forward hook adds the update. The base is frozen
(``requires_grad=False``): megatron's DDP and distributed optimizer then hold only adapters.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from parallel.hf_io import ParamMapping, tp_shard
from parallel.model_config import HFArch
from realflow.api.model_options import LoRAConfig

__all__ = ["LoRAModel", "attach_lora", "lora_param_table", "PEFT_PREFIX", "TARGET_LINEARS",
           "merged_local_weight"]

#: PEFT saves a causal LM's adapters under ``base_model.model.`` + the HF module path
PEFT_PREFIX = "base_model.model."
#: HF target -> (megatron linear within a layer, HF module within a layer, tp mode)
TARGET_LINEARS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "self_attn.q_proj", "column"),
    "k_proj": ("self_attention.linear_qkv", "self_attn.k_proj", "column"),
    "v_proj": ("self_attention.linear_qkv", "self_attn.v_proj", "column"),
    "o_proj": ("self_attention.linear_proj", "self_attn.o_proj", "row"),
    "gate_proj": ("mlp.linear_fc1", "mlp.gate_proj", "column"),
    "up_proj": ("mlp.linear_fc1", "mlp.up_proj", "column"),
    "down_proj": ("mlp.linear_fc2", "mlp.down_proj", "row"),
}
#: the HF parts of each fused linear, in the order megatron lays them out
_FUSED_PARTS = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
                "mlp.linear_fc1": ("gate_proj", "up_proj")}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    from parallel.model_config import config_value

    return config_value(cfg, key, default)


def _base_shapes(hf_config: Any, arch: HFArch) -> dict[str, tuple[int, int]]:
    """HF ``[out, in]`` of every target module."""
    hidden, inter = int(_get(hf_config, "hidden_size")), int(_get(hf_config, "intermediate_size"))
    nh = int(_get(hf_config, "num_attention_heads"))
    ng = int(_get(hf_config, "num_key_value_heads") or nh)
    hd = arch.head_dim
    return {"q_proj": (nh * hd, hidden), "k_proj": (ng * hd, hidden), "v_proj": (ng * hd, hidden),
            "o_proj": (hidden, nh * hd), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def lora_param_table(hf_config: Any, arch: HFArch, cfg: LoRAConfig) -> list[ParamMapping]:
    """One ``copy`` row per adapter tensor (global layer index, PEFT's HF name, tp split)."""
    shapes = _base_shapes(hf_config, arch)
    targets = [t for t in TARGET_LINEARS if t in cfg.target_modules]
    rows: list[ParamMapping] = []
    for i in range(int(_get(hf_config, "num_hidden_layers"))):
        for t in targets:
            linear, hf_module, mode = TARGET_LINEARS[t]
            out_f, in_f = shapes[t]
            hf = f"{PEFT_PREFIX}model.layers.{i}.{hf_module}"
            m = f"decoder.layers.{i}.{linear}"
            rows.append(ParamMapping(f"{m}.lora_A.{t}", (f"{hf}.lora_A.weight",), ((cfg.r, in_f),), "copy",
                                     1 if mode == "row" else None, i))
            rows.append(ParamMapping(f"{m}.lora_B.{t}", (f"{hf}.lora_B.weight",), ((out_f, cfg.r),), "copy",
                                     0 if mode == "column" else None, i))
    return rows


@dataclass
class _Switch:
    """Shared by every adapter of one model: ``enabled=False`` runs the base model."""

    enabled: bool = True


class _LinearAdapter:
    """Forward hook of one megatron linear: adds its parts' low-rank updates to the output."""

    def __init__(self, linear: torch.nn.Module, parts: list[str], mode: str, linear_name: str,
                 out_rows: dict[str, int], groups_local: int, cfg: LoRAConfig, tp_group: Any,
                 tp_size: int, sequence_parallel: bool, switch: _Switch) -> None:
        self.linear, self.parts, self.mode = linear, parts, mode
        self.fused = _FUSED_PARTS.get(linear_name)
        self.out_rows = out_rows  # local output rows of each HF part of the fused linear
        self.groups_local = groups_local
        self.scaling = cfg.scaling
        self.dropout = cfg.dropout
        self.tp_group, self.tp_size, self.sp = tp_group, tp_size, sequence_parallel
        self.switch = switch

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.switch.enabled:
            return output
        out, bias = output
        delta = self.delta(args[0] if args else kwargs["input_"])
        return out + delta.to(out.dtype), bias

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=True) if self.dropout and self.linear.training else x

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        A, B = self.linear.lora_A, self.linear.lora_B
        x = self._drop(x)
        if self.mode == "row":
            (p,) = self.parts
            h = F.linear(x, A[p].to(x.dtype))  # partial over tp: this rank's input columns
            if self.tp_size > 1:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sp
                     else mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
            return F.linear(h, B[p].to(x.dtype)) * self.scaling
        hs = [F.linear(x, A[p].to(x.dtype)) for p in self.parts]
        h = torch.cat(hs, -1) if len(hs) > 1 else hs[0]
        if self.tp_size > 1:
            h = (mappings.gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sp
                 else mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group))
        ys = {p: F.linear(hp, B[p].to(x.dtype)) * self.scaling
              for p, hp in zip(self.parts, h.split([A[p].shape[0] for p in self.parts], -1))}
        return self._fuse(ys, h)

    def _fuse(self, ys: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Each part's update in its rows of the fused output (zeros for untargeted parts)."""
        if self.fused is None:
            return ys[self.parts[0]]
        lead = like.shape[:-1]
        full = [ys[p] if p in ys else like.new_zeros((*lead, self.out_rows[p])) for p in self.fused]
        if self.fused[0] != "q_proj":  # fc1: [gate_r; up_r]
            return torch.cat(full, -1)
        g = self.groups_local  # qkv: [q_g; k_g; v_g] per local query group
        return torch.cat([t.reshape(*lead, g, -1) for t in full], -1).reshape(*lead, -1)


class LoRAModel:
    """The adapters of one model stage: their table, the on/off switch, merged weights."""

    def __init__(self, cfg: LoRAConfig, table: list[ParamMapping], switch: _Switch,
                 adapters: dict[str, _LinearAdapter]) -> None:
        self.cfg, self.table, self.switch, self.adapters = cfg, table, switch, adapters

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the base model (the KL reference: no second copy of the weights)."""
        prev = self.switch.enabled
        self.switch.enabled = False
        try:
            yield
        finally:
            self.switch.enabled = prev


def _init_full(cfg: LoRAConfig, shape: tuple[int, ...], which: str, seed: int, layer: int,
               part: str) -> torch.Tensor:
    """PEFT's init of the FULL tensor, from a generator of (seed, layer, part): every layout
    starts from identical adapters."""
    t = torch.empty(shape, dtype=torch.float32)
    if which == "B":
        return t.zero_()
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * 101 + list(TARGET_LINEARS).index(part)) % 2**63)
    if cfg.init == "gaussian":
        return t.normal_(0.0, 1.0 / cfg.r, generator=g)
    return torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)


def attach_lora(module: torch.nn.Module, cfg: LoRAConfig, hf_config: Any, arch: HFArch, groups: Any,
                seed: int) -> LoRAModel:
    """Add adapters (PEFT's init) to this stage's targeted linears and freeze everything else."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    config = module.config
    tp, tp_rank = groups.strategy.tp, groups.tp_rank
    sp = bool(config.sequence_parallel) and tp > 1
    table = lora_param_table(hf_config, arch, cfg)
    by_name = {e.mcore_name: e for e in table}
    shapes = _base_shapes(hf_config, arch)
    nh = int(_get(hf_config, "num_attention_heads"))
    ng = int(_get(hf_config, "num_key_value_heads") or nh)
    for p in module.parameters():
        p.requires_grad_(False)
    switch = _Switch()
    adapters: dict[str, _LinearAdapter] = {}
    device = next(module.parameters()).device
    for layer in module.decoder.layers:
        i = layer.layer_number - 1
        by_linear: dict[str, list[str]] = {}
        for t in TARGET_LINEARS:
            if t in cfg.target_modules:
                by_linear.setdefault(TARGET_LINEARS[t][0], []).append(t)
        for linear_name, parts in by_linear.items():
            linear = layer.get_submodule(linear_name)
            mode = TARGET_LINEARS[parts[0]][2]
            linear.lora_A = torch.nn.ParameterDict()
            linear.lora_B = torch.nn.ParameterDict()
            for part in parts:
                for which, store in (("A", linear.lora_A), ("B", linear.lora_B)):
                    e = by_name[f"decoder.layers.{i}.{linear_name}.lora_{which}.{part}"]
                    full = _init_full(cfg, e.hf_shapes[0], which, seed, i, part)
                    local = tp_shard(e, full, tp_rank, tp).to(device=device, dtype=config.params_dtype)
                    param = torch.nn.Parameter(local.contiguous(), requires_grad=True)
                    if e.tp_dim is not None:
                        set_tensor_model_parallel_attributes(param, True, e.tp_dim, 1)
                    elif sp:  # replicated factor that sees this rank's part of the sequence
                        param.sequence_parallel = True
                    store[part] = param
            out_rows = {p: shapes[p][0] // tp for p in _FUSED_PARTS.get(linear_name, parts)}
            adapter = _LinearAdapter(linear, parts, mode, linear_name, out_rows, ng // tp, cfg,
                                     groups.tp_group, tp, sp, switch)
            linear.register_forward_hook(adapter, with_kwargs=True)
            adapters[f"decoder.layers.{layer.layer_number - 1}.{linear_name}"] = adapter
    return LoRAModel(cfg, table, switch, adapters)


@torch.no_grad()
def merged_local_weight(adapter: _LinearAdapter, base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``W + (alpha / r) * B A`` of one linear in this rank's megatron layout (no communication:
    a column linear's rows need its B rows and the whole A, a row linear's columns its A columns)."""
    lin = adapter.linear
    w = (lin.weight if base is None else base).detach()
    A, B = lin.lora_A, lin.lora_B
    deltas = {p: (B[p].float() @ A[p].float()) * adapter.scaling for p in adapter.parts}
    if adapter.fused is None:
        return (w.float() + deltas[adapter.parts[0]]).to(w.dtype)
    cols = w.shape[1]
    full = [deltas.get(p, w.new_zeros((adapter.out_rows[p], cols), dtype=torch.float32)) for p in adapter.fused]
    if adapter.fused[0] == "q_proj":
        g = adapter.groups_local
        delta = torch.cat([t.reshape(g, -1, cols) for t in full], 1).reshape(-1, cols)
    else:
        delta = torch.cat(full, 0)
    return (w.float() + delta).to(w.dtype)
