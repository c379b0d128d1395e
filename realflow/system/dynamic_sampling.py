"""Dynamic sampling (DAPO) in a synchronous step: keep drawing prompts until the batch is full of
groups that teach something.

A group whose rewards are all equal (every response right, or every one wrong) has zero
advantage under group normalisation: it costs a training step's compute and moves nothing. With
``setup.group_filter`` the master runs the rollout part of the graph (every topological
generation up to the one producing the filter key), asks the workers holding that key for each
sample's spread (max - min), drops the samples with none, and fetches and rolls out more until
``batch_size`` samples are kept -- each extra round draws a whole batch more (DAPO over-samples
too), at most ``max_extra_rounds`` of them, then a clear error; samples kept beyond the batch
are dropped.
The training part of the graph then runs on exactly ``batch_size`` kept samples.
"""
from __future__ import annotations

from typing import Any

from realflow.api.batch import SequenceBatch
from realflow.api.mfc import MFCDef


class DynamicSamplingError(RuntimeError):
    """The batch did not fill with informative groups within the allowed extra rounds."""


def split_generations(generations: list[list[str]], mfcs: dict[str, MFCDef], key: str
                      ) -> tuple[list[list[str]], list[list[str]]]:
    """(rollout generations: up to the one whose MFC produces ``key``; the rest)."""
    for i, gen in enumerate(generations):
        if any(key in mfcs[n].output_keys for n in gen):
            return generations[:i + 1], generations[i + 1:]
    raise ValueError(f"dynamic sampling filters on key {key!r}, but no MFC of the graph produces it "
                     f"(outputs: {sorted({k for m in mfcs.values() for k in m.output_keys})})")


def sample_until_full(master: Any, batch: SequenceBatch, rollout: list[list[str]], stats: dict[str, float]
                      ) -> SequenceBatch:
    """Run ``rollout`` on ``batch`` and on more fetched samples until ``master.batch_size`` of them
    have a spread in the filter key; returns them (the rest dropped everywhere). Adds to ``stats``:
    ``dynamic_sampling/dropped_groups``, ``extra_rounds`` and ``kept_frac``."""
    spec = master.setup.group_filter
    want = master.batch_size
    kept: list[SequenceBatch] = []
    n_kept = n_dropped = n_seen = rounds = 0
    current = batch
    while True:
        results = master.run_generations(rollout, current)
        if rounds == 0:  # the first round's stats describe the step
            stats.update(results)
        spread = _spreads(master, current.ids, spec.key)
        keep = [i for i in current.ids if spread[i] > 0][:want - n_kept]
        drop = [i for i in current.ids if i not in set(keep)]
        n_seen += len(current.ids)
        n_dropped += sum(1 for i in current.ids if spread[i] <= 0)
        master.drop_samples(drop)
        if keep:
            kept.append(current.select_ids(keep))
            n_kept += len(keep)
        if n_kept >= want:
            break
        if rounds >= spec.max_extra_rounds:
            raise DynamicSamplingError(
                f"dynamic sampling: after {rounds} extra round(s) only {n_kept} of batch_size={want} groups had "
                f"rewards that differ ({n_dropped} of {n_seen} drawn were all equal); raise "
                f"ppo.dynamic_sampling_max_rounds (now {spec.max_extra_rounds}), or the task is too easy or too hard "
                f"for the model")
        rounds += 1
        current = master.fetch_batch(want)  # a whole batch's worth: few rounds even when most groups drop
    stats["dynamic_sampling/dropped_groups"] = float(n_dropped)
    stats["dynamic_sampling/extra_rounds"] = float(rounds)
    stats["dynamic_sampling/kept_frac"] = n_kept / max(n_seen, 1)
    return SequenceBatch.gather(kept)


def _spreads(master: Any, ids: list[str], key: str) -> dict[str, float]:
    """Each sample's spread of ``key``, asked of one worker holding it."""
    by_worker: dict[int, list[str]] = {}
    for sid in ids:
        holders = master.holders.holders(sid, key)
        if not holders:
            raise DynamicSamplingError(f"dynamic sampling: no worker holds {key!r} for sample {sid!r}")
        by_worker.setdefault(holders[0], []).append(sid)
    out: dict[str, float] = {}
    for w, sids in sorted(by_worker.items()):
        reply = master.call(w, "spread", {"ids": sids, "key": key}, 120.0)
        out.update(reply["spread"])
    return out
