"""The batch type that flows along the edges of the data flow graph.

Every MFC consumes and produces a :class:`SequenceBatch`: samples with unique
ids, each sample holding one sequence or a *group* of sequences per key (e.g.
``n`` responses to one prompt), stored *packed* (no padding): for each key one
tensor whose dim 0 is the concatenation of all sequences of all samples.

Why packed and why per-key lengths: different keys of one sample have
different lengths (a prompt vs. prompt+response vs. one reward per response),
and padding wastes the very tokens we are trying to balance across data
parallel ranks and micro-batches.  ``seqlens[key][i]`` lists the dim-0 lengths
of every sequence of sample ``i`` for that key, which is all the master needs
to plan work without ever touching tensors (see :meth:`SequenceBatch.meta`).

Operations that reorder or subset samples keep samples whole and keep their
relative order, and they are deterministic: the same batch always splits the
same way on every process, so no coordination is needed to agree on it.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from realflow.api.padded_partition import padded_partition
from realflow.api.registry import did_you_mean

__all__ = ["BatchError", "MicroBatchSpec", "SequenceBatch"]


class BatchError(ValueError):
    """A malformed batch or an impossible batch operation; the message names the key or id."""


@dataclass
class MicroBatchSpec:
    """How an MFC cuts its batch into micro-batches.

    ``n_mbs`` is the minimum number of micro-batches (when there are at least
    that many samples); ``max_tokens_per_mb`` caps the *padded* tokens per
    micro-batch, sequences x longest, which is what a micro-batch computes (a
    single sample larger than the cap still gets its own micro-batch).
    """

    n_mbs: int = 1
    max_tokens_per_mb: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.n_mbs, bool) or not isinstance(self.n_mbs, int) or self.n_mbs < 1:
            raise BatchError(f"MicroBatchSpec.n_mbs must be an integer >= 1, got {self.n_mbs!r}")
        m = self.max_tokens_per_mb
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise BatchError(f"MicroBatchSpec.max_tokens_per_mb must be None or an integer >= 1, got {m!r}")


# ----------------------------------------------------------------------------------------------
# partitioning helpers (pure functions on token counts; indices refer to sample positions)


def _lpt_partition(weights: Sequence[int], n: int) -> list[list[int]]:
    """Split positions ``0..len(weights)-1`` into ``n`` non-empty, token-balanced parts.

    Longest-processing-time greedy: heaviest sample first onto the lightest part
    (ties: fewer samples, then lower part index), which is within 4/3 of the
    optimal max load.  Parts keep ascending positions and are ordered by their
    first position, so the result is deterministic and "looks like" the input.
    """
    assert 1 <= n <= len(weights)
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    heap = [(0, 0, p) for p in range(n)]
    parts: list[list[int]] = [[] for _ in range(n)]
    for i in order:
        load, count, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + weights[i], count + 1, p))
    for part in parts:
        part.sort()
    parts.sort(key=lambda part: part[0])
    return parts


def _pack_partition(weights: Sequence[int], min_parts: int, budget: int | None) -> list[list[int]]:
    """Micro-batch partition: first-fit-decreasing under ``budget`` tokens, >= ``min_parts`` parts.

    A sample above the budget is packed alone (never dropped).  If packing gives
    fewer than ``min_parts`` parts, the heaviest splittable part is halved (by
    :func:`_lpt_partition`) until there are enough; halving never breaks the budget.
    """
    n = len(weights)
    if n == 0:
        return []
    target = min(min_parts, n)
    if budget is None:
        return _lpt_partition(weights, target)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        w = weights[i]
        for b, load in enumerate(loads):
            if w <= budget and load + w <= budget:
                bins[b].append(i)
                loads[b] += w
                break
        else:
            bins.append([i])
            loads.append(w)
    while len(bins) < target:
        b = max((b for b in range(len(bins)) if len(bins[b]) >= 2), key=lambda b: (loads[b], len(bins[b]), -b))
        members = sorted(bins.pop(b))
        loads.pop(b)
        for half in _lpt_partition([weights[i] for i in members], 2):
            bins.append([members[j] for j in half])
            loads.append(sum(weights[members[j]] for j in half))
    for part in bins:
        part.sort()
    bins.sort(key=lambda part: part[0])
    return bins


_CAT_MAX_PIECES = 32  # up to this many pieces, cat of views beats building an index


def _gather_rows(t: torch.Tensor, starts: list[int], lens: list[int]) -> torch.Tensor:
    """Concatenate ``t[s:s+l]`` for each (s, l) along dim 0.

    Consecutive pieces (a data-parallel slice of a stored batch: the common case) are
    one view, a few pieces one ``cat`` of views, many pieces one ``index_select``;
    building the gather index costs tens of microseconds, which an empty MFC's
    round trip notices.
    """
    n = len(starts)
    if n == 1:
        return t.narrow(0, starts[0], lens[0])
    if all(starts[i + 1] == starts[i] + lens[i] for i in range(n - 1)):
        return t.narrow(0, starts[0], sum(lens))
    if n <= _CAT_MAX_PIECES:
        return torch.cat([t.narrow(0, st, ln) for st, ln in zip(starts, lens)])
    lens_t = torch.tensor(lens, dtype=torch.long)
    total = int(lens_t.sum())
    out_starts = torch.cumsum(lens_t, 0) - lens_t
    shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - out_starts, lens_t)
    index = torch.arange(total, dtype=torch.long) + shift
    return t.index_select(0, index.to(t.device))


_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)


def _check_plain(value: Any, where: str) -> None:
    """Metadata must survive msgpack (no pickle on the wire): plain scalars, lists, str-keyed dicts."""
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_plain(v, where)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise BatchError(f"metadata {where}: dict keys must be str, got {type(k).__name__} {k!r}")
            _check_plain(v, where)
        return
    raise BatchError(
        f"metadata {where}: value of type {type(value).__name__} is not a plain msgpack type "
        "(use None/bool/int/float/str/bytes/list/dict; tensors belong in data)"
    )


def _raise_bad_ids(ids: list) -> None:
    """The precise complaint about sample ids that failed the fast check (non-str or repeated)."""
    seen: set[str] = set()
    for i in ids:
        if not isinstance(i, str):
            raise BatchError(f"sample ids must be str, got {type(i).__name__} {i!r}")
        if i in seen:
            raise BatchError(f"duplicate sample id {i!r} in batch")
        seen.add(i)


# ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class SequenceBatch:
    """Packed samples with unique ids; see the module docstring.

    ``data[key]`` is ``None`` in metadata-only copies (what the master holds).
    Keys live either in ``data`` (tensors, with ``seqlens``) or in ``metadata``
    (one plain python value per sample, e.g. the reference ``"answer"``).
    Derived batches (select/unpack/split) may share tensor storage with their
    source, like torch slicing does.
    """

    ids: list[str]
    seqlens: dict[str, list[list[int]]]
    data: dict[str, torch.Tensor | None]
    metadata: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Validation runs on every batch built from outside data (interfaces, the wire), so each check
        # is one pass in C over the whole batch; the precise error is worked out only once one fails.
        self.ids = ids = list(self.ids)
        n = len(ids)
        if n and (set(map(type, ids)) != {str} or len(set(ids)) != n):
            _raise_bad_ids(ids)
        if self.seqlens.keys() != self.data.keys():
            only_s = sorted(set(self.seqlens) - set(self.data))
            only_d = sorted(set(self.data) - set(self.seqlens))
            raise BatchError(f"keys with seqlens but no data entry: {only_s}; keys with data but no seqlens: {only_d}")
        seqlens: dict[str, list[list[int]]] = {}
        for key, per_sample in self.seqlens.items():
            if not isinstance(key, str) or not key:
                raise BatchError(f"batch keys must be non-empty str, got {key!r}")
            if len(per_sample) != n:
                raise BatchError(f"key {key!r}: seqlens has {len(per_sample)} samples but the batch has {n} ids")
            try:
                flat = list(itertools.chain.from_iterable(per_sample))
                if set(map(type, flat)) <= {int}:  # already ints: copy the lists
                    norm = list(map(list, per_sample))
                else:  # e.g. numpy or torch integers
                    norm = [list(map(int, lens)) for lens in per_sample]
                    flat = list(itertools.chain.from_iterable(norm))
            except (TypeError, ValueError):
                raise BatchError(f"key {key!r}: seqlens must be a list (per sample) of lists of ints") from None
            if flat and min(flat) < 0:
                raise BatchError(f"key {key!r}: negative sequence length in seqlens")
            seqlens[key] = norm
            t = self.data[key]
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise BatchError(f"key {key!r}: data must be a torch.Tensor or None, got {type(t).__name__}")
            shape = t.shape
            if not shape:
                raise BatchError(f"key {key!r}: data tensor must have at least one dimension (dim 0 = tokens)")
            total = sum(flat)
            if shape[0] != total:
                raise BatchError(f"key {key!r}: tensor dim 0 is {shape[0]} but its seqlens sum to {total}")
        self.seqlens = seqlens
        self.data = dict(self.data)
        metadata: dict[str, list] = {}
        for key, values in self.metadata.items():
            if not isinstance(key, str) or not key:
                raise BatchError(f"metadata keys must be non-empty str, got {key!r}")
            if key in self.data:
                raise BatchError(f"key {key!r} is both a tensor key and a metadata key")
            if len(values) != n:
                raise BatchError(f"metadata key {key!r} has {len(values)} values but the batch has {n} ids")
            metadata[key] = list(values)
        self.metadata = metadata

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def _trusted(cls, ids: list[str], seqlens: dict[str, list[list[int]]], data: dict[str, torch.Tensor | None],
                 metadata: dict[str, list]) -> "SequenceBatch":
        """Build WITHOUT validation: only for batches derived from already-valid ones.

        Validation costs tens of microseconds per batch and the dispatch path derives
        several batches per MFC call (select, gather, unpack); data entering from users
        or the wire still goes through ``__init__`` (see :meth:`from_wire`).
        """
        b = object.__new__(cls)
        b.ids, b.seqlens, b.data, b.metadata = ids, seqlens, data, metadata
        return b

    @classmethod
    def from_samples(
        cls,
        ids: Sequence[str],
        data: dict[str, Sequence[torch.Tensor | Sequence[torch.Tensor]]],
        metadata: dict[str, list] | None = None,
    ) -> "SequenceBatch":
        """Build a packed batch from per-sample tensors.

        ``data[key][i]`` is either one tensor (a sample with one sequence) or a
        list of tensors (a group of sequences); each tensor's dim 0 is its length.
        """
        seqlens: dict[str, list[list[int]]] = {}
        packed: dict[str, torch.Tensor | None] = {}
        for key, per_sample in data.items():
            if len(per_sample) != len(ids):
                raise BatchError(f"key {key!r}: {len(per_sample)} samples given for {len(ids)} ids")
            groups = [[s] if isinstance(s, torch.Tensor) else list(s) for s in per_sample]
            flat = [t for g in groups for t in g]
            if not flat:
                raise BatchError(f"key {key!r}: no tensors given, cannot infer dtype")
            seqlens[key] = [[int(t.shape[0]) for t in g] for g in groups]
            packed[key] = torch.cat(flat, 0)
        return cls(list(ids), seqlens, packed, dict(metadata or {}))

    # ---- inspection ---------------------------------------------------------------------------

    @property
    def keys(self) -> set[str]:
        """All keys: tensor keys and metadata keys."""
        return set(self.data) | set(self.metadata)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        tens = {k: (None if t is None else (tuple(t.shape), str(t.dtype).replace("torch.", ""))) for k, t in self.data.items()}
        return f"SequenceBatch(n={len(self)}, tensors={tens}, metadata={sorted(self.metadata)})"

    def _require_key(self, key: str) -> None:
        if key not in self.seqlens:
            raise BatchError(
                f"batch has no tensor key {key!r}" + did_you_mean(key, self.seqlens)
                + f" (tensor keys: {sorted(self.seqlens)})"
            )

    def sample_tokens(self, key: str = "packed_input_ids") -> list[int]:
        """Total dim-0 length of each sample for ``key`` (the unit of balancing)."""
        self._require_key(key)
        return [sum(lens) for lens in self.seqlens[key]]

    def total_tokens(self, key: str = "packed_input_ids") -> int:
        return sum(self.sample_tokens(key))

    def cu_seqlens(self, key: str = "packed_input_ids") -> torch.Tensor:
        """Cumulative sequence boundaries (int32, starts with 0) over all sequences, for varlen attention."""
        self._require_key(key)
        flat = [x for lens in self.seqlens[key] for x in lens]
        return torch.tensor([0] + flat, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def sequences(self, key: str, index: int) -> list[torch.Tensor]:
        """The sequences of sample ``index`` for ``key`` as views of the packed tensor."""
        self._require_key(key)
        t = self.data[key]
        if t is None:
            raise BatchError(f"key {key!r} has no tensor in this metadata-only batch")
        start = sum(self.sample_tokens(key)[:index])
        out = []
        for length in self.seqlens[key][index]:
            out.append(t.narrow(0, start, length))
            start += length
        return out

    def equal(self, other: "SequenceBatch") -> bool:
        """Exact equality: ids, seqlens, metadata, tensor dtypes, shapes and values."""
        if self.ids != other.ids or self.seqlens != other.seqlens or self.metadata != other.metadata:
            return False
        if set(self.data) != set(other.data):
            return False
        for k, a in self.data.items():
            b = other.data[k]
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)):
                return False
        return True

    # ---- key and sample selection -------------------------------------------------------------

    def meta(self) -> "SequenceBatch":
        """A copy without tensors (ids, seqlens, metadata): what the master keeps."""
        return SequenceBatch._trusted(list(self.ids), dict(self.seqlens), {k: None for k in self.data},
                                      dict(self.metadata))

    def select_keys(self, keys: Iterable[str]) -> "SequenceBatch":
        """A batch with only ``keys`` (tensor or metadata); an unknown key is an error."""
        keys = list(keys)
        for k in keys:
            if k not in self.seqlens and k not in self.metadata:
                raise BatchError(
                    f"batch has no key {k!r}" + did_you_mean(k, self.keys)
                    + f" (keys: {sorted(self.keys)})"
                )
        return SequenceBatch._trusted(
            list(self.ids),
            {k: self.seqlens[k] for k in keys if k in self.seqlens},
            {k: self.data[k] for k in keys if k in self.data},
            {k: list(self.metadata[k]) for k in keys if k in self.metadata},
        )

    def select_ids(self, ids: Sequence[str]) -> "SequenceBatch":
        """The samples ``ids`` in the given order; unknown or repeated ids are errors."""
        pos = {i: p for p, i in enumerate(self.ids)}
        idx = []
        for i in ids:
            if i not in pos:
                raise BatchError(f"sample id {i!r} is not in this batch ({len(self)} samples)")
            idx.append(pos[i])
        if len(set(idx)) != len(idx):
            raise BatchError("select_ids: repeated ids in the request")
        return self._select_positions(idx)

    def _select_positions(self, idx: list[int]) -> "SequenceBatch":
        data: dict[str, torch.Tensor | None] = {}
        for key, t in self.data.items():
            if t is None:
                data[key] = None
                continue
            per = self.sample_tokens(key)
            starts = [0, *itertools.accumulate(per)]
            if not idx:
                data[key] = t[:0]
            else:
                data[key] = _gather_rows(t, [starts[p] for p in idx], [per[p] for p in idx])
        return SequenceBatch._trusted(
            [self.ids[p] for p in idx],
            {k: [v[p] for p in idx] for k, v in self.seqlens.items()},
            data,
            {k: [v[p] for p in idx] for k, v in self.metadata.items()},
        )

    def remap_keys(self, mapping: dict[str, str]) -> "SequenceBatch":
        """A batch with keys renamed ``old -> new`` (graph keys <-> interface keys)."""
        for old in mapping:
            if old not in self.keys:
                raise BatchError(f"remap_keys: batch has no key {old!r} (keys: {sorted(self.keys)})")
        new_names = [mapping.get(k, k) for k in self.keys]
        dup = sorted({k for k in new_names if new_names.count(k) > 1})
        if dup:
            raise BatchError(f"remap_keys: key(s) {dup} would appear twice after renaming with {mapping}")
        ren = lambda d: {mapping.get(k, k): v for k, v in d.items()}  # noqa: E731
        return SequenceBatch._trusted(list(self.ids), ren(self.seqlens), ren(self.data), ren(self.metadata))

    def update_(self, other: "SequenceBatch") -> "SequenceBatch":
        """Merge ``other``'s keys into this batch in place (same ids; order may differ).

        Keys present in both are replaced by ``other``'s, like ``dict.update``.
        """
        if set(other.ids) != set(self.ids):
            missing = sorted(set(self.ids) - set(other.ids))[:3]
            extra = sorted(set(other.ids) - set(self.ids))[:3]
            raise BatchError(f"update_: batches hold different samples (missing e.g. {missing}, extra e.g. {extra})")
        if other.ids != self.ids:
            other = other.select_ids(self.ids)
        seqlens, data, metadata = dict(self.seqlens), dict(self.data), dict(self.metadata)
        for k in other.keys:  # a key may change kind (metadata <-> tensor)
            for d in (seqlens, data, metadata):
                d.pop(k, None)
        seqlens.update(other.seqlens)
        data.update(other.data)
        metadata.update(other.metadata)
        self.seqlens, self.data, self.metadata = seqlens, data, metadata
        return self

    # ---- splitting and joining ----------------------------------------------------------------

    def unpack(self) -> list["SequenceBatch"]:
        """One single-sample batch per sample (views of the packed tensors)."""
        offsets = {k: 0 for k in self.data}
        out = []
        for p, sid in enumerate(self.ids):
            data: dict[str, torch.Tensor | None] = {}
            for k, t in self.data.items():
                n = sum(self.seqlens[k][p])
                data[k] = None if t is None else t.narrow(0, offsets[k], n)
                offsets[k] += n
            out.append(SequenceBatch._trusted(
                [sid],
                {k: [v[p]] for k, v in self.seqlens.items()},
                data,
                {k: [v[p]] for k, v in self.metadata.items()},
            ))
        return out

    @classmethod
    def gather(cls, batches: Sequence["SequenceBatch"]) -> "SequenceBatch":
        """Concatenate batches with identical key sets (and per-key dtype); ids must stay unique."""
        if not batches:
            raise BatchError("gather: got an empty list of batches")
        first = batches[0]
        for j, b in enumerate(batches[1:], 1):
            if set(b.data) != set(first.data) or set(b.metadata) != set(first.metadata):
                diff = sorted(b.keys ^ first.keys)
                raise BatchError(f"gather: batch {j} has different keys than batch 0 (differing keys: {diff})")
        seen: set[str] = set()
        for b in batches:
            for i in b.ids:
                if i in seen:
                    raise BatchError(f"gather: duplicate sample id {i!r}")
                seen.add(i)
        data: dict[str, torch.Tensor | None] = {}
        for k in first.data:
            ts = [b.data[k] for b in batches]
            if all(t is None for t in ts):
                data[k] = None
                continue
            if any(t is None for t in ts):
                raise BatchError(f"gather: key {k!r} has a tensor in some batches and none (metadata-only) in others")
            ref = ts[0]
            for t in ts[1:]:
                if t.dtype != ref.dtype or t.shape[1:] != ref.shape[1:] or t.device != ref.device:
                    raise BatchError(
                        f"gather: key {k!r} mixes {ref.dtype}{list(ref.shape[1:])}@{ref.device} "
                        f"and {t.dtype}{list(t.shape[1:])}@{t.device}"
                    )
            data[k] = ts[0] if len(ts) == 1 else torch.cat(ts, 0)
        return cls._trusted(
            [i for b in batches for i in b.ids],
            {k: [lens for b in batches for lens in b.seqlens[k]] for k in first.seqlens},
            data,
            {k: [v for b in batches for v in b.metadata[k]] for k in first.metadata},
        )

    def split_balanced_with_index(self, n: int, key: str = "packed_input_ids") -> tuple[list["SequenceBatch"], list[list[int]]]:
        """Like :meth:`split_balanced`, also returning each part's sample positions in ``self``.

        ``SequenceBatch.gather(outputs).select_ids(batch.ids)`` restores the
        original order of per-part results; the positions serve callers that
        hold plain per-sample lists instead.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BatchError(f"split_balanced: n must be an integer >= 1, got {n!r}")
        if len(self) < n:
            raise BatchError(f"split_balanced: cannot split {len(self)} samples into {n} non-empty parts")
        parts = _lpt_partition(self.sample_tokens(key), n)
        return [self._select_positions(p) for p in parts], parts

    def split_balanced(self, n: int, key: str = "packed_input_ids") -> list["SequenceBatch"]:
        """Deterministic token-balanced split into ``n`` non-empty parts (e.g. data-parallel ranks).

        Samples stay whole (a group of sequences never straddles parts) and keep
        their relative order inside each part.
        """
        return self.split_balanced_with_index(n, key)[0]

    def micro_batches_with_index(self, spec: MicroBatchSpec, key: str = "packed_input_ids", *,
                                 packed: bool = False) -> tuple[list["SequenceBatch"], list[list[int]]]:
        """Like :meth:`micro_batches`, also returning each part's sample positions in ``self``."""
        self._require_key(key)
        if spec.max_tokens_per_mb is None or packed:  # cost = real tokens: packed under the budget
            parts = _pack_partition(self.sample_tokens(key), spec.n_mbs, spec.max_tokens_per_mb)
        else:  # micro-batches run padded: group similar lengths under the padded budget
            parts = padded_partition(self.seqlens[key], spec.n_mbs, spec.max_tokens_per_mb)
        return [self._select_positions(p) for p in parts], parts

    def micro_batches(self, spec: MicroBatchSpec, key: str = "packed_input_ids", *,
                      packed: bool = False) -> list["SequenceBatch"]:
        """Cut into micro-batches: with ``spec.max_tokens_per_mb``, similar lengths together so
        that each runs padded (sequences x longest) within it (:mod:`realflow.api.padded_partition`),
        or, ``packed`` (an engine that runs micro-batches pad-free: their cost is their real tokens),
        as few parts as fit the budget in real tokens; without a budget, token-balanced parts. At
        least ``min(spec.n_mbs, len(self))`` parts; no sample is ever dropped."""
        return self.micro_batches_with_index(spec, key, packed=packed)[0]

    # ---- wire format --------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """A plain dict of msgpack-able values and tensors (the comm codec ships tensors zero-copy)."""
        for k, values in self.metadata.items():
            _check_plain(values, repr(k))
        return {
            "ids": list(self.ids),
            "seqlens": {k: [list(lens) for lens in v] for k, v in self.seqlens.items()},
            "data": dict(self.data),
            "metadata": {k: list(v) for k, v in self.metadata.items()},
        }

    def meta_wire(self) -> dict[str, Any]:
        """``meta().to_wire()`` without the copies: for a reply that is encoded at once.

        The dict shares the batch's lists, so encode it before the batch changes.
        """
        for k, values in self.metadata.items():
            _check_plain(values, repr(k))
        return {"ids": self.ids, "seqlens": self.seqlens, "data": dict.fromkeys(self.data), "metadata": self.metadata}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "SequenceBatch":
        """Inverse of :meth:`to_wire`; validates everything (the wire is an edge of the system)."""
        if not isinstance(d, dict) or set(d) != {"ids", "seqlens", "data", "metadata"}:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise BatchError(f"from_wire: expected a dict with ids/seqlens/data/metadata, got {got}")
        return cls(list(d["ids"]), dict(d["seqlens"]), dict(d["data"]), dict(d["metadata"]))
