"""Which data-parallel rank of an MFC processes which samples.

Ranks should get equal numbers of tokens (the slowest rank sets the pace), and a
sample should preferably go to a rank whose workers already hold it, so that fewer
tensors move. The assignment is deterministic: every run of the same plan on the
same data moves the same samples.
"""
from __future__ import annotations

from realflow.api.batch import SequenceBatch
from realflow.api.keys import INPUT_IDS
from realflow.system.holders import HolderIndex


def sample_tokens(batch: SequenceBatch) -> list[int]:
    return [sum(lens) for lens in batch.seqlens[_first_key(batch)]]


def assign_to_dp_ranks(batch: SequenceBatch, layout, holders: HolderIndex, slack: float = 0.1
                       ) -> dict[int, list[str]]:
    """Map each dp rank of ``layout`` to the ids it processes.

    Greedy longest-first: a sample goes to a rank that already holds it if that rank
    stays within ``(1 + slack)`` of the balanced load and of the balanced sample count;
    otherwise to the least loaded rank. Every rank gets at least one sample when there
    are enough. Within a rank the batch order is kept.
    """
    dp = layout.strategy.dp
    n = len(batch.ids)
    if n < dp:
        raise ValueError(f"batch of {n} samples cannot be split over {dp} data-parallel ranks")
    if dp == 1:
        return {0: list(batch.ids)}
    tokens = sample_tokens(batch)
    first_key = _first_key(batch)
    target_tokens = sum(tokens) / dp * (1 + slack)
    target_count = -(-n // dp)
    holder_rank = {w: layout.coords(w)[0] for w in layout.workers}
    load = [0] * dp
    count = [0] * dp
    chosen: dict[int, int] = {}
    for idx in sorted(range(n), key=lambda i: (-tokens[i], i)):
        sid = batch.ids[idx]
        held = {holder_rank[w] for w in holders.holders(sid, first_key) if w in holder_rank}
        best = None
        for r in sorted(held):
            if load[r] + tokens[idx] <= target_tokens and count[r] < target_count:
                best = r if best is None or load[r] < load[best] else best
        if best is None:
            best = min(range(dp), key=lambda r: (count[r] >= target_count, load[r], r))
        chosen[idx] = best
        load[best] += tokens[idx]
        count[best] += 1
    for r in range(dp):  # guarantee non-empty ranks (only matters for tiny batches)
        if count[r] == 0:
            donor = max(range(dp), key=lambda q: (count[q], q))
            idx = next(i for i in sorted(chosen) if chosen[i] == donor)
            chosen[idx] = r
            count[donor] -= 1
            count[r] += 1
    parts: dict[int, list[str]] = {r: [] for r in range(dp)}
    for idx in range(n):
        parts[chosen[idx]].append(batch.ids[idx])
    return parts


def _first_key(batch: SequenceBatch) -> str:
    """The key whose sizes stand for a sample's tokens (and whose holders say where it lives)."""
    return INPUT_IDS if INPUT_IDS in batch.seqlens else sorted(batch.seqlens)[0]
