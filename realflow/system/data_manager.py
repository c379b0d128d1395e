"""Per-worker store of sample tensors.

A model worker keeps every sample key it loaded or produced until the master says
the step no longer needs it. Tensors never pass through the master: when another
worker needs some keys, this worker *stages* them into shared memory and the master
forwards only the small handle (see ``realflow.comm.shm``).

Storage is by *chunk*: each batch that arrives (a fetched shard, an MFC's output, a
received transfer) is kept whole, and an index maps ``(sample id, key)`` to its chunk
and row. The common read — the next MFC on this worker asks for exactly the samples of
one chunk, in the same order — is then a key selection with no tensor work at all;
reads that mix chunks fall back to per-sample gathering. A chunk is released when
none of its entries is referenced any more (dropped or overwritten).
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, NoReturn

from realflow.api.batch import SequenceBatch
from realflow.comm import shm


class DataManager:
    def __init__(self, worker_name: str, shm_prefix: str = shm.DEFAULT_PREFIX):
        self.worker_name = worker_name
        self._chunks: dict[int, SequenceBatch] = {}
        self._live: dict[int, int] = {}  # chunk id -> number of index entries pointing at it
        self._index: dict[str, dict[str, int]] = {}  # sample id -> key -> chunk id
        self._next_chunk = itertools.count()
        # pre-faulted segments: writing fresh tmpfs pages costs ~3x a memcpy
        self._pool = shm.ShmPool(shm_prefix)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def n_chunks(self) -> int:
        return len(self._chunks)

    def has(self, sample_id: str, key: str) -> bool:
        return key in self._index.get(sample_id, ())

    def put(self, batch: SequenceBatch) -> None:
        """Store every sample of ``batch``; its keys replace the same keys held before."""
        cid = next(self._next_chunk)
        keys = list(batch.seqlens) + list(batch.metadata)
        self._chunks[cid] = batch
        self._live[cid] = len(batch.ids) * len(keys)
        for sid in batch.ids:
            entry = self._index.setdefault(sid, {})
            for k in keys:
                old = entry.get(k)
                entry[k] = cid
                if old is not None:
                    self._unref(old)
        if self._live[cid] == 0:
            self._unref(cid, 0)

    def get(self, ids: Iterable[str], keys: Iterable[str]) -> SequenceBatch:
        """The samples ``ids`` restricted to ``keys``, packed in the given order."""
        ids, keys = list(ids), list(keys)
        entries = list(map(self._index.get, ids))
        try:
            cids = {entry[k] for entry in entries for k in keys}
        except (KeyError, TypeError):  # a sample (None entry) or one of its keys is not here
            self._raise_missing(ids, keys)
        if len(cids) == 1:
            chunk = self._chunks[cids.pop()]
            if chunk.ids == ids:  # fast path: a whole stored batch, in order
                return chunk.select_keys(keys)
            return chunk.select_ids(ids).select_keys(keys)
        chunk_of = [[entry[k] for k in keys] for entry in entries]
        if ids and all(per == chunk_of[0] for per in chunk_of):
            # every sample spreads its keys over the same chunks: merge key groups
            merged = None
            for cid in dict.fromkeys(chunk_of[0]):
                part_keys = [k for k, c in zip(keys, chunk_of[0]) if c == cid]
                chunk = self._chunks[cid]
                part = chunk if chunk.ids == ids else chunk.select_ids(ids)
                part = part.select_keys(part_keys)
                merged = part if merged is None else merged.update_(part)
            return merged.select_keys(keys)
        parts = []
        for sid, per in zip(ids, chunk_of):
            sample = None
            for cid in dict.fromkeys(per):
                part_keys = [k for k, c in zip(keys, per) if c == cid]
                piece = self._chunks[cid].select_ids([sid]).select_keys(part_keys)
                sample = piece if sample is None else sample.update_(piece)
            parts.append(sample.select_keys(keys))
        return SequenceBatch.gather(parts)

    def _raise_missing(self, ids: list[str], keys: list[str]) -> NoReturn:
        for sid in ids:
            entry = self._index.get(sid)
            if entry is None:
                raise KeyError(f"worker {self.worker_name} holds no sample '{sid}'")
            missing = [k for k in keys if k not in entry]
            if missing:
                raise KeyError(
                    f"worker {self.worker_name} holds sample '{sid}' without keys {missing} "
                    f"(has {sorted(entry)})"
                )
        raise AssertionError("_raise_missing called for samples that are all here")

    def drop(self, ids: Iterable[str]) -> int:
        n = 0
        for sid in ids:
            entry = self._index.pop(sid, None)
            if entry is None:
                continue
            n += 1
            for cid in entry.values():
                self._unref(cid)
        return n

    def _unref(self, cid: int, n: int = 1) -> None:
        self._live[cid] -= n
        if self._live[cid] <= 0:
            del self._live[cid], self._chunks[cid]

    # ---- data plane -------------------------------------------------------------
    def stage(self, ids: list[str], keys: list[str]) -> dict[str, Any]:
        """Put ``keys`` of ``ids`` into shared memory; return a msgpack-able handle."""
        batch = self.get(ids, keys)
        wire = batch.to_wire()
        tensors = {k: v for k, v in wire["data"].items() if v is not None}
        wire["data"] = {k: None for k in wire["data"]}
        return {"batch": wire, "shm": self._pool.put_tensors(tensors)}

    def close(self) -> None:
        self._pool.close()

    def receive(self, handle: dict[str, Any]) -> SequenceBatch:
        """Map a staged handle from another worker and store its samples."""
        tensors = shm.take_tensors(handle["shm"])
        wire = dict(handle["batch"])
        wire["data"] = {k: tensors.get(k) for k in wire["data"]}
        batch = SequenceBatch.from_wire(wire)
        self.put(batch)
        return batch
