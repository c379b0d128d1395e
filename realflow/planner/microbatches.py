"""The micro-batches one rank runs an MFC's batch as, for the cost model.

Why not always "tokens / budget" micro-batches of the mean length: an engine without packed
attention (megatron's own attention on a CPU, ``training.pad_free=off``) runs each micro-batch
padded to its longest sequence, and the runtime groups
sequences of similar length to waste little (:func:`realflow.api.padded_partition.padded_partition`,
called here with the runtime's own budget and per-micro-batch overhead: no second copy of its
rules). A 64-sequence PPO update here ran as 48 short sequences and 16 long ones, not one block of
64 x the longest; and a micro-batch's cost per token is not constant (the calibrated curve), so
the shapes, not only their sum, set the time.

The planner knows a batch's mean and longest length, not every length: the batch's lengths are
drawn as normal quantiles (Blom's plotting positions) around the mean, spread so that the
batch's longest is the workload's longest, never below the shortest. Why normal: the lengths of
a GRPO update here (64 sequences, mean 11.3) ran 6..18 about symmetrically, the longest ~2.5
standard deviations out. Which sequences share a sample (a prompt's group of answers: it never
straddles micro-batches) and a rank's update decides whether a long answer gets a micro-batch of
its own: the run here split a 64-sequence update as (60, 4), (44, 20) or not at all, step to step.
Answers to one prompt are alike in part (they share the prompt; a hard problem's answers run
long), so the cost is the mean of two views, half each: alike (the lengths dealt in order, every
(dp x updates)-th to a rank's update) and independent (dealt at random, averaged over several
seeded deals). Against PPO's actor_train on one worker here (two 64-sequence updates): measured
180 ms; alike alone predicted 173, independent alone 222, the mean 197.
"""
from __future__ import annotations

import functools
import math
import random
from statistics import NormalDist
from typing import Any

from realflow.api.padded_partition import padded_partition


def synthetic_lengths(n: int, mean: float, longest: float, shortest: float) -> list[float]:
    """``n`` lengths, ascending, around ``mean`` with ``longest`` the last (see module docstring)."""
    if n <= 0:
        return []
    if n == 1 or longest <= mean:
        return [float(mean)] * n
    z = [NormalDist().inv_cdf((i + 1 - 0.375) / (n + 0.25)) for i in range(n)]
    sigma = (longest - mean) / z[-1]
    return [max(mean + sigma * zi, min(shortest, mean)) for zi in z]


DRAWS = 8  # random assignments of the lengths to samples, averaged over


@functools.lru_cache(maxsize=4096)  # the search prices the same work on many layouts
def micro_batch_shapes(work: Any, dp: int, pp: int, packed: bool) -> tuple[tuple[float, float, float], ...]:
    """``(weight, sequences, length each is computed at)`` of the micro-batches of one data-parallel
    rank's call (all its updates), the weights summing to its expected number of micro-batches.
    Packed attention: the token budget's equal split at the mean length, weight 1, each sequence
    computed at :attr:`Work.computed_len` (a group's shared prompt once). Padded: the
    runtime's partition of the synthetic lengths, dealt in order (weight 1/2) and at random
    (``DRAWS`` seeded deals, 1/2 among them); with ``pp > 1`` every micro-batch at its update's
    longest (one tensor shape through the pipeline)."""
    updates = max(int(work.updates), 1)
    seqs = max(work.seqs / dp / updates, 1.0)
    longest = max(work.seq_len_max, work.seq_len)
    if packed or longest <= work.seq_len:
        tokens = seqs * work.seq_len
        n_mbs = max(1, math.ceil(tokens / work.max_tokens_per_mb)) if work.max_tokens_per_mb else 1
        return ((1.0, seqs / n_mbs, work.computed_len if packed else work.seq_len),) * (n_mbs * updates)
    everything = synthetic_lengths(max(int(round(work.seqs)), 1), work.seq_len, longest, work.seq_len_min or 1.0)
    per_update = max(int(round(seqs)), 1)
    group = max(int(work.group), 1)
    out = []
    # (weight, lengths, in order): sorted -- a prompt's answers alike, every (dp x updates)-th to a
    # rank's update; then the random deals, a contiguous share each
    deals = [(0.5, everything[::-1], True)]
    for draw in range(DRAWS):
        dealt = list(everything)
        random.Random(draw).shuffle(dealt)
        deals.append((0.5 / DRAWS, dealt, False))
    for weight, dealt, in_order in deals:
        for u in range(updates):
            lengths = (dealt[u::updates * dp][:per_update] if in_order else
                       dealt[u * per_update:(u + 1) * per_update]) or [work.seq_len]
            samples = [lengths[i:i + group] for i in range(0, len(lengths), group)]
            parts = padded_partition(samples, 1, work.max_tokens_per_mb) if work.max_tokens_per_mb \
                else [list(range(len(samples)))]
            top = max(lengths)
            for p in parts:
                n = float(sum(len(samples[i]) for i in p))
                out.append((weight, n, top if pp > 1 else max(max(samples[i]) for i in p)))
    return tuple(out)
