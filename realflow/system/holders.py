"""Which model workers hold which sample keys: the master's map of the data plane.

The master never holds tensors; it only tracks, for every (sample, key), the workers
that have it (the worker that loaded or produced it, and every worker it was staged
to). The map is stored per key and worker as a set of sample ids. Why: the frequent
operations are whole-batch ones (an MFC's outputs arrive for all its samples, a step's
samples are dropped together, "does this worker already hold every input?"), and on
sets they are one C-level operation per key and worker instead of a Python loop per
sample and key. Per-sample questions (who sends a sample a worker lacks) only arise
for the samples that actually move.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

_NOBODY: frozenset = frozenset()


class MissingKeyError(KeyError):
    """No worker holds ``key`` of sample ``sample_id``."""

    def __init__(self, sample_id: str, key: str) -> None:
        super().__init__(f"no worker holds key '{key}' of sample '{sample_id}'")
        self.sample_id = sample_id
        self.key = key

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class HolderIndex:
    """(sample, key) -> workers holding it, stored as key -> worker -> set of sample ids."""

    def __init__(self) -> None:
        self._by_key: dict[str, dict[int, set[str]]] = {}

    def add(self, ids: Iterable[str], keys: Iterable[str], worker: int) -> None:
        """Record that ``worker`` holds every key of ``keys`` for every sample of ``ids``."""
        ids = ids if isinstance(ids, (list, tuple, set, frozenset)) else list(ids)
        for key in keys:
            per_worker = self._by_key.get(key)
            if per_worker is None:
                per_worker = self._by_key[key] = {}
            held = per_worker.get(worker)
            if held is None:
                per_worker[worker] = set(ids)
            else:
                held.update(ids)

    def holders(self, sample_id: str, key: str) -> list[int]:
        """The workers holding ``key`` of ``sample_id``, in worker order."""
        return sorted(w for w, held in self._by_key.get(key, {}).items() if sample_id in held)

    def missing(self, ids: Sequence[str], keys: Iterable[str], dest: int) -> dict[tuple[int, tuple[str, ...]], list[str]]:
        """What ``dest`` lacks of ``keys`` for ``ids``, grouped as (sender, keys) -> sample ids.

        The sender of a (sample, key) is the lowest-numbered worker holding it, so plans
        are deterministic. Raises MissingKeyError when nobody holds one of them.
        """
        lacking: dict[str, dict[int, list[str]]] = {}  # sample -> sender -> keys
        for key in keys:
            per_worker = self._by_key.get(key, {})
            have = per_worker.get(dest, _NOBODY)
            if have.issuperset(ids):  # the usual case: dest already holds every sample
                continue
            others = sorted((w, held) for w, held in per_worker.items() if w != dest)
            for sid in ids:
                if sid in have:
                    continue
                sender = next((w for w, held in others if sid in held), None)
                if sender is None:
                    raise MissingKeyError(sid, key)
                lacking.setdefault(sid, {}).setdefault(sender, []).append(key)
        if not lacking:
            return {}
        groups: dict[tuple[int, tuple[str, ...]], list[str]] = defaultdict(list)
        for sid, per_sender in lacking.items():
            for sender, sender_keys in per_sender.items():
                groups[(sender, tuple(sender_keys))].append(sid)
        return dict(groups)

    def unheld(self, ids: Sequence[str], key: str) -> list[str]:
        """The samples of ``ids`` that no worker holds ``key`` of, in order."""
        sets = list(self._by_key.get(key, {}).values())
        return [sid for sid in ids if not any(sid in held for held in sets)]

    def drop(self, ids: Iterable[str]) -> None:
        """Forget the samples ``ids`` everywhere (they left the system at the end of a step)."""
        gone = set(ids)
        for per_worker in self._by_key.values():
            for held in per_worker.values():
                held.difference_update(gone)

    def __contains__(self, item: tuple[str, str]) -> bool:
        sample_id, key = item
        return any(sample_id in held for held in self._by_key.get(key, {}).values())
