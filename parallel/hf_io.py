"""HF safetensors checkpoints <-> megatron GPTModel parameters.

The mapping is a TABLE (:func:`param_table`): one :class:`ParamMapping` per
megatron parameter of the FULL (unsharded, all-layers) model, saying which HF
tensors it is made of, how they are fused (``kind``), which dim tensor
parallelism splits, and which global layer it belongs to.  Everything else
(loading, saving, later per-tp/pp-rank slicing and reallocation) is driven by
the table:

* ``kind="copy"``    one HF tensor, same layout;
* ``kind="vocab"``   embedding / LM head: megatron pads rows to ``padded_vocab_size``;
* ``kind="qkv"``     q, k, v fused per query group: for each of the ``ng`` groups
  ``[q heads of the group; k; v]`` (weights and biases);
* ``kind="gate_up"`` SwiGLU fc1 ``[gate; up]``.  Under tp each rank holds
  ``[gate_r; up_r]``, so :func:`tp_shard` splits each half separately.

Loading validates every tensor (present, right shape) from the safetensors
headers BEFORE copying anything, so a bad checkpoint never half-loads, and reads
only this rank's tp slices (:mod:`parallel.hf_layout`, which also gathers any
layout back into one HF checkpoint).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import torch

from parallel.model_config import HFArch

__all__ = [
    "ParamMapping",
    "CheckpointError",
    "param_table",
    "hf_to_mcore",
    "mcore_to_hf",
    "tp_shard",
    "tp_unshard",
    "local_param_table",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "gather_hf_state",
    "read_hf_tensors",
    "vision_rows",
]

# TransformerEngine spec fuses the pre-attention / pre-MLP norms into the next linear.
_TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_NOT_TOKENIZER = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.index\.json)$|^config\.json$|^adapter_config\.json$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model (missing tensor, wrong shape...)."""


@dataclass(frozen=True)
class ParamMapping:
    """How one megatron parameter (full, unsharded) is made from HF tensors."""

    mcore_name: str  # local-spec name with the GLOBAL layer index
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str  # copy | vocab | qkv | gate_up
    tp_dim: Optional[int]  # dim split across tp ranks; None = replicated
    layer: Optional[int] = None  # global layer index; None = embedding/final norm/head
    expert: Optional[int] = None  # global expert index (MoE expert weights); None = not an expert

    def tp_in(self, tp: int, ep: int = 1) -> int:
        """The tensor-parallel degree this tensor is split by in a layout with ``tp`` and ``ep``:
        an expert's weights are whole on their rank once experts are sharded (``ep > 1``)."""
        return 1 if self.expert is not None and ep > 1 else tp

    @property
    def mcore_shape(self) -> tuple[int, ...]:
        """Shape of the full megatron tensor, before vocab padding (see hf_to_mcore)."""
        if self.kind in ("qkv", "gate_up"):
            rows = sum(s[0] for s in self.hf_shapes)
            return (rows, *self.hf_shapes[0][1:])
        return self.hf_shapes[0]


def param_table(hf_config: Any, arch: HFArch, *, vision: bool = True) -> list[ParamMapping]:
    """Mapping table for the whole model (global layer indices, tp = 1 shapes); ``vision=False``
    leaves a VL model's tower out (the generation engine keeps the tower as its own module)."""
    from parallel.model_config import _get

    def g(k: str, d: Any = None) -> Any:
        return _get(hf_config, k, d)
    hidden, inter = int(g("hidden_size")), int(g("intermediate_size"))
    nh = int(g("num_attention_heads"))
    ng = int(g("num_key_value_heads") or nh)
    hd = arch.head_dim
    table: list[ParamMapping] = [
        ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                     ((arch.vocab_size, hidden),), "vocab", 0)
    ]
    for i in range(int(g("num_hidden_layers"))):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        att = h + "self_attn."

        def row(mname, hnames, shapes, kind="copy", tp_dim=None, _i=i):
            table.append(ParamMapping(m + mname, tuple(hnames), tuple(shapes), kind, tp_dim, _i))

        row("input_layernorm.weight", [h + "input_layernorm.weight"], [(hidden,)])
        row("self_attention.linear_qkv.weight",
            [att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"],
            [(nh * hd, hidden), (ng * hd, hidden), (ng * hd, hidden)], "qkv", 0)
        if arch.qkv_bias:
            row("self_attention.linear_qkv.bias",
                [att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"],
                [(nh * hd,), (ng * hd,), (ng * hd,)], "qkv", 0)
        if arch.qk_norm:
            row("self_attention.q_layernorm.weight", [att + "q_norm.weight"], [(hd,)])
            row("self_attention.k_layernorm.weight", [att + "k_norm.weight"], [(hd,)])
        row("self_attention.linear_proj.weight", [att + "o_proj.weight"], [(hidden, nh * hd)],
            tp_dim=1)
        row("pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], [(hidden,)])
        if arch.moe is not None:
            table.extend(moe_rows(arch, hidden, i))
            continue
        row("mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"],
            [(inter, hidden), (inter, hidden)], "gate_up", 0)
        row("mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"], [(hidden, inter)], tp_dim=1)
    table.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",),
                              ((hidden,),), "copy", None))
    if not arch.tie_word_embeddings:
        table.append(ParamMapping("output_layer.weight", ("lm_head.weight",),
                                  ((arch.vocab_size, hidden),), "vocab", 0))
    if arch.vision is not None and vision:
        table.extend(vision_rows(hf_config))
    return table


def vision_rows(hf_config: Any) -> list[ParamMapping]:
    """The vision tower's parameters: replicated (no tp split), held by the first pipeline stage,
    under HF's own names (``visual.*``: the tower is transformers' module, see parallel/vision.py)."""
    from parallel.vision import VISION_PREFIX, build_vision_tower

    with torch.device("meta"):
        tower = build_vision_tower(hf_config)
    return [ParamMapping(VISION_PREFIX + n, (VISION_PREFIX + n,), (tuple(p.shape),), "copy", None)
            for n, p in tower.named_parameters()]


def moe_rows(arch: HFArch, hidden: int, layer: int) -> list[ParamMapping]:
    """Router and experts of one MoE layer (HF's per-expert checkpoint names, which
    ``save_pretrained`` writes; megatron's SequentialMLP, named by GLOBAL expert index)."""
    m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    moe = arch.moe
    rows = [ParamMapping(m + "router.weight", (h + "gate.weight",), ((moe.num_experts, hidden),),
                         "copy", None, layer)]
    for j in range(moe.num_experts):
        x, hx = f"{m}experts.local_experts.{j}.", f"{h}experts.{j}."
        rows.append(ParamMapping(x + "linear_fc1.weight", (hx + "gate_proj.weight", hx + "up_proj.weight"),
                                 ((moe.ffn, hidden), (moe.ffn, hidden)), "gate_up", 0, layer, j))
        rows.append(ParamMapping(x + "linear_fc2.weight", (hx + "down_proj.weight",),
                                 ((hidden, moe.ffn),), "copy", 1, layer, j))
    return rows


def hf_to_mcore(entry: ParamMapping, tensors: list[torch.Tensor], padded_vocab: int,
                num_query_groups: int) -> torch.Tensor:
    """Full megatron tensor from the entry's HF tensors."""
    if entry.kind == "copy":
        return tensors[0]
    if entry.kind == "vocab":
        t = tensors[0]
        if padded_vocab == t.shape[0]:
            return t
        pad = t.new_zeros((padded_vocab - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad], 0)
    if entry.kind == "gate_up":
        return torch.cat(tensors, 0)
    if entry.kind == "qkv":
        q, k, v = tensors
        ng = num_query_groups
        rest = q.shape[1:]
        parts = [q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)]
        return torch.cat(parts, 1).reshape(-1, *rest)
    raise AssertionError(entry.kind)


def mcore_to_hf(entry: ParamMapping, tensor: torch.Tensor,
                num_query_groups: int) -> dict[str, torch.Tensor]:
    """HF tensors (name -> tensor) from the full megatron tensor; inverse of hf_to_mcore."""
    if entry.kind == "copy":
        return {entry.hf_names[0]: tensor}
    if entry.kind == "vocab":
        return {entry.hf_names[0]: tensor[: entry.hf_shapes[0][0]]}
    if entry.kind == "gate_up":
        gate, up = tensor.split([s[0] for s in entry.hf_shapes], 0)
        return {entry.hf_names[0]: gate, entry.hf_names[1]: up}
    if entry.kind == "qkv":
        ng = num_query_groups
        rest = tensor.shape[1:]
        per_group = [s[0] // ng for s in entry.hf_shapes]
        q, k, v = tensor.reshape(ng, -1, *rest).split(per_group, 1)
        return {n: t.reshape(-1, *rest) for n, t in zip(entry.hf_names, (q, k, v))}
    raise AssertionError(entry.kind)


def tp_shard(entry: ParamMapping, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tp rank's slice of a full megatron tensor (megatron's layout)."""
    if entry.tp_dim is None or tp_size == 1:
        return full
    if entry.kind == "gate_up":  # [gate; up] -> [gate_r; up_r]
        halves = full.chunk(2, 0)
        return torch.cat([h.chunk(tp_size, 0)[tp_rank] for h in halves], 0)
    # qkv is grouped ([q_g; k_g; v_g] per group), so contiguous chunks = whole groups.
    return full.chunk(tp_size, entry.tp_dim)[tp_rank]


def tp_unshard(entry: ParamMapping, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all tp ranks' slices (in tp-rank order)."""
    if entry.tp_dim is None or len(shards) == 1:
        return shards[0]
    if entry.kind == "gate_up":
        pairs = [s.chunk(2, 0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], 0)
    return torch.cat(shards, entry.tp_dim)


def _named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())


def local_param_table(model: torch.nn.Module, table: list[ParamMapping]
                      ) -> list[tuple[ParamMapping, str]]:
    """Entries held by this pipeline stage, paired with the model's local param name.

    Megatron names layers by their index within the stage; ``layer_number`` (1-based,
    global) gives the offset.  TE-spec norm names are resolved too.  With pp > 1 and
    tied embeddings the last stage's ``output_layer.weight`` is the embedding copy.
    """
    from parallel.moe import expert_parallel_of, local_expert_name

    params = _named_params(model)
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    offset = layers[0].layer_number - 1 if len(layers) else 0
    n_local = len(layers)
    ep, ep_rank = expert_parallel_of(model)
    experts = 1 + max((e.expert for e in table if e.expert is not None), default=0)
    out: list[tuple[ParamMapping, str]] = []
    for e in table:
        name = e.mcore_name
        if e.layer is not None:
            if not offset <= e.layer < offset + n_local:
                continue
            name = name.replace(f"decoder.layers.{e.layer}.", f"decoder.layers.{e.layer - offset}.", 1)
            if e.expert is not None:  # experts of another expert-parallel rank are not here
                name = local_expert_name(name, e.expert, experts, ep, ep_rank)
                if name is None:
                    continue
            if name not in params:
                for local, te in _TE_ALIASES.items():
                    if name.endswith(local):
                        name = name[: -len(local)] + te
        if name == "embedding.word_embeddings.weight" and name not in params \
                and "output_layer.weight" in params:
            name = "output_layer.weight"  # tied LM head on a stage without the embedding
        if name in params:
            out.append((e, name))
    return out


# --------------------------------------------------------------------------- load


def _weight_index(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file (single file or sharded index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}
    raise CheckpointError(f"no {' or '.join(_WEIGHT_FILES)} in {path}")


def _header_shapes(files: set[str]) -> dict[tuple[str, str], tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for fn in files:
        if not os.path.isfile(fn):
            raise CheckpointError(f"checkpoint shard {fn} listed in the index is missing")
        with safe_open(fn, "pt") as f:
            for k in f.keys():
                shapes[(fn, k)] = tuple(f.get_slice(k).get_shape())
    return shapes


def read_hf_tensors(path: str, names: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """All (or the named) tensors of an HF safetensors checkpoint directory."""
    from safetensors import safe_open

    index = _weight_index(path)
    names = list(index) if names is None else names
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n], []).append(n)
    out = {}
    for fn, ns in by_file.items():
        with safe_open(fn, "pt") as f:
            for n in ns:
                out[n] = f.get_tensor(n)
    return out


def _local_shape(e: ParamMapping, padded_vocab: int, tp_rank: int, tp_size: int) -> tuple:
    full = e.mcore_shape if e.kind != "vocab" else (padded_vocab, *e.mcore_shape[1:])
    return tuple(tp_shard(e, torch.empty(full, device="meta"), tp_rank, tp_size).shape)


def load_hf_checkpoint(model: torch.nn.Module, path: str, hf_config: Any, arch: HFArch,
                       tp_rank: int = 0, tp_size: int = 1, critic: bool = False) -> None:
    """Copy an HF checkpoint into this rank's megatron model (in place, exact).

    Reads only this rank's tp slices of this stage's tensors.  Raises
    :class:`CheckpointError` (one line, naming tensor and file) before touching
    any parameter if a tensor is missing or has the wrong shape.  See
    :mod:`parallel.hf_layout` (and ``critic``: value-head checkpoints).
    """
    from parallel.hf_layout import execute_hf_load, plan_hf_load

    plan = plan_hf_load(model, path, hf_config, arch, tp_rank, tp_size, critic)
    execute_hf_load(model, plan, hf_config, arch, tp_rank, tp_size)


# --------------------------------------------------------------------------- save


def gather_hf_state(model: torch.nn.Module, hf_config: Any, arch: HFArch,
                    dtype: Optional[torch.dtype] = None, critic: bool = False
                    ) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of this rank's (tp = 1) model part."""
    if critic:
        from parallel.hf_layout import model_param_table

        table = model_param_table(hf_config, arch, critic=True)
    else:
        table = param_table(hf_config, arch)
    from parallel.model_config import _get

    ng = int(_get(hf_config, "num_key_value_heads", None) or _get(hf_config, "num_attention_heads"))
    params = _named_params(model)
    out: dict[str, torch.Tensor] = {}
    for e, pname in local_param_table(model, table):
        t = params[pname].detach()
        for n, v in mcore_to_hf(e, t, ng).items():
            out[n] = v.to(device="cpu", dtype=dtype or v.dtype).contiguous().clone()
    return out


def _config_dtype(hf_config: Any) -> Optional[torch.dtype]:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def save_hf_checkpoint(path: str, state: dict[str, torch.Tensor], hf_config: Any,
                       tokenizer_dir: Optional[str] = None,
                       dtype: Optional[torch.dtype] = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) to ``path``.

    ``dtype`` defaults to the HF config's dtype (so a bf16 checkpoint stays bf16),
    else the tensors' own dtype.
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    dtype = dtype or _config_dtype(hf_config)
    tensors = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in sorted(state.items())}
    tmp = os.path.join(path, ".model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    stale = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(stale):
        os.remove(stale)
    if hasattr(hf_config, "save_pretrained"):
        hf_config.save_pretrained(path)
    else:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(hf_config), f, indent=2)
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, path)


def copy_tokenizer_files(tokenizer_dir: str, path: str) -> None:
    """Copy the tokenizer's files (not weights, configs or adapters) from ``tokenizer_dir`` to ``path``."""
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory")
    for fn in sorted(os.listdir(tokenizer_dir)):
        src = os.path.join(tokenizer_dir, fn)
        if os.path.isfile(src) and not _NOT_TOKENIZER.search(fn):
            shutil.copyfile(src, os.path.join(path, fn))

