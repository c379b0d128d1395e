"""Per-worker store of sample tensors.

A model worker keeps every sample key it loaded or produced until the master says
the step no longer needs it. Tensors never pass through the master: when another
worker needs some keys, this worker *stages* them into shared memory and the master
forwards only the small handle (see ``realflow.comm.shm``).
"""
from __future__ import annotations

from typing import Any, Iterable

from realflow.api.batch import SequenceBatch
from realflow.comm import shm


class DataManager:
    def __init__(self, worker_name: str, shm_prefix: str = shm.DEFAULT_PREFIX):
        self.worker_name = worker_name
        self._samples: dict[str, SequenceBatch] = {}
        # pre-faulted segments: writing fresh tmpfs pages costs ~3x a memcpy
        self._pool = shm.ShmPool(shm_prefix)

    def __len__(self) -> int:
        return len(self._samples)

    def has(self, sample_id: str, key: str) -> bool:
        s = self._samples.get(sample_id)
        return s is not None and key in s.seqlens

    def put(self, batch: SequenceBatch) -> None:
        """Store every sample of ``batch``, merging keys with what is already held."""
        for sample in batch.unpack():
            sid = sample.ids[0]
            held = self._samples.get(sid)
            if held is None:
                self._samples[sid] = sample
            else:
                held.update_(sample)

    def get(self, ids: Iterable[str], keys: Iterable[str]) -> SequenceBatch:
        """The samples ``ids`` restricted to ``keys``, packed in the given order."""
        keys = list(keys)
        parts = []
        for sid in ids:
            sample = self._samples.get(sid)
            if sample is None:
                raise KeyError(f"worker {self.worker_name} holds no sample '{sid}'")
            missing = [k for k in keys if k not in sample.seqlens]
            if missing:
                raise KeyError(
                    f"worker {self.worker_name} holds sample '{sid}' without keys {missing} "
                    f"(has {sorted(sample.seqlens)})"
                )
            parts.append(sample.select_keys(keys))
        return SequenceBatch.gather(parts)

    def drop(self, ids: Iterable[str]) -> int:
        n = 0
        for sid in ids:
            n += self._samples.pop(sid, None) is not None
        return n

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
