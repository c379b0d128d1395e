"""The micro-batches the planner prices: synthetic lengths with the workload's mean and longest,
partitioned by the runtime's own padded partition (realflow.api.padded_partition)."""
from __future__ import annotations

import statistics

import pytest

from realflow.planner.cost import Work
from realflow.planner.microbatches import micro_batch_shapes, synthetic_lengths


def test_synthetic_lengths_have_the_mean_and_end_at_the_longest():
    lengths = synthetic_lengths(128, 11.8, 21.5, 7.0)
    assert lengths == sorted(lengths) and lengths[-1] == pytest.approx(21.5)
    assert statistics.mean(lengths) == pytest.approx(11.8, rel=0.02)
    assert min(lengths) >= 7.0
    assert synthetic_lengths(5, 10.0, 10.0, 1.0) == [10.0] * 5  # no spread: all the mean
    assert synthetic_lengths(0, 10.0, 20.0, 1.0) == []


def test_packed_attention_splits_the_token_budget_evenly():
    w = Work("train", seqs=64, seq_len=100, max_tokens_per_mb=1000, updates=2, seq_len_max=400)
    shapes = micro_batch_shapes(w, dp=2, pp=1, packed=True)
    assert len(shapes) == 2 * 2 and all(s == (1.0, 8.0, 100) for s in shapes)  # 16 x 100 tokens: 2 per update


def test_a_groups_shared_prompt_is_priced_once():
    """training.shared_prefix: a group of 8 answers behind one 60-token prompt computes the prompt
    once -- each sequence's rows are 100 - 60 * 7/8; the micro-batch count still follows the real
    tokens (the runtime cuts by them)."""
    w = Work("train", seqs=64, seq_len=100, max_tokens_per_mb=1000, updates=2, group=8, pad_free=True,
             shared_prompt=60)
    assert w.computed_len == pytest.approx(100 - 60 * 7 / 8)
    shapes = micro_batch_shapes(w, dp=2, pp=1, packed=True)
    assert len(shapes) == 2 * 2 and all(s == (1.0, 8.0, pytest.approx(47.5)) for s in shapes)


def test_row_savings_follow_the_models_training_options():
    """What the planner assumes an engine computes: pad-free unless ``off``; a shared prompt
    needs pad-free rows and a dense text model (MoE and VL models compute every prompt)."""
    from types import SimpleNamespace

    from realflow.planner.simulate import _row_savings

    def spec(pad_free="auto", shared_prefix="auto"):
        return SimpleNamespace(training=SimpleNamespace(pad_free=pad_free, shared_prefix=shared_prefix))
    dense, moe, vl = {"hidden_size": 8}, {"num_experts": 4}, {"vision_config": {}, "text_config": {}}
    assert _row_savings(spec(), dense) == (True, True)
    assert _row_savings(spec(shared_prefix="off"), dense) == (True, False)
    assert _row_savings(spec(pad_free="off"), dense) == (False, False)
    assert _row_savings(spec(), moe) == (True, False) and _row_savings(spec(), vl) == (True, False)
    assert _row_savings(None, dense) == (False, False)


def test_padded_micro_batches_cover_the_rank_and_weigh_to_whole_calls():
    """Every deal covers the rank's sequences of each update once; with a budget that fits them
    all, a batch with one long tail is still split when that saves more padding than a micro-
    batch costs (the runtime's overhead); with pp > 1 every micro-batch runs at the longest."""
    w = Work("train", seqs=128, seq_len=11.8, max_tokens_per_mb=8192, updates=2, seq_len_max=21.5,
             seq_len_min=7.0, group=4)
    shapes = micro_batch_shapes(w, dp=1, pp=1, packed=False)
    assert sum(wt * n for wt, n, _ in shapes) == pytest.approx(128)  # both updates' 64 sequences
    assert 2 <= sum(wt for wt, _, _ in shapes) <= 4  # expected micro-batches
    assert max(length for _, _, length in shapes) == pytest.approx(21.5)
    tight = Work("train", seqs=64, seq_len=100, max_tokens_per_mb=4096, seq_len_max=200, seq_len_min=10.0)
    for _, n, length in micro_batch_shapes(tight, dp=1, pp=1, packed=False):
        assert n * length <= 4096 + 1e-9  # the runtime's budget holds
    piped = micro_batch_shapes(w, dp=1, pp=2, packed=False)

    def padded(sh):
        return sum(wt * n * length for wt, n, length in sh)
    assert len(piped) == len(shapes) and padded(piped) > padded(shapes)  # same split, all at the longest
    assert len({length for _, _, length in piped}) <= 2 * 9  # one length per update and deal
