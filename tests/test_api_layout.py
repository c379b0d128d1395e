"""Layout: megatron grid order (the one parallel.groups builds groups in), dp heads, and the checks on its workers."""
from __future__ import annotations

import itertools

import pytest

from realflow.api.allocation import AllocationError, ParallelStrategy
from realflow.api.layout import Layout


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (3, 2, 1)])
def test_grid_order_is_megatrons(dp, tp, pp):
    s = ParallelStrategy(dp=dp, tp=tp, pp=pp)
    workers = [10 + 3 * i for i in range(s.world_size)]  # not 0..n-1: positions and ids must not be confused
    lay = Layout(tuple(workers), s)
    for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
        w = lay.worker_at(d, t, p)
        assert w == workers[p * dp * tp + d * tp + t]  # tp fastest, then dp, then pp (parallel.groups builds on it)
        assert lay.coords(w) == (d, t, p)
        assert lay.grid()[p][d][t] == w
    for d in range(dp):
        members = lay.dp_members(d)
        assert len(members) == tp * pp and all(lay.coords(w)[0] == d for w in members)
        head = lay.dp_head(d)
        assert lay.coords(head) == (d, 0, pp - 1)  # tp rank 0 of the last stage holds the outputs
    assert lay.dp_heads() == tuple(lay.dp_head(d) for d in range(dp))


def test_workers_are_normalised_and_layouts_compare_by_value():
    s = ParallelStrategy(dp=2)
    assert Layout([0, 1], s) == Layout((0, 1), s)
    assert Layout([0, 1], s).workers == (0, 1)
    assert hash(Layout([0, 1], s)) == hash(Layout((0, 1), s))  # used as dict keys by the model store
    assert str(Layout((4, 5), s)) == "d2t1p1@[4, 5]"


@pytest.mark.parametrize("workers,strategy,message", [
    ((0, 1), ParallelStrategy(tp=4), "needs 4 workers"),
    ((0, 0), ParallelStrategy(dp=2), "distinct"),
    ((-1, 0), ParallelStrategy(dp=2), ">= 0"),
])
def test_bad_workers_name_the_layout(workers, strategy, message):
    with pytest.raises(AllocationError, match=message) as e:
        Layout(workers, strategy)
    assert str(strategy) in str(e.value)


def test_coords_of_a_foreign_worker_fails():
    with pytest.raises(ValueError):
        Layout((0, 1), ParallelStrategy(dp=2)).coords(7)
