"""Shard spec: which slices of each FULL megatron tensor every rank of a layout holds.

A layout (:class:`realflow.api.layout.Layout`) is a ``ParallelStrategy`` over global
ranks on megatron's grid (tp fastest, then dp, then pp; see :mod:`parallel.groups`).  For every rank the spec lists, per
parameter of its pipeline stage, a :class:`LocalShard`: the local name and shape
and the *pieces* it is made of.  A piece is an index interval ``[lo, hi)`` along
the shard's split dim in FULL-tensor coordinates (unpadded vocab rows), placed at
``local_lo`` in the local tensor.  Expressing every shard this way makes the
special cases uniform:

* plain tp split (qkv groups, row/column parallel linears): one piece;
* SwiGLU ``fc1``: each rank holds ``[gate_r; up_r]`` -> two pieces;
* vocab rows: megatron pads the vocab to a multiple of ``128 * tp``; padding rows
  are not covered by any piece (they hold zeros);
* replicated tensors (norms): one piece covering dim 0.

Why not reuse ``tp_shard`` directly: a reallocation plan must intersect the
slices of two different layouts WITHOUT touching tensors (and the padded vocab
size differs between tp degrees), so it needs the slices as data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from realflow.api.layout import Layout
from parallel.hf_io import ParamMapping, param_table
from parallel.model_config import hf_arch
from parallel.moe import local_expert_name, moe_layout_problem

__all__ = ["Piece", "LocalShard", "ShardSpecError", "shard_spec", "full_shape",
           "reference_shard", "allocate_shards"]


class ShardSpecError(ValueError):
    """A layout that cannot hold the model (indivisible heads, layers, ...)."""


@dataclass(frozen=True)
class Piece:
    """Full-tensor interval ``[lo, hi)`` along the split dim, stored at ``local_lo``."""

    lo: int
    hi: int
    local_lo: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class LocalShard:
    """One parameter as a rank holds it."""

    name: str  # full megatron name, GLOBAL layer index (ParamMapping.mcore_name)
    local_name: str  # name in this stage's module (local layer index, local spec names)
    local_shape: tuple[int, ...]
    dim: int  # split dim (0 for replicated tensors)
    pieces: tuple[Piece, ...]

    @property
    def padding(self) -> tuple[tuple[int, int], ...]:
        """Local intervals along ``dim`` not covered by a piece (vocab padding rows)."""
        out, pos = [], 0
        for p in sorted(self.pieces, key=lambda p: p.local_lo):
            if p.local_lo > pos:
                out.append((pos, p.local_lo))
            pos = p.local_lo + p.size
        if pos < self.local_shape[self.dim]:
            out.append((pos, self.local_shape[self.dim]))
        return tuple(out)


def full_shape(entry: ParamMapping) -> tuple[int, ...]:
    """Unpadded full megatron shape (real vocab rows only)."""
    return tuple(entry.mcore_shape)


def _cfg(hf_config: Any, key: str) -> Any:
    from parallel.model_config import config_value

    return config_value(hf_config, key)


def _tp_pieces(e: ParamMapping, tp: int, tp_rank: int, padded_vocab: int
               ) -> tuple[int, tuple[int, ...], tuple[Piece, ...]]:
    """(dim, local shape, pieces) of ``e`` on tensor-parallel rank ``tp_rank``."""
    shape = full_shape(e)
    if e.tp_dim is None:
        return 0, shape, (Piece(0, shape[0], 0),)
    dim = e.tp_dim
    if e.kind == "vocab":
        if padded_vocab % tp:
            raise ShardSpecError(f"{e.mcore_name}: padded vocab {padded_vocab} not divisible by tp={tp}")
        c = padded_vocab // tp
        lo, hi = tp_rank * c, min((tp_rank + 1) * c, shape[0])
        pieces = (Piece(lo, hi, 0),) if hi > lo else ()
        return dim, (c, *shape[1:]), pieces
    if e.kind == "gate_up":
        half = shape[0] // 2
        if half % tp:
            raise ShardSpecError(f"{e.mcore_name}: intermediate size {half} not divisible by tp={tp}")
        c = half // tp
        pieces = (Piece(tp_rank * c, (tp_rank + 1) * c, 0),
                  Piece(half + tp_rank * c, half + (tp_rank + 1) * c, c))
        return dim, (2 * c, *shape[1:]), pieces
    if shape[dim] % tp:
        raise ShardSpecError(f"{e.mcore_name}: dim {dim} of size {shape[dim]} not divisible by tp={tp}")
    c = shape[dim] // tp
    local = list(shape)
    local[dim] = c
    return dim, tuple(local), (Piece(tp_rank * c, (tp_rank + 1) * c, 0),)


def _check_layout(hf_config: Any, layout: Layout) -> int:
    s = layout.strategy
    layers = int(_cfg(hf_config, "num_hidden_layers"))
    if layers % s.pp:
        raise ShardSpecError(f"layout {layout}: {layers} layers do not split evenly into pp={s.pp} stages")
    heads = int(_cfg(hf_config, "num_attention_heads"))
    groups = int(_cfg(hf_config, "num_key_value_heads") or heads)
    if heads % s.tp or groups % s.tp:
        raise ShardSpecError(f"layout {layout}: {heads} heads / {groups} kv heads not divisible by tp={s.tp}")
    problem = moe_layout_problem(hf_config, s.dp, s.tp, s.ep)
    if problem:
        raise ShardSpecError(f"layout {layout}: {problem}")
    return layers // s.pp


def shard_spec(hf_config: Any, layout: Layout, table: Optional[list[ParamMapping]] = None
               ) -> dict[int, dict[str, LocalShard]]:
    """global rank -> {full name -> LocalShard} for every rank of ``layout``.

    Pipeline stage ``p`` holds layers ``[p*L/pp, (p+1)*L/pp)`` (megatron's uniform
    split); the first stage holds the embedding, the last the final norm and the
    LM head; with tied embeddings and pp > 1 the last stage holds the embedding
    copy as ``output_layer.weight`` (same full tensor, same pieces).
    """
    s = layout.strategy
    per_stage = _check_layout(hf_config, layout)
    arch = hf_arch(hf_config, tp_size=s.tp)
    table = param_table(hf_config, arch) if table is None else table
    out: dict[int, dict[str, LocalShard]] = {}
    experts = arch.moe.num_experts if arch.moe is not None else 0
    for rank in layout.workers:
        _, tp_rank, pp_rank = layout.coords(rank)
        ep_rank = layout.ep_coords(rank)[0]
        first, last = pp_rank == 0, pp_rank == s.pp - 1
        offset = pp_rank * per_stage
        shards: dict[str, LocalShard] = {}
        for e in table:
            name = e.mcore_name
            if e.layer is not None:
                if not offset <= e.layer < offset + per_stage:
                    continue
                local = name.replace(f"decoder.layers.{e.layer}.", f"decoder.layers.{e.layer - offset}.", 1)
                if e.expert is not None:  # held by one rank of each expert-parallel group
                    local = local_expert_name(local, e.expert, experts, s.ep, ep_rank)
                    if local is None:
                        continue
            elif name == "embedding.word_embeddings.weight":
                if first:
                    local = name
                elif last and arch.tie_word_embeddings:
                    local = "output_layer.weight"
                else:
                    continue
            elif name.startswith("visual."):  # the vision tower: with the embedding
                if not first:
                    continue
                local = name
            elif not last:  # final norm, untied LM head
                continue
            else:
                local = name
            tp = e.tp_in(s.tp, s.ep)
            dim, shape, pieces = _tp_pieces(e, tp, tp_rank if tp > 1 else 0, arch.padded_vocab_size)
            shards[name] = LocalShard(name, local, shape, dim, pieces)
        out[rank] = shards
    return out


def reference_shard(shard: LocalShard, full: torch.Tensor) -> torch.Tensor:
    """The local tensor of ``shard`` cut from the unpadded ``full`` tensor (padding = 0)."""
    out = full.new_zeros(shard.local_shape)
    for p in shard.pieces:
        out.narrow(shard.dim, p.local_lo, p.size).copy_(full.narrow(shard.dim, p.lo, p.size))
    return out


def allocate_shards(shards: dict[str, LocalShard], dtype: torch.dtype = torch.float32,
                    device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed local tensors (local name -> tensor) of one rank: a model without modules.

    Used by the benchmark (100M+ parameters without building megatron modules) and by
    callers that hold weights as plain tensors (a generation server's weight buffer).
    """
    return {s.local_name: torch.zeros(s.local_shape, dtype=dtype, device=device) for s in shards.values()}


def numel(shards: dict[str, LocalShard]) -> int:
    return sum(math.prod(s.local_shape) for s in shards.values())
