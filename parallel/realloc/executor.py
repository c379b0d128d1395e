"""Execute a reallocation plan: local copies, shared memory on one host, p2p across hosts.

Two calls, both on every rank:

* :func:`prepare_reallocation` -- once per plan.  Collective over the WORLD (the
  default group), in the same order on every rank, because it may create a
  process group for S u T (``torch.distributed.new_group`` semantics, like
  :func:`parallel.groups.build_model_groups`).  Members then agree on the plan
  (fingerprint), and same-host sources create persistent, pre-faulted shared
  memory segments that their readers map.
* :func:`reallocate` -- every time weights move.  Collective over S u T only;
  other ranks return at once.  Order of work on each rank, to overlap paths:
  post p2p receives; pack and send p2p messages; write same-host blobs into my
  segment; local copies; *barrier*; read same-host blobs into my parameters;
  finish p2p; zero vocab padding; *barrier* (segments may be rewritten after it).

Every rank validates its modules (names, shapes, dtypes, storage present) and the
verdicts are exchanged before any tensor moves, so a bad module raises the same
:class:`ReallocError` on every member (no hang).  The three barriers of a call go
through the rendezvous store (:mod:`parallel.realloc.sync`): each has a deadline
and a timeout names the ranks that did not arrive; point-to-point waits name the
peer.  After a timeout the S u T group must be considered broken.

Blending: ``target = eta * source + (1 - eta) * target`` computed as
``target.mul_(1 - eta); target.add_(source * eta)`` (two rounded ops, so the
result is bitwise the formula evaluated with torch); ``eta = 1`` is a plain copy.
Destination parameters must not alias source parameters (different model objects).
"""
from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from parallel.hf_io import local_param_table
from parallel.realloc.plan import ReallocError, ReallocPlan
from parallel.realloc.routes import Routes, routes_for
from parallel.realloc.segments import Segment, create_segment, open_segment, unlink_segment
from parallel.realloc.spec import LocalShard
from parallel.realloc.sync import Barrier, _next_id, default_store
from realflow.base.devices import worker_device

__all__ = ["ReallocResources", "prepare_reallocation", "reallocate", "Module"]

Module = Union[torch.nn.Module, Mapping[str, torch.Tensor]]
_DATA_TAG = 17
_GROUPS: dict[tuple[Any, tuple[int, ...]], Any] = {}


@dataclass
class ReallocResources:
    """Per-rank state of a prepared plan (group, segments, routes). ``close()`` frees segments."""

    fingerprint: str
    is_member: bool
    members: tuple[int, ...]
    group: Any = None
    routes: Optional[Routes] = None
    segment: Optional[Segment] = None  # mine (as a source)
    peer_segments: dict[int, Segment] = field(default_factory=dict)  # source rank -> mapped segment
    timeout: float = 300.0
    calls: int = 0
    barrier: Optional[Barrier] = None

    def close(self) -> None:
        for seg in [self.segment, *self.peer_segments.values()]:
            if seg is not None:
                seg.close()
        self.segment, self.peer_segments = None, {}


def _group_for(members: tuple[int, ...], timeout: float) -> Any:
    """new_group over ``members`` (every world rank calls; cached per member set)."""
    key = (id(dist.group.WORLD), members)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(members), timeout=timedelta(seconds=timeout),
                                      group_desc="realflow_realloc")
    return _GROUPS[key]


def _raise_if_failed(reports: dict[int, bytes], what: str) -> None:
    if reports:
        raise ReallocError(f"{what} failed on {len(reports)} rank(s): "
                           + "; ".join(f"rank {r}: {m.decode(errors='replace')}" for r, m in sorted(reports.items())))


def prepare_reallocation(plan: ReallocPlan, timeout: float = 300.0, store: Any = None) -> ReallocResources:
    """Collective over the world (same order on every rank): group, plan agreement, segments.

    ``store``: the rendezvous store used for barriers (default: the default group's).
    """
    if not dist.is_initialized():
        raise RuntimeError("prepare_reallocation: torch.distributed is not initialized")
    members = plan.members
    world = dist.get_world_size()
    if members[-1] >= world:
        raise ReallocError(f"prepare_reallocation: plan ranks {list(members)} exceed the world size {world}")
    group = _group_for(members, timeout)
    prefix = f"rf_realloc/{_next_id()}"  # same on every rank: every rank calls prepare in the same order
    me = dist.get_rank()
    res = ReallocResources(plan.fingerprint, me in members, members, timeout=timeout)
    if not res.is_member:
        return res
    store = default_store() if store is None else store
    res.group = group
    res.barrier = Barrier(store, prefix, members, timeout)
    res.routes = routes_for(plan, me)
    if me == members[0]:
        store.set(f"{prefix}/plan", f"{plan.fingerprint} {secrets.token_hex(6)}".encode())
    store.set(f"{prefix}/plan/{me}", plan.fingerprint.encode())
    res.barrier(what="prepare_reallocation(arrive)")
    fingerprint, token = bytes(store.get(f"{prefix}/plan")).decode().split()
    err = ""
    if fingerprint != plan.fingerprint:
        err = (f"computed a different plan than rank {members[0]} (different model config, layouts, "
               f"dtypes or hosts)")
    else:
        try:
            if res.routes.segment_size:
                res.segment = create_segment(f"rf_realloc_{token}_{me}", res.routes.segment_size)
        except Exception as e:  # noqa: BLE001 - reported to every member below
            err = f"creating shared memory: {e}"
    _raise_if_failed(res.barrier(err.encode(), "prepare_reallocation(create)"), "prepare_reallocation")
    try:
        for src, size in res.routes.read_sources.items():
            res.peer_segments[src] = open_segment(f"rf_realloc_{token}_{src}", size)
    except Exception as e:  # noqa: BLE001
        err = f"mapping shared memory: {e}"
    reports = res.barrier(err.encode(), "prepare_reallocation(map)")
    if res.segment is not None:  # every reader mapped it (or failed): the name is no longer needed
        unlink_segment(res.segment.name)
    _raise_if_failed(reports, "prepare_reallocation")
    return res


# --------------------------------------------------------------------------- binding


def _bind(module: Optional[Module], shards: dict[str, LocalShard], plan: ReallocPlan, role: str,
          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """full name -> this rank's tensor, after checking names, shapes, dtypes, storage."""
    if module is None:
        raise ReallocError(f"this rank is a {role} of the plan but passed no {role} module")
    if isinstance(module, torch.nn.Module):
        params = dict(module.named_parameters())
        pairs = local_param_table(module, plan.table)
        by_name = {e.mcore_name: params[n] for e, n in pairs if e.mcore_name in shards}
        used = {n for e, n in pairs if e.mcore_name in shards}
        extra = sorted(set(params) - used)
    elif isinstance(module, Mapping):
        by_name = {n: module[s.local_name] for n, s in shards.items() if s.local_name in module}
        extra = sorted(set(module) - {s.local_name for s in shards.values()})
    else:
        raise ReallocError(f"{role} module must be an nn.Module or a dict of tensors, "
                           f"got {type(module).__name__}")
    missing = sorted(s.local_name for n, s in shards.items() if n not in by_name)
    if missing or extra:
        raise ReallocError(f"{role} module does not match the plan's layout: missing "
                           f"{missing[:4]}, unexpected {extra[:4]}")
    for n, s in shards.items():
        t = by_name[n]
        if tuple(t.shape) != s.local_shape:
            raise ReallocError(f"{role} parameter {s.local_name} has shape {list(t.shape)}, "
                               f"the plan expects {list(s.local_shape)}")
        if t.dtype != dtype:
            raise ReallocError(f"{role} parameter {s.local_name} has dtype {t.dtype}, "
                               f"the plan expects {dtype}")
        if t.untyped_storage().nbytes() < t.numel() * t.element_size():
            raise ReallocError(f"{role} parameter {s.local_name} has no storage "
                               f"(offloaded? call reload() first)")
    return by_name


def _put(dst: torch.Tensor, src: torch.Tensor, eta: float) -> None:
    if eta == 1.0:
        dst.copy_(src)
    else:
        dst.mul_(1.0 - eta)
        dst.add_(src.to(dst.dtype) * eta)


# --------------------------------------------------------------------------- execute


def reallocate(plan: ReallocPlan, resources: ReallocResources, src: Optional[Module],
               dst: Optional[Module], eta: float = 1.0, timeout: Optional[float] = None
               ) -> dict[str, float]:
    """Move (or blend) the weights of ``src`` (layout plan.src) into ``dst`` (layout plan.dst).

    Collective over S u T; ranks outside return ``{}`` at once.  Ranks not in S pass
    ``src=None``, ranks not in T ``dst=None``.  Returns this rank's byte counts per
    path and the seconds taken.
    """
    res = resources
    if res.fingerprint != plan.fingerprint:
        raise ReallocError("reallocate: resources were prepared for a different plan")
    if not res.is_member:
        return {}
    assert res.routes is not None
    timeout = res.timeout if timeout is None else float(timeout)
    me, g = dist.get_rank(), res.group
    t0 = time.perf_counter()
    res.calls += 1
    err = ""
    src_t: dict[str, torch.Tensor] = {}
    dst_t: dict[str, torch.Tensor] = {}
    try:
        if not (isinstance(eta, (int, float)) and 0.0 <= float(eta) <= 1.0):
            raise ReallocError(f"eta={eta!r} must be a number in [0, 1]")
        eta = float(eta)
        if me in plan.src.workers:
            src_t = _bind(src, plan.src_shards[me], plan, "source", plan.src_dtype)
        if me in plan.dst.workers:
            dst_t = _bind(dst, plan.dst_shards[me], plan, "destination", plan.dst_dtype)
    except Exception as e:  # noqa: BLE001 - every member raises it below
        err = str(e) if isinstance(e, ReallocError) else f"{type(e).__name__}: {e}"
    tb = time.perf_counter()
    _raise_if_failed(res.barrier(err.encode(), "reallocate(validate)", timeout), "reallocate")
    barrier_s = time.perf_counter() - tb

    stats = {"local_bytes": 0, "shm_write_bytes": 0, "shm_read_bytes": 0, "p2p_send_bytes": 0,
             "p2p_recv_bytes": 0}
    r = res.routes
    deadline = time.monotonic() + timeout
    recvs, sends = {}, []
    wire = worker_device()  # both ends agree: NCCL between GPUs, gloo between CPU workers
    with torch.no_grad():
        try:
            for peer, copies in r.recvs.items():  # 1. post receives
                n = sum(_rows_numel(plan, c) for c in copies)
                buf = torch.empty(n, dtype=plan.src_dtype, device=wire)
                recvs[peer] = (buf, dist.irecv(buf, src=peer, group=g, tag=_DATA_TAG))
            for peer, copies in r.sends.items():  # 2. pack and send
                buf = torch.cat([src_t[c.name].narrow(c.dim, c.src_lo, c.n).reshape(-1).to(wire)
                                 for c in copies])
                sends.append((peer, buf, dist.isend(buf, dst=peer, group=g, tag=_DATA_TAG)))
                stats["p2p_send_bytes"] += buf.numel() * buf.element_size()
            for b in r.blobs:  # 3. same-host blobs, written once for all readers
                view = res.segment.view(b.offset, plan.src_dtype, b.shape)
                view.copy_(src_t[b.name].narrow(b.dim, b.lo, b.hi - b.lo))
                stats["shm_write_bytes"] += view.numel() * view.element_size()
            for c in r.local:  # 4. local copies
                s = src_t[c.name].narrow(c.dim, c.src_lo, c.n)
                _put(dst_t[c.name].narrow(c.dim, c.dst_lo, c.n), s, eta)
                stats["local_bytes"] += s.numel() * s.element_size()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        tb = time.perf_counter()
        _raise_if_failed(res.barrier(err.encode(), "reallocate(written)", timeout), "reallocate")
        barrier_s += time.perf_counter() - tb
        try:
            for rd in r.reads:  # 5. same-host reads
                c, b = rd.copy, rd.blob
                blob = res.peer_segments[c.src].view(b.offset, plan.src_dtype, b.shape)
                s = blob.narrow(c.dim, c.src_lo - b.lo, c.n)
                _put(dst_t[c.name].narrow(c.dim, c.dst_lo, c.n), s, eta)
                stats["shm_read_bytes"] += s.numel() * s.element_size()
            for peer, (buf, work) in recvs.items():  # 6. p2p arrivals
                _wait(work, deadline, f"no weights from rank {peer} within {timeout:.0f}s")
                off = 0
                for c in r.recvs[peer]:
                    shape = list(plan.src_shards[c.src][c.name].local_shape)
                    shape[c.dim] = c.n
                    k = math.prod(shape)
                    _put(dst_t[c.name].narrow(c.dim, c.dst_lo, c.n), buf[off:off + k].view(shape), eta)
                    off += k
                stats["p2p_recv_bytes"] += buf.numel() * buf.element_size()
            for peer, _, work in sends:
                _wait(work, deadline, f"rank {peer} did not take its weights within {timeout:.0f}s")
            for n, s in plan.dst_shards.get(me, {}).items():  # 7. vocab padding stays zero
                for a, b_ in s.padding:
                    dst_t[n].narrow(s.dim, a, b_ - a).zero_()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    tb = time.perf_counter()
    _raise_if_failed(res.barrier(err.encode(), "reallocate(done)", timeout), "reallocate")
    stats["barrier_seconds"] = barrier_s + time.perf_counter() - tb
    stats["seconds"] = time.perf_counter() - t0
    return stats


def _rows_numel(plan: ReallocPlan, c) -> int:
    shape = plan.src_shards[c.src][c.name].local_shape
    return c.n * (math.prod(shape) // shape[c.dim])


def _wait(work, deadline: float, msg: str) -> None:
    try:
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError as e:
        raise ReallocError(f"{msg} ({e})") from None
