"""New weights from the trainer to generation servers on other hosts: torch.distributed
broadcasts over a weight group of its own (writer = rank 0, each server one receiver).

Why a standalone group: the trainer's model workers already hold the default process
group, and the servers are not part of it. A ``ProcessGroupGloo`` built on its own
``TCPStore`` (hosted by the writer) joins the writer and the servers without touching
it, and is simply rebuilt, under a new *generation*, when a server dies.

Why one broadcast per tensor, in the order of ``names``: that is what SGLang's
``/update_weights_from_distributed`` receives (names, dtypes and shapes come in the
HTTP body, the bytes through the group), so the same writer feeds either backend.

Every wait has a timeout, and a failure names the group, its members and what timed
out, instead of hanging a weight-update round.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from realflow.comm.tcp_store import host_tcp_store

__all__ = ["GroupSpec", "TensorMeta", "WeightGroup", "WeightBroadcastError", "open_store", "close_store"]


class WeightBroadcastError(RuntimeError):
    """A weight group could not form, or a broadcast in it failed or timed out."""


@dataclass
class GroupSpec:
    """Where and with whom a weight group forms (the writer fills address and port)."""

    name: str
    generation: int
    members: list[str]  # receivers in rank order (rank i + 1); the writer is rank 0
    address: str = ""
    port: int = 0
    timeout_s: float = 120.0

    @property
    def world_size(self) -> int:
        return 1 + len(self.members)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "GroupSpec":
        return cls(**d)

    def describe(self) -> str:
        return (f"weight group {self.name!r} (generation {self.generation}, writer at {self.address}:{self.port}, "
                f"receivers {self.members})")


@dataclass
class TensorMeta:
    """What one broadcast round carries, in order: SGLang's ``names``/``dtypes``/``shapes``."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "TensorMeta":
        return cls(list(tensors), [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                   [list(t.shape) for t in tensors.values()])

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "TensorMeta":
        """Parse and check an HTTP body; ``ValueError`` names what is wrong."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes and shapes (lists of equal length) are required")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(f"names, dtypes and shapes must be non-empty and of equal length, got "
                             f"{len(names)}, {len(dtypes)}, {len(shapes)}")
        for n, d, s in zip(names, dtypes, shapes):
            if not isinstance(n, str) or not isinstance(getattr(torch, str(d), None), torch.dtype):
                raise ValueError(f"tensor {n!r}: unknown dtype {d!r}")
            if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
                raise ValueError(f"tensor {n!r}: shape must be a list of integers >= 0, got {s!r}")
        return cls(names, dtypes, shapes)

    def to_body(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}

    def nbytes(self) -> int:
        total = 0
        for d, s in zip(self.dtypes, self.shapes):
            n = 1
            for x in s:
                n *= x
            total += n * torch.empty(0, dtype=getattr(torch, d)).element_size()
        return total


class WeightGroup:
    """One member of a weight group. Constructing it blocks until every member joined.

    ``rank == 0`` (the writer) hosts the rendezvous store at ``spec.address:spec.port``;
    receivers connect to it. ``bind`` is the address this member's gloo connections use.
    """

    def __init__(self, spec: GroupSpec, rank: int, bind: str, store: Optional[dist.TCPStore] = None) -> None:
        self.spec, self.rank = spec, rank
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            if store is None:
                store = open_store(spec, rank)
            self._store = store
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
            prefix = dist.PrefixStore(f"{spec.name}/g{spec.generation}", store)
            self.pg = dist.ProcessGroupGloo(prefix, rank, spec.world_size, opts)
        except (RuntimeError, dist.DistStoreError) as e:
            raise WeightBroadcastError(f"{spec.describe()}: rank {rank} could not join within "
                                       f"{spec.timeout_s:.0f}s: {_first_line(e)}") from None

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Writer: broadcast every tensor, in order."""
        assert self.rank == 0
        self._broadcast([t.detach().contiguous() for t in tensors], "sending")

    def receive(self, meta: TensorMeta) -> dict[str, torch.Tensor]:
        """Receiver: the tensors ``meta`` announces, filled by the writer's broadcast."""
        out = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in zip(meta.names, meta.dtypes, meta.shapes)}
        self._broadcast(list(out.values()), "receiving")
        return out

    def _broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        try:
            for t in tensors:
                self.pg.broadcast([t], opts).wait()
        except RuntimeError as e:
            raise WeightBroadcastError(f"{self.spec.describe()}: rank {self.rank} failed {what} "
                                       f"{len(tensors)} tensors (a member died, or did not take part within "
                                       f"{self.spec.timeout_s:.0f}s): {_first_line(e)}") from None

    def abort(self) -> None:
        """Make a broadcast blocked in another thread fail now (its group is done with)."""
        try:
            self.pg.abort()
        except RuntimeError:
            pass

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except RuntimeError:
            pass
        close_store(self._store)


def open_store(spec: GroupSpec, rank: int) -> dist.TCPStore:
    """The group's rendezvous store: hosted by the writer (returns at once), joined by receivers.

    The writer listens on ``spec.address`` only (see realflow.comm.tcp_store) and fills in
    ``spec.port``.
    """
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        if rank != 0:
            return dist.TCPStore(spec.address, spec.port, spec.world_size, False, timeout=timeout)
        store, sock = host_tcp_store(spec.address, spec.world_size, timeout)
    except (RuntimeError, OSError) as e:
        raise WeightBroadcastError(f"{spec.describe()}: rank {rank} could not reach the rendezvous store: "
                                   f"{_first_line(e)}") from None
    spec.port = sock.getsockname()[1]
    _LISTENERS[id(store)] = sock  # the store serves on this socket's descriptor: keep it open
    return store


_LISTENERS: dict[int, socket.socket] = {}


def close_store(store: Optional[dist.TCPStore]) -> None:
    """Stop listening for a store this process hosts (no-op for joined or unknown stores)."""
    sock = _LISTENERS.pop(id(store), None) if store is not None else None
    if sock is not None:
        sock.close()


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:400] if s else type(e).__name__
