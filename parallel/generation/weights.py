"""Megatron-layout weights of ONE tensor-parallel rank, as the generation engine reads them.

Why megatron layout (not HF): the engine runs inside model workers on the same
tensors the trainer or the parameter reallocation writes, so a weight update is
an in-place write nobody has to convert.  :class:`DecoderWeights` keeps references
(``tensor.detach()`` shares storage) when built from a module's ``named_parameters()``;
on CPU it adds ``[in, out]`` copies of the linear weights for faster matmuls, which
``refresh()`` re-copies after an in-place write (the engine's ``weights_updated`` does).

Local layout (see :mod:`parallel.hf_io`): ``linear_qkv`` rows are per query group
``[q heads of the group; k; v]``, this rank holding ``ng / tp`` whole groups;
``linear_fc1`` is ``[gate_r; up_r]``; embedding / output rows are this rank's
slice of the padded vocab; ``linear_proj`` / ``linear_fc2`` hold input columns.
MoE layers (``spec.arch.moe``) have a router and experts instead of ``linear_fc1`` /
``linear_fc2``: :mod:`parallel.generation.moe`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from parallel.generation.moe import MoELayerWeights, moe_layer_shapes
from parallel.hf_io import (CheckpointError, hf_to_mcore, param_table, read_hf_tensors,
                            tp_shard)
from parallel.model_config import HFArch, _get, hf_arch

__all__ = ["ModelSpec", "LayerWeights", "DecoderWeights", "mcore_from_hf_tensors"]

# TransformerEngine-spec names of the norms fused into the following linear.
_TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}




@dataclass(frozen=True)
class ModelSpec:
    """Shapes of the decoder, global and for this tp rank."""

    arch: HFArch
    num_layers: int
    hidden: int
    num_heads: int
    num_groups: int
    head_dim: int
    ffn: int
    eps: float
    tp_rank: int
    tp_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf_config: Any, tp_rank: int = 0, tp_size: int = 1) -> "ModelSpec":
        arch = hf_arch(hf_config, tp_size=tp_size)
        nh = int(_get(hf_config, "num_attention_heads"))
        ng = int(_get(hf_config, "num_key_value_heads", None) or nh)
        ffn = int(_get(hf_config, "intermediate_size"))
        checks = [("num_key_value_heads", ng), ("intermediate_size", ffn)]
        if arch.moe is not None:
            checks.append(("moe_intermediate_size", arch.moe.ffn))
        for name, v in checks:
            if v % tp_size:
                raise ValueError(f"{name}={v} is not divisible by tp_size={tp_size}")
        eos = _get(hf_config, "eos_token_id", None)
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                        if e is not None and 0 <= int(e) < arch.vocab_size)
        return cls(arch=arch, num_layers=int(_get(hf_config, "num_hidden_layers")),
                   hidden=int(_get(hf_config, "hidden_size")), num_heads=nh, num_groups=ng,
                   head_dim=arch.head_dim, ffn=ffn,
                   eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
                   tp_rank=tp_rank, tp_size=tp_size, eos_token_ids=eos_ids)

    @property
    def local_groups(self) -> int:
        return self.num_groups // self.tp_size

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_vocab(self) -> int:
        return self.arch.padded_vocab_size // self.tp_size


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    proj_w: torch.Tensor
    ln2: torch.Tensor
    fc1_w: Optional[torch.Tensor] = None  # dense MLP (None in an MoE layer)
    fc2_w: Optional[torch.Tensor] = None
    # [in, out] contiguous copies of the linear weights (CPU only, see DecoderWeights)
    qkv_t: Optional[torch.Tensor] = None
    proj_t: Optional[torch.Tensor] = None
    fc1_t: Optional[torch.Tensor] = None
    fc2_t: Optional[torch.Tensor] = None
    moe: Optional[MoELayerWeights] = None  # router and experts of an MoE layer

    def linears(self) -> list[tuple[str, str]]:
        pairs = [("qkv_w", "qkv_t"), ("proj_w", "proj_t"), ("fc1_w", "fc1_t"), ("fc2_w", "fc2_t")]
        return [(w, t) for w, t in pairs if getattr(self, w) is not None]


def _layer_names(i: int, spec: ModelSpec) -> dict[str, Optional[str]]:
    p = f"decoder.layers.{i}."
    dense = spec.arch.moe is None
    return {
        "ln1": p + "input_layernorm.weight",
        "qkv_w": p + "self_attention.linear_qkv.weight",
        "qkv_b": p + "self_attention.linear_qkv.bias" if spec.arch.qkv_bias else None,
        "q_norm": p + "self_attention.q_layernorm.weight" if spec.arch.qk_norm else None,
        "k_norm": p + "self_attention.k_layernorm.weight" if spec.arch.qk_norm else None,
        "proj_w": p + "self_attention.linear_proj.weight",
        "ln2": p + "pre_mlp_layernorm.weight",
        "fc1_w": p + "mlp.linear_fc1.weight" if dense else None,
        "fc2_w": p + "mlp.linear_fc2.weight" if dense else None,
    }


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Local (this tp rank) shape of every megatron parameter the engine reads."""
    h, hd, ng, nh = spec.hidden, spec.head_dim, spec.local_groups, spec.local_heads
    qkv_rows = (nh + 2 * ng) * hd
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (spec.local_vocab, h),
                                       "decoder.final_layernorm.weight": (h,)}
    if not spec.arch.tie_word_embeddings:
        out["output_layer.weight"] = (spec.local_vocab, h)
    shapes = {"ln1": (h,), "qkv_w": (qkv_rows, h), "qkv_b": (qkv_rows,), "q_norm": (hd,),
              "k_norm": (hd,), "proj_w": (h, nh * hd), "ln2": (h,),
              "fc1_w": (2 * spec.ffn // spec.tp_size, h), "fc2_w": (h, spec.ffn // spec.tp_size)}
    moe = spec.arch.moe
    for i in range(spec.num_layers):
        for key, name in _layer_names(i, spec).items():
            if name is not None:
                out[name] = shapes[key]
        if moe is not None:
            out.update(moe_layer_shapes(i, moe.num_experts, h, moe.ffn, spec.tp_size))
    return out


class DecoderWeights:
    """References to this rank's decoder tensors, validated once against :class:`ModelSpec`."""

    def __init__(self, spec: ModelSpec, named: Mapping[str, torch.Tensor]) -> None:
        self.spec = spec
        named = dict(named)
        for i in range(spec.num_layers):  # accept TE-spec norm names too
            for local, te in _TE_ALIASES.items():
                name = f"decoder.layers.{i}.{local}"
                alt = f"decoder.layers.{i}.{te}"
                if name not in named and alt in named:
                    named[name] = named[alt]
        if "embedding.word_embeddings.weight" not in named and "output_layer.weight" in named \
                and spec.arch.tie_word_embeddings:
            named["embedding.word_embeddings.weight"] = named["output_layer.weight"]
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shape in _expected_shapes(spec).items():
            if name not in named:
                raise CheckpointError(f"generation weights: megatron parameter {name} is missing "
                                      f"(pp must be 1: the engine needs every layer)")
            t = named[name]
            if tuple(t.shape) != shape:
                raise CheckpointError(f"generation weights: {name} has shape {list(t.shape)}, "
                                      f"tp rank {spec.tp_rank}/{spec.tp_size} expects {list(shape)}")
            self.tensors[name] = t.detach()
        self.embedding = self.tensors["embedding.word_embeddings.weight"]
        self.output = self.tensors.get("output_layer.weight", self.embedding)
        self.final_norm = self.tensors["decoder.final_layernorm.weight"]
        self.layers = [LayerWeights(**{k: (self.tensors[n] if n else None)
                                       for k, n in _layer_names(i, spec).items()})
                       for i in range(spec.num_layers)]
        self.dtype = self.embedding.dtype
        self.device = self.embedding.device
        if spec.arch.moe is not None:
            for i, layer in enumerate(self.layers):
                layer.moe = MoELayerWeights.build(self.tensors, i, spec.arch.moe.num_experts,
                                                  transposed=self.device.type == "cpu")
        self.output_t: Optional[torch.Tensor] = None
        if self.device.type == "cpu":
            self._make_transposed()

    # ---------------------------------------------------------------- CPU matmul layout

    def _make_transposed(self) -> None:
        """Keep ``[in, out]`` contiguous copies of every linear weight.

        Why: on CPU, ``x @ W_t`` with a contiguous ``W_t`` runs 25-35% faster
        than ``F.linear(x, W)`` at decode shapes (one thread, measured for every
        linear of the tiny model) and gives the same result.  The copies cost
        the linear weights' memory once more, and must follow every in-place
        write: :meth:`refresh` (called by the engine's weight-update paths).
        """
        for layer in self.layers:
            for w_name, t_name in layer.linears():
                setattr(layer, t_name, getattr(layer, w_name).t().contiguous())
        self.output_t = self.output.t().contiguous()

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-copy the transposed weights (and MoE routers) from the (possibly shared) originals."""
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.refresh()
        if self.output_t is None:
            return
        for layer in self.layers:
            for w_name, t_name in layer.linears():
                getattr(layer, t_name).copy_(getattr(layer, w_name).t())
        self.output_t.copy_(self.output.t())

    # ---------------------------------------------------------------- updates

    def check_update(self, local: Mapping[str, torch.Tensor]) -> None:
        """Validate a (partial) update of megatron-named local tensors before writing any."""
        for name, t in local.items():
            if name not in self.tensors:
                raise CheckpointError(f"weight update: unknown megatron parameter {name!r}")
            if tuple(t.shape) != tuple(self.tensors[name].shape):
                raise CheckpointError(f"weight update: {name} has shape {list(t.shape)}, "
                                      f"expected {list(self.tensors[name].shape)}")

    @torch.no_grad()
    def copy_(self, local: Mapping[str, torch.Tensor]) -> None:
        """In-place copy (the tensors may be shared with a training module); the
        caller then calls :meth:`refresh` (the engine's ``weights_updated`` does)."""
        self.check_update(local)
        for name, t in local.items():
            dst = self.tensors[name]
            if t.data_ptr() != dst.data_ptr():
                dst.copy_(t)


def mcore_from_hf_tensors(spec: ModelSpec, hf_config: Any, hf: Mapping[str, torch.Tensor],
                          partial: bool = False) -> dict[str, torch.Tensor]:
    """This tp rank's megatron-named tensors from HF-named full tensors.

    ``partial=True`` converts only the entries whose HF tensors are all present
    (a fused entry with some but not all of its HF tensors is an error naming
    the missing ones); otherwise every entry is required.  Shapes are checked.
    """
    table = param_table(hf_config, spec.arch, vision=False)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for e in table:
        have = [n in hf for n in e.hf_names]
        if not any(have) and partial:
            continue
        if not all(have):
            missing = [n for n, h in zip(e.hf_names, have) if not h]
            raise CheckpointError(f"HF tensor(s) {missing} missing (needed for megatron "
                                  f"{e.mcore_name})")
        for n, want in zip(e.hf_names, e.hf_shapes):
            if tuple(hf[n].shape) != tuple(want):
                raise CheckpointError(f"HF tensor {n} has shape {list(hf[n].shape)}, "
                                      f"expected {list(want)}")
            used.add(n)
        full = hf_to_mcore(e, [hf[n] for n in e.hf_names], spec.arch.padded_vocab_size,
                           spec.num_groups)
        out[e.mcore_name] = tp_shard(e, full, spec.tp_rank, spec.tp_size)
    unknown = sorted(set(hf) - used)
    if unknown and partial:
        raise CheckpointError(f"weight update: unknown HF tensor name(s) {unknown[:5]}")
    return out


def load_hf_weights(path: str, hf_config: Any, spec: ModelSpec,
                    dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """This rank's megatron-named tensors (fresh, contiguous) from an HF checkpoint dir."""
    check_same_architecture(path, hf_config)
    table = param_table(hf_config, spec.arch, vision=False)
    names = [n for e in table for n in e.hf_names]
    from safetensors import SafetensorError

    try:
        hf = read_hf_tensors(path, names)
    except KeyError as e:
        raise CheckpointError(f"tensor {e.args[0]} missing from checkpoint {path}") from None
    except SafetensorError as e:  # truncated or corrupt file
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt?): {e}") from None
    local = mcore_from_hf_tensors(spec, hf_config, hf)
    return {k: v.to(dtype or v.dtype).contiguous().clone() for k, v in local.items()}


_ARCH_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size")


def check_same_architecture(path: str, hf_config: Any) -> None:
    """A checkpoint's config.json must parse and describe the model being served: weights of
    another shape would fail half-way through a copy, or worse, load into the wrong slots."""
    import json
    import os

    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no config.json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    ours = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    diff = [f"{k}={cfg.get(k)!r} (served: {ours.get(k)!r})" for k in _ARCH_FIELDS
            if k in ours and cfg.get(k, ours.get(k)) != ours.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} is another architecture: {', '.join(diff)}")
