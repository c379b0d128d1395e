"""StatsLogger writes TensorBoard events that TensorBoard itself reads, plus jsonl."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from realflow.base.stats import StatsLogger, read_jsonl, reduce_stats, weighted_mean

pytestmark = pytest.mark.timeout(60)


def test_tensorboard_and_jsonl_round_trip(tmp_path):
    with StatsLogger(tmp_path / "run") as sl:
        for step in range(3):
            sl.log(step, {"loss": 1.0 / (step + 1), "tokens": np.int64(100 * step), "lr": torch.tensor(0.5)},
                   prefix="actor_train")
        sl.log(3, {"loss": float("nan")}, prefix="actor_train")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"actor_train/loss", "actor_train/tokens", "actor_train/lr"}
    loss = acc.Scalars("actor_train/loss")
    assert [e.step for e in loss] == [0, 1, 2, 3]
    assert [e.value for e in loss[:3]] == pytest.approx([1.0, 0.5, 1 / 3])
    assert math.isnan(loss[3].value)
    assert [e.value for e in acc.Scalars("actor_train/tokens")] == [0, 100, 200]

    rows = read_jsonl(tmp_path / "run" / "stats.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["actor_train/loss"] == 0.5 and rows[1]["actor_train/lr"] == 0.5
    assert math.isnan(rows[3]["actor_train/loss"]) and "time" in rows[0]


def test_bad_stats_are_named(tmp_path):
    with StatsLogger(tmp_path, tensorboard=False) as sl:
        with pytest.raises(TypeError, match="stat 'x/vec' must be a scalar number"):
            sl.log(0, {"vec": torch.ones(3)}, prefix="x")
        with pytest.raises(ValueError, match="stat name 'step' is reserved"):
            sl.log(0, {"step": 1})
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            sl.log(-1, {"a": 1})
    assert not (tmp_path / "tensorboard").exists()


def test_reduce_stats():
    per_worker = [{"loss": 1.0, "n_tokens": 10, "mem": 3.0}, {"loss": 3.0, "n_tokens": 30, "mem": 5.0},
                  {"n_tokens": 5, "mem": 1.0}]  # e.g. a rank that does not compute the loss
    out = reduce_stats(per_worker, {"n_tokens": "sum", "mem": "max"})
    assert out == {"loss": 2.0, "n_tokens": 45.0, "mem": 5.0}
    assert reduce_stats(per_worker, "min") == {"loss": 1.0, "n_tokens": 5.0, "mem": 1.0}
    assert weighted_mean([1.0, 3.0], [10, 30]) == 2.5
    with pytest.raises(ValueError, match="unknown reduce op 'median' for stat 'loss'"):
        reduce_stats(per_worker, {"loss": "median"})
    with pytest.raises(TypeError, match=r"stat 'loss' must be a scalar number.*from worker 1"):
        reduce_stats([{"loss": 1.0}, {"loss": "high"}])


def test_mismatch_histogram_reaches_tensorboard(tmp_path):
    """The per-token |delta log p| shares of a train step (mfc.mismatch's ``mismatch/hist_<i>``) become
    one TensorBoard histogram per step, beside their scalars."""
    import torch as t

    from mfc.mismatch import gap_means, gap_stats
    from realflow.base.stats import DECADE_EDGES, decade_histograms

    train = -t.rand(200, generator=t.Generator().manual_seed(0)) * 3
    gen = train + t.cat([t.full((150,), 1e-7), t.full((50,), 0.3)])
    row = gap_means(gap_stats(train, gen, t.ones(200, dtype=t.bool)))
    assert row["mismatch/hist_0"] == pytest.approx(0.75) and row["mismatch/hist_6"] == pytest.approx(0.25)
    assert decade_histograms(row) == {"mismatch": [row[f"mismatch/hist_{i}"] for i in range(len(DECADE_EDGES) + 1)]}
    with StatsLogger(tmp_path / "run") as sl:
        sl.log(1, row, prefix="actor_train")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["histograms"] == ["actor_train/mismatch/hist"]
    (h,) = acc.Histograms("actor_train/mismatch/hist")
    assert h.step == 1 and h.histogram_value.num == pytest.approx(1.0)
    assert list(h.histogram_value.bucket) == pytest.approx([row[f"mismatch/hist_{i}"] for i in range(9)])
