"""Delta weight sync: send only the bytes that changed since the receiver's version, verified.

Why blocks of a fixed size (``block_bytes``, 1 MiB by default) and not whole tensors: a
sparse change (frozen layers, embedding rows of tokens a batch never saw, a few
tensors) touches a few blocks of a large tensor, and whole tensors would resend all of
it; finer blocks do not pay either -- an RL step's dense change touches every block of
any size, and each block costs a digest and an index entry. A tensor smaller than a
block is one block.

The message (a *manifest*, JSON/msgpack, no pickle) says what a version carries on top
of which base, generically -- a named subset of tensors, which is also what a LoRA run
will send ("the delta is the adapter"):

* ``version``, ``base`` (None: a full update, the receiver keeps nothing of its own);
* ``schema``: ``{name: [dtype, shape]}`` of the whole model (the receiver checks its own
  against it: a delta to a server of another model fails naming the first difference);
* ``whole``: ``{name: [block digests]}``, tensors sent whole under their own names;
* ``blocks``: ``{name: [[index, digest], ...]}``, blocks sent concatenated, in this
  order, in one uint8 tensor named :data:`DELTA_KEY`;
* ``root``: the whole version's digest, BLAKE2b over every block digest (sorted names):
  the receiver recomputes it from its own copy after applying, so a receiver that
  drifted from the writer by one bit refuses the version instead of serving it.

The writer (:class:`DeltaWriter`) hashes every block of each published state and keeps
only the digests (no copy of the weights); the receiver (:class:`DeltaReceiver`) keeps a
CPU copy of the last applied HF-named weights, because a block can only be patched into
the bytes around it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

__all__ = ["DELTA_KEY", "DELTA_MODES", "BLOCK_BYTES", "AUTO_MAX_FRACTION", "DeltaError", "DeltaBaseMismatch",
           "DeltaWriter", "DeltaReceiver", "Prepared", "Pending", "block_digests", "root_digest", "schema_of"]

DELTA_KEY = "__realflow_delta_blocks__"
DELTA_MODES = ("auto", "off")
BLOCK_BYTES = 1 << 20
AUTO_MAX_FRACTION = 0.9  # auto: a delta of more than this fraction of the model's bytes goes out full


class DeltaError(ValueError):
    """An update cannot be applied here (the message says what and what to do)."""


class DeltaBaseMismatch(DeltaError):
    """The delta's base is not the version this receiver holds: it keeps its weights and
    needs a full update (the controller's next plan sends one)."""


def _u8(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (CPU, contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def block_digests(t: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """BLAKE2b-128 of each ``block_bytes`` block of ``t``'s bytes (hashlib drops the GIL)."""
    mv = memoryview(_u8(t).numpy())
    n = max(1, -(-len(mv) // block_bytes))
    return [hashlib.blake2b(mv[i * block_bytes:(i + 1) * block_bytes], digest_size=16).hexdigest()
            for i in range(n)]


def root_digest(table: Mapping[str, list[str]]) -> str:
    """The whole version's digest: over every tensor's name and block digests, names sorted."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(table):
        h.update(name.encode())
        for d in table[name]:
            h.update(bytes.fromhex(d))
    return h.hexdigest()


def schema_of(state: Mapping[str, torch.Tensor]) -> dict[str, list]:
    return {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in state.items()}


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class Prepared:
    """One version hashed by the writer: its digests, and what changed since the writer's last."""

    version: int
    state: Mapping[str, torch.Tensor]
    schema: dict[str, list]
    table: dict[str, list[str]]
    root: str
    changed: Optional[dict[str, list[int]]]  # changed block indices per tensor; None: no comparable last
    full_bytes: int


class DeltaWriter:
    """The writer's side: digests of the last published version, and delta messages against it."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.version: Optional[int] = None
        self.table: dict[str, list[str]] = {}
        self.schema: dict[str, list] = {}

    def prepare(self, state: Mapping[str, torch.Tensor], version: int) -> Prepared:
        """Hash ``state`` and find its changed blocks (nothing is sent or remembered yet)."""
        table = {n: block_digests(t, self.block_bytes) for n, t in state.items()}
        schema = schema_of(state)
        changed = None
        if self.version is not None and schema == self.schema:
            changed = {}
            for n, ds in table.items():
                idx = [i for i, (a, b) in enumerate(zip(ds, self.table[n])) if a != b]
                if idx:
                    changed[n] = idx
        return Prepared(version, state, schema, table, root_digest(table), changed, _nbytes(state))

    def message(self, prep: Prepared, base: Optional[int], mode: str = "auto"
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, manifest)`` for receivers at ``base``: a delta when the writer's last
        version is ``base`` and (``auto``) it saves bytes, else a full update."""
        if mode not in DELTA_MODES:
            raise DeltaError(f"weight_sync_delta={mode!r}: expected one of {DELTA_MODES}")
        man: dict[str, Any] = {"version": prep.version, "base": None, "block_bytes": self.block_bytes,
                               "schema": prep.schema, "root": prep.root, "full_bytes": prep.full_bytes,
                               "whole": {}, "blocks": {}}
        if prep.changed is not None and base is not None and base == self.version and mode != "off":
            whole = {n: idx for n, idx in prep.changed.items() if len(idx) == len(prep.table[n])}
            parts = {n: idx for n, idx in prep.changed.items() if n not in whole}
            sent = sum(_u8(prep.state[n]).numel() for n in whole)
            pieces = []
            for n, idx in parts.items():
                u8 = _u8(prep.state[n])
                pieces += [u8[i * self.block_bytes:(i + 1) * self.block_bytes] for i in idx]
            sent += sum(p.numel() for p in pieces)
            if sent <= AUTO_MAX_FRACTION * prep.full_bytes:
                tensors = {n: prep.state[n] for n in whole}
                if pieces:
                    tensors[DELTA_KEY] = torch.cat(pieces)
                man.update(base=base, sent_bytes=sent, whole={n: prep.table[n] for n in whole},
                           blocks={n: [[i, prep.table[n][i]] for i in idx] for n, idx in parts.items()})
                return tensors, man
        man.update(sent_bytes=prep.full_bytes, whole=dict(prep.table))
        return dict(prep.state), man

    def commit(self, prep: Prepared) -> None:
        """``prep`` was published: later deltas are against it."""
        self.version, self.table, self.schema = prep.version, prep.table, prep.schema


@dataclass
class Pending:
    """A verified update not yet in force (staged): committed with the engine's swap."""

    version: int
    tensors: dict[str, torch.Tensor]
    table: dict[str, list[str]]
    schema: dict[str, list]
    root: str
    full: bool
    block_bytes: int = BLOCK_BYTES
    applied: list[str] = field(default_factory=list)


class DeltaReceiver:
    """A server's copy of the last applied version (HF names, CPU) and its digests."""

    def __init__(self) -> None:
        self.version: Optional[int] = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.table: dict[str, list[str]] = {}
        self.schema: dict[str, list] = {}
        self.root: Optional[str] = None

    def apply(self, man: Mapping[str, Any], payload: Mapping[str, torch.Tensor]) -> Pending:
        """Check and apply ``man`` to a copy of what this receiver holds; raise :class:`DeltaError`
        (nothing changed) when it does not fit. The result's ``tensors`` are the new values of
        every tensor the update touched."""
        v, base, bb = man.get("version"), man.get("base"), man.get("block_bytes")
        schema, whole, blocks = man.get("schema"), man.get("whole"), man.get("blocks")
        if not (isinstance(v, int) and isinstance(bb, int) and bb > 0 and isinstance(schema, dict)
                and isinstance(whole, dict) and isinstance(blocks, dict) and isinstance(man.get("root"), str)):
            raise DeltaError("weight update manifest: version, block_bytes, schema, whole, blocks and root are "
                             "required (realflow.weights.delta)")
        if base is not None:
            if self.version is None:
                raise DeltaBaseMismatch(f"delta update v{v} is on v{base}, but this server holds no delta base "
                                        f"(it runs weights it did not receive as a full update): it needs a full "
                                        f"update")
            if base != self.version:
                raise DeltaBaseMismatch(f"delta update v{v} is on v{base}, but this server holds v{self.version}: "
                                        f"it keeps v{self.version} and needs a full update")
            if schema != self.schema:
                raise DeltaError(f"delta update v{v} is for another model: {_schema_diff(schema, self.schema)}; "
                                 f"point the servers at the trainer's model (rollout.model_path)")
        table = dict(self.table) if base is not None else {}
        out: dict[str, torch.Tensor] = {}
        for n, digests in whole.items():
            t = payload.get(n)
            if t is None or n not in schema:
                raise DeltaError(f"weight update v{v}: tensor {n!r} is announced but not sent (or not in the schema)")
            _check_meta(n, t, schema[n], v)
            got = block_digests(t, bb)
            if got != list(digests):
                bad = next(i for i, (a, b) in enumerate(zip(got, digests)) if a != b) if len(got) == len(digests) else 0
                raise DeltaError(f"weight update v{v}: tensor {n!r} block {bad} does not match its digest "
                                 f"(corrupted in transit); the server keeps v{self.version}")
            out[n], table[n] = t, got
        buf = payload.get(DELTA_KEY)
        off = 0
        for n, entries in blocks.items():
            if n not in self.tensors:
                raise DeltaError(f"weight update v{v}: blocks of {n!r}, which this server does not hold")
            new = self.tensors[n].clone()
            u8 = _u8(new)
            ds = list(table[n])
            for i, want in entries:
                lo, hi = i * bb, min((i + 1) * bb, u8.numel())
                if buf is None or not 0 <= lo < hi or off + hi - lo > buf.numel():
                    raise DeltaError(f"weight update v{v}: block {i} of {n!r} is outside the tensor or the "
                                     f"sent bytes")
                u8[lo:hi] = buf[off:off + hi - lo]
                off += hi - lo
                got = hashlib.blake2b(memoryview(u8[lo:hi].numpy()), digest_size=16).hexdigest()
                if got != want:
                    raise DeltaError(f"weight update v{v}: block {i} of {n!r} does not match its digest after "
                                     f"applying (base bytes differ, or corrupted in transit); the server keeps "
                                     f"v{self.version}")
                ds[i] = got
            out[n], table[n] = new, ds
        if buf is not None and off != buf.numel():
            raise DeltaError(f"weight update v{v}: {buf.numel() - off} sent bytes are not claimed by any block")
        if base is None and set(table) != set(schema):
            raise DeltaError(f"full weight update v{v}: tensors {sorted(set(schema) - set(table))[:3]} missing")
        root = root_digest(table)
        if root != man["root"]:
            raise DeltaError(f"weight update v{v}: the whole version's digest differs from the writer's after "
                             f"applying (this server's copy drifted); it keeps v{self.version}, needs a full update")
        return Pending(v, out, table, dict(schema), root, base is None, bb, sorted(out))

    def commit(self, p: Pending) -> None:
        """``p`` is in force in the engine: hold its tensors as the base of the next delta.
        A full update's tensors may alias the sender's memory (shared memory): copied."""
        if p.full:
            self.tensors = {n: t.detach().clone() for n, t in p.tensors.items()}
        else:
            self.tensors.update(p.tensors)
        self.version, self.table, self.schema, self.root = p.version, p.table, p.schema, p.root

    def forget(self) -> None:
        """The engine's weights changed by another way (disk, an update without a manifest)."""
        self.__init__()

    def with_groups(self, p: Pending, groups: Optional[list[list[str]]]) -> dict[str, torch.Tensor]:
        """The tensors to hand the engine: ``p``'s, plus the partners of any that converts
        together with others (a fused entry needs all its HF tensors in one update)."""
        out = dict(p.tensors)
        if groups is None or p.full:
            return out
        for g in groups:
            if any(n in out for n in g):
                for n in g:
                    if n not in out and n in self.tensors:
                        out[n] = self.tensors[n]
        return out


def _check_meta(name: str, t: torch.Tensor, want: list, v: int) -> None:
    got = [str(t.dtype).removeprefix("torch."), list(t.shape)]
    if got != [want[0], list(want[1])]:
        raise DeltaError(f"weight update v{v}: tensor {name!r} arrived as {got[0]} {got[1]}, the manifest says "
                         f"{want[0]} {want[1]}")


def _schema_diff(theirs: Mapping[str, list], ours: Mapping[str, list]) -> str:
    """The first difference between the update's tensors and this server's, in one phrase."""
    for n, meta in theirs.items():
        if n not in ours:
            return f"tensor {n!r} ({meta[0]} {meta[1]}) is not in this server's model"
        if [ours[n][0], list(ours[n][1])] != [meta[0], list(meta[1])]:
            return f"tensor {n!r} is {meta[0]} {meta[1]} in the update, {ours[n][0]} {ours[n][1]} here"
    extra = sorted(set(ours) - set(theirs))
    return f"this server's model has tensor(s) {extra[:3]} the update's does not"
