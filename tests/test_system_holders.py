"""The master's map of who holds which (sample, key), and data-parallel placement on top of it."""
from __future__ import annotations

import pytest
import torch

from realflow.api.allocation import ParallelStrategy
from realflow.api.batch import SequenceBatch
from realflow.api.layout import Layout
from realflow.system.holders import HolderIndex, MissingKeyError
from realflow.system.placement import assign_to_dp_ranks


def test_add_holders_drop():
    h = HolderIndex()
    h.add(["a", "b"], ["x", "y"], 0)
    h.add(["b"], ["x"], 2)
    h.add(iter(["c"]), ("x",), 1)  # any iterable of ids
    assert h.holders("b", "x") == [0, 2] and h.holders("a", "y") == [0] and h.holders("c", "x") == [1]
    assert h.holders("zz", "x") == [] and h.holders("a", "nokey") == []
    assert ("a", "x") in h and ("c", "y") not in h
    assert h.unheld(["a", "c", "d"], "y") == ["c", "d"]
    h.drop(["b", "c"])
    assert h.holders("b", "x") == [] and h.holders("c", "x") == [] and h.holders("a", "x") == [0]


def test_missing_groups_by_sender_and_keys():
    h = HolderIndex()
    h.add(["s1", "s2", "s3"], ["ids"], 0)
    h.add(["s1", "s2", "s3"], ["ids"], 1)  # a second copy: the lowest-numbered holder sends
    h.add(["s2"], ["reward"], 2)
    h.add(["s1", "s3"], ["reward"], 1)
    h.add(["s3"], ["ids", "reward"], 3)
    assert h.missing(["s1", "s2", "s3"], ["ids", "reward"], dest=3) == {
        (0, ("ids",)): ["s1", "s2"], (1, ("reward",)): ["s1"], (2, ("reward",)): ["s2"]}
    assert h.missing(["s3"], ["ids", "reward"], dest=3) == {}  # holds everything: nothing moves
    assert h.missing(["s1"], ["ids", "reward"], dest=4) == {(0, ("ids",)): ["s1"], (1, ("reward",)): ["s1"]}
    assert h.missing(["s2"], ["ids", "reward"], dest=4) == {(0, ("ids",)): ["s2"], (2, ("reward",)): ["s2"]}


def test_missing_names_sample_and_key():
    h = HolderIndex()
    h.add(["s1"], ["ids"], 0)
    with pytest.raises(MissingKeyError, match="no worker holds key 'ids' of sample 's2'"):
        h.missing(["s1", "s2"], ["ids"], dest=1)
    with pytest.raises(MissingKeyError, match="key 'values' of sample 's1'"):
        h.missing(["s1"], ["ids", "values"], dest=0)


def _batch(lengths: list[int]) -> SequenceBatch:
    ids = [f"s{i}" for i in range(len(lengths))]
    return SequenceBatch(ids=ids, seqlens={"packed_input_ids": [[n] for n in lengths]},
                         data={"packed_input_ids": torch.zeros(sum(lengths), dtype=torch.long)})


def test_placement_balances_tokens_and_prefers_holders():
    layout = Layout((0, 1), ParallelStrategy(dp=2, tp=1, pp=1))
    batch = _batch([10, 10, 10, 10])
    h = HolderIndex()
    h.add(["s0", "s1"], ["packed_input_ids"], 1)  # rank 1 holds s0, s1: they stay there
    h.add(["s2", "s3"], ["packed_input_ids"], 0)
    parts = assign_to_dp_ranks(batch, layout, h)
    assert parts == {0: ["s2", "s3"], 1: ["s0", "s1"]}
    # worker 0 holds everything: it keeps what fits in 10% over the balanced load (40 * 1.1 tokens) and
    # at most ceil(5 / 2) samples; the rest goes to the least loaded rank, longest first
    skewed = _batch([40, 10, 10, 10, 10])
    h2 = HolderIndex()
    h2.add(skewed.ids, ["packed_input_ids"], 0)
    assert assign_to_dp_ranks(skewed, layout, h2) == {0: ["s0", "s4"], 1: ["s1", "s2", "s3"]}
