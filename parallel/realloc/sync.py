"""Barriers with verdicts, through the c10d store, that name the ranks that did not arrive.

Why not a gloo collective or point-to-point: a gloo collective that times out
names no peer, and a timed-out gloo receive closes the connection pairs, so the
survivors could not even tell each other who was missing.  The rendezvous store
(TCPStore / FileStore) has waits with timeouts and lets us check which keys
exist, so a barrier on it can name the absent ranks on EVERY rank that arrived,
and leaves the process groups untouched.

:func:`store_barrier` costs O(1) store operations per rank in the normal case
(set my report, add to the arrival counter, wait for "done"); only when some rank
reports an error does each rank read the reports.  Reports are raw bytes (no
pickle).  Keys are unique per barrier and removed by their owners two barriers
later.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["SyncTimeout", "Barrier", "store_barrier", "default_store", "gather_hosts"]


class SyncTimeout(TimeoutError):
    """Some ranks did not arrive within the timeout (their ranks are in ``missing``)."""

    def __init__(self, msg: str, missing: Sequence[int]) -> None:
        super().__init__(msg)
        self.missing = list(missing)


def default_store() -> Any:
    """The default process group's rendezvous store (c10d has no public accessor)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def store_barrier(store: Any, key: str, members: Sequence[int], report: bytes, timeout: float,
                  what: str = "barrier") -> dict[int, bytes]:
    """Wait for all ``members``; return the non-empty reports by rank (empty dict: all fine).

    Raises :class:`SyncTimeout` naming the members that did not arrive in ``timeout`` s.
    """
    me = dist.get_rank()
    members = list(members)
    store.set(f"{key}/r/{me}", report)
    if report:
        store.add(f"{key}/nerr", 1)
    if store.add(f"{key}/n", 1) == len(members):
        store.set(f"{key}/done", b"1")
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - the store's timeout error names no rank
        missing = [r for r in members if not store.check([f"{key}/r/{r}"])]
        raise SyncTimeout(f"{what}: ranks {missing} of {members} did not arrive within {timeout:.1f}s "
                          f"(seen from rank {me})", missing) from None
    if store.add(f"{key}/nerr", 0) == 0:
        return {}
    out = {}
    for r in members:
        got = store.get(f"{key}/r/{r}")
        if got:
            out[r] = bytes(got)
    return out


class Barrier:
    """A sequence of store barriers over fixed members under one unique prefix."""

    def __init__(self, store: Any, prefix: str, members: Sequence[int], timeout: float) -> None:
        self.store, self.prefix, self.members, self.timeout = store, prefix, list(members), timeout
        self.count = 0
        self._old: list[str] = []

    def __call__(self, report: bytes = b"", what: str = "barrier", timeout: Optional[float] = None
                 ) -> dict[int, bytes]:
        key = f"{self.prefix}/{self.count}"
        self.count += 1
        out = store_barrier(self.store, key, self.members, report, self.timeout if timeout is None else timeout,
                            what)
        self._old.append(key)
        if len(self._old) > 2:  # everyone has left that barrier (they passed a later one): tidy up
            self._cleanup(self._old.pop(0))
        return out

    def _cleanup(self, key: str) -> None:
        me = dist.get_rank()
        names = [f"{key}/r/{me}"] + ([f"{key}/n", f"{key}/nerr", f"{key}/done"] if me == self.members[0] else [])
        for k in names:
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001 - a store without delete only keeps a few bytes
                pass


def gather_hosts(timeout: float = 60.0) -> list[str]:
    """Host name of every rank of the default group (index = global rank); collective over the world.

    Call once and pass the result to :func:`parallel.realloc.plan_reallocation`.
    A store barrier first, so a missing rank is named instead of hanging a collective.
    """
    world = dist.get_world_size()
    store_barrier(default_store(), f"rf_hosts/{_next_id()}", range(world), b"", timeout, "gather_hosts")
    name = socket.gethostname().encode()[:255]
    mine = torch.zeros(256, dtype=torch.uint8)
    mine[0] = len(name)
    mine[1:1 + len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [bytes(t[1:1 + int(t[0])].tolist()).decode() for t in out]


_ids = {"n": 0}


def _next_id() -> int:
    """Calls of a collective counted per process (equal on all ranks that call in the same order)."""
    _ids["n"] += 1
    return _ids["n"]
