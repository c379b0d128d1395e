"""Reallocation plan: which source rank sends which slice to which destination rank.

Pure data, computed identically (and cheaply) on every rank from the two layouts,
the model config and the host of each rank; nothing is communicated.  For every
destination shard piece we cut the full-tensor interval at the source shards'
boundaries and pick, for each cut, one source among those holding it (dp
replicas, and with tied embeddings both the first and the last pipeline stage):

1. the destination rank itself (a local copy, no transfer),
2. else a rank on the same host (shared memory),
3. else any (point-to-point),

breaking ties by the bytes already assigned to each candidate (least loaded
first), then by rank.  So the load spreads over all data-parallel replicas
instead of funnelling through replica 0, and the result is deterministic.
Adjacent cuts that come from the same source and are contiguous on both sides are
merged back into one :class:`Copy`.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from realflow.api.layout import Layout
from parallel.hf_io import param_table
from parallel.model_config import hf_arch
from parallel.realloc.spec import LocalShard, shard_spec

__all__ = ["Copy", "ReallocPlan", "ReallocError", "plan_reallocation", "LOCAL", "SHM", "P2P"]

LOCAL, SHM, P2P = "local", "shm", "p2p"


class ReallocError(RuntimeError):
    """Reallocation cannot run (incompatible models, missing ranks, ...); names the culprit."""


@dataclass(frozen=True)
class Copy:
    """``dst.local[name].narrow(dim, dst_lo, n) <- src.local[name].narrow(dim, src_lo, n)``."""

    src: int
    dst: int
    name: str  # full megatron name (global layer index)
    dim: int
    src_lo: int
    dst_lo: int
    n: int
    path: str  # local | shm | p2p


@dataclass
class ReallocPlan:
    """Everything an executor needs; identical on every rank (see ``fingerprint``)."""

    src: Layout
    dst: Layout
    src_shards: dict[int, dict[str, LocalShard]]
    dst_shards: dict[int, dict[str, LocalShard]]
    copies: list[Copy]
    hosts: dict[int, str]
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    table: list = field(default_factory=list)  # ParamMapping rows (binds nn.Module params by name)
    fingerprint: str = ""
    members: tuple[int, ...] = field(default=())  # sorted S u T

    def bytes_by_path(self) -> dict[str, int]:
        out = {LOCAL: 0, SHM: 0, P2P: 0}
        for c in self.copies:
            out[c.path] += self.copy_bytes(c)
        return out

    def copy_bytes(self, c: Copy) -> int:
        shape = self.src_shards[c.src][c.name].local_shape
        return c.n * (math.prod(shape) // shape[c.dim]) * self.src_dtype.itemsize


def _table_signature(hf_config: Any) -> list[tuple]:
    arch = hf_arch(hf_config, tp_size=1)
    return [(e.mcore_name, e.kind, e.tp_dim, tuple(e.mcore_shape)) for e in param_table(hf_config, arch)] + [
        ("tie_word_embeddings", arch.tie_word_embeddings)]


def _full_table(hf_config: Any, lora: Any) -> list:
    """The model's rows, plus its LoRA adapters' when it trains them."""
    arch = hf_arch(hf_config, tp_size=1)
    table = param_table(hf_config, arch)
    if lora is not None and getattr(lora, "enabled", False):
        from parallel.lora import lora_param_table

        table = table + lora_param_table(hf_config, arch, lora)
    return table


def _check_compatible(src_cfg: Any, dst_cfg: Any) -> None:
    a, b = _table_signature(src_cfg), _table_signature(dst_cfg)
    for x, y in zip(a, b):
        if x != y:
            raise ReallocError(f"incompatible models: source has {x}, destination has {y}")
    if len(a) != len(b):
        extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
        raise ReallocError(f"incompatible models: {len(a)} vs {len(b)} parameters (first extra: {extra})")


def plan_reallocation(
    hf_config: Any,
    src: Layout,
    dst: Layout,
    dtype: torch.dtype = torch.float32,
    *,
    dst_dtype: Optional[torch.dtype] = None,
    dst_hf_config: Any = None,
    hosts: Optional[Sequence[str] | dict[int, str]] = None,
    lora: Any = None,
) -> ReallocPlan:
    """Plan moving a model from layout ``src`` to layout ``dst`` (pure; same result on every rank).

    ``dtype`` is the source parameters' dtype, ``dst_dtype`` the destination's (default:
    the same; a different one casts on arrival).  ``dst_hf_config`` (default: the same
    config) must describe the same parameter table, else :class:`ReallocError`.
    ``hosts`` maps global rank -> host name (list indexed by rank, or dict; from
    :func:`parallel.realloc.sync.gather_hosts`); None means one host.  ``lora`` (an enabled
    :class:`realflow.api.model_options.LoRAConfig`): the adapters move too, as table rows.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise TypeError(f"plan_reallocation: src/dst must be Layout, got {type(src).__name__}/"
                        f"{type(dst).__name__}")
    dst_dtype = dtype if dst_dtype is None else dst_dtype
    for d in (dtype, dst_dtype):
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise ReallocError(f"plan_reallocation: dtype {d!r} is not a floating torch.dtype")
    if dst_hf_config is not None:
        _check_compatible(hf_config, dst_hf_config)
    members = tuple(sorted(set(src.workers) | set(dst.workers)))
    if hosts is None:
        host_map = {r: "localhost" for r in members}
    elif isinstance(hosts, dict):
        host_map = {int(r): str(h) for r, h in hosts.items()}
    else:
        host_map = {r: str(h) for r, h in enumerate(hosts)}
    missing = [r for r in members if r not in host_map]
    if missing:
        raise ReallocError(f"plan_reallocation: no host known for ranks {missing}")
    table = _full_table(hf_config, lora)
    src_shards = shard_spec(hf_config, src, table)
    dst_shards = shard_spec(dst_hf_config if dst_hf_config is not None else hf_config, dst, table)

    holders: dict[str, list[tuple[int, LocalShard]]] = defaultdict(list)
    for r in src.workers:
        for name, sh in src_shards[r].items():
            holders[name].append((r, sh))
    load: dict[int, int] = defaultdict(int)
    copies: list[Copy] = []
    for d in dst.workers:
        for name, dsh in dst_shards[d].items():
            if name not in holders:
                raise ReallocError(f"plan: no source rank holds {name}")
            row_bytes = math.prod(dsh.local_shape) // dsh.local_shape[dsh.dim] * dtype.itemsize
            for piece in dsh.pieces:
                cuts = {piece.lo, piece.hi}
                for _, ssh in holders[name]:
                    for sp in ssh.pieces:
                        cuts.update(x for x in (sp.lo, sp.hi) if piece.lo < x < piece.hi)
                bounds = sorted(cuts)
                for a, b in zip(bounds, bounds[1:]):
                    cands = [(r, sp) for r, ssh in holders[name] for sp in ssh.pieces if sp.lo <= a and b <= sp.hi]
                    if not cands:
                        raise ReallocError(f"plan: rows [{a}, {b}) of {name} are held by no source rank")
                    r, sp = min(cands, key=lambda c: (c[0] != d, host_map[c[0]] != host_map[d], load[c[0]], c[0]))
                    load[r] += (b - a) * row_bytes
                    path = LOCAL if r == d else SHM if host_map[r] == host_map[d] else P2P
                    copies.append(Copy(r, d, name, dsh.dim, sp.local_lo + a - sp.lo,
                                       piece.local_lo + a - piece.lo, b - a, path))
    copies = _merge(copies)
    plan = ReallocPlan(src, dst, src_shards, dst_shards, copies, {r: host_map[r] for r in members},
                       dtype, dst_dtype, table=table,
                       members=members)
    plan.fingerprint = _fingerprint(plan)
    return plan


def _merge(copies: list[Copy]) -> list[Copy]:
    out: list[Copy] = []
    for c in copies:
        p = out[-1] if out else None
        if (p is not None and (p.src, p.dst, p.name, p.dim, p.path) == (c.src, c.dst, c.name, c.dim, c.path)
                and p.src_lo + p.n == c.src_lo and p.dst_lo + p.n == c.dst_lo):
            out[-1] = Copy(p.src, p.dst, p.name, p.dim, p.src_lo, p.dst_lo, p.n + c.n, p.path)
        else:
            out.append(c)
    return out


def _fingerprint(plan: ReallocPlan) -> str:
    doc = {
        "src": [list(plan.src.workers), str(plan.src.strategy)],
        "dst": [list(plan.dst.workers), str(plan.dst.strategy)],
        "dtypes": [str(plan.src_dtype), str(plan.dst_dtype)],
        "hosts": sorted(plan.hosts.items()),
        "shapes": sorted((r, n, list(s.local_shape)) for side in (plan.src_shards, plan.dst_shards)
                         for r, shards in side.items() for n, s in shards.items()),
        "copies": [[c.src, c.dst, c.name, c.dim, c.src_lo, c.dst_lo, c.n, c.path] for c in plan.copies],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
