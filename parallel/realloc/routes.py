"""Per-rank view of a plan: what this rank writes, reads, sends and receives.

Derived purely from the plan (so every rank agrees on offsets without talking):

* each source rank's shared-memory segment holds one *blob* per merged interval
  that same-host destinations need from one of its parameters, written ONCE even
  when several destinations read it (t2p2 -> d4 writes each shard once and four
  ranks read it);
* point-to-point traffic is one contiguous message per (source, destination)
  pair, the plan's copies packed back to back.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from parallel.realloc.plan import LOCAL, P2P, SHM, Copy, ReallocPlan

__all__ = ["Blob", "ShmRead", "Routes", "routes_for", "segment_layouts"]

_ALIGN = 64


@dataclass(frozen=True)
class Blob:
    """Source-local rows ``[lo, hi)`` of parameter ``name`` (along ``dim``) at ``offset`` in a segment."""

    name: str
    dim: int
    lo: int
    hi: int
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShmRead:
    copy: Copy
    blob: Blob


@dataclass
class Routes:
    """What one rank does in one reallocation of a plan."""

    rank: int
    local: list[Copy] = field(default_factory=list)  # src == dst == rank
    blobs: list[Blob] = field(default_factory=list)  # to write into my segment
    segment_size: int = 0  # my segment's size (0: none)
    reads: list[ShmRead] = field(default_factory=list)  # same-host copies into my params
    read_sources: dict[int, int] = field(default_factory=dict)  # source rank -> its segment size
    sends: dict[int, list[Copy]] = field(default_factory=dict)  # dst rank -> copies (message order)
    recvs: dict[int, list[Copy]] = field(default_factory=dict)  # src rank -> copies (message order)


def segment_layouts(plan: ReallocPlan) -> dict[int, tuple[int, list[Blob]]]:
    """source rank -> (segment size, blobs), for every source with same-host readers."""
    wanted: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for c in plan.copies:
        if c.path == SHM:
            wanted[(c.src, c.name)].append((c.src_lo, c.src_lo + c.n))
    out: dict[int, tuple[int, list[Blob]]] = {}
    item = plan.src_dtype.itemsize
    for (src, name), ivs in sorted(wanted.items()):
        shard = plan.src_shards[src][name]
        size, blobs = out.get(src, (0, []))
        merged: list[list[int]] = []
        for lo, hi in sorted(ivs):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            shape = list(shard.local_shape)
            shape[shard.dim] = hi - lo
            size = -(-size // _ALIGN) * _ALIGN
            blobs.append(Blob(name, shard.dim, lo, hi, size, tuple(shape)))
            size += math.prod(shape) * item
        out[src] = (size, blobs)
    return out


def routes_for(plan: ReallocPlan, rank: int) -> Routes:
    r = Routes(rank)
    layouts = segment_layouts(plan)
    if rank in layouts:
        r.segment_size, r.blobs = layouts[rank]
    for c in plan.copies:
        if c.path == LOCAL and c.dst == rank:
            r.local.append(c)
        elif c.path == SHM and c.dst == rank:
            blob = next(b for b in layouts[c.src][1]
                        if b.name == c.name and b.lo <= c.src_lo and c.src_lo + c.n <= b.hi)
            r.reads.append(ShmRead(c, blob))
            r.read_sources[c.src] = layouts[c.src][0]
        elif c.path == P2P and c.src == rank:
            r.sends.setdefault(c.dst, []).append(c)
        elif c.path == P2P and c.dst == rank:
            r.recvs.setdefault(c.src, []).append(c)
    return r
