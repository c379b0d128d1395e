"""Parallel strategy / allocation parsing and their errors."""
from __future__ import annotations

import pytest

from realflow.api.allocation import (
    STRATEGY_GRAMMAR, Allocation, AllocationError, DeviceMesh, MFCAllocation, ParallelStrategy, parse_allocation,
    parse_strategy,
)


@pytest.mark.parametrize("text, expected", [
    ("d2", (2, 1, 1)), ("d2t1p1", (2, 1, 1)), ("t2d1", (1, 2, 1)), ("p4", (1, 1, 4)),
    ("  D2T2P2 ", (2, 2, 2)), ("p2d3", (3, 1, 2)), ("t8", (1, 8, 1)),
])
def test_parse_strategy(text, expected):
    s = parse_strategy(text)
    assert (s.dp, s.tp, s.pp) == expected and s.world_size == expected[0] * expected[1] * expected[2]
    assert parse_strategy(str(s)) == s and parse_strategy(s) is s


@pytest.mark.parametrize("text, needle", [
    ("", "empty parallel strategy"), ("d", "at 'd'"), ("x2", "at 'x2'"), ("d2d2", "sets 'd' twice"),
    ("d0", "d0 must be >= 1"), ("d2 t2", "at ' t2'"), ("d-1", "at 'd-1'"),
])
def test_parse_strategy_errors_show_grammar(text, needle):
    with pytest.raises(AllocationError) as e:
        parse_strategy(text)
    assert needle in str(e.value) and STRATEGY_GRAMMAR in str(e.value)
    with pytest.raises(AllocationError, match="must be a str"):
        parse_strategy(2)


def test_strategy_and_mesh_validation():
    assert str(ParallelStrategy(2, 1, 3)) == "d2t1p3"
    with pytest.raises(AllocationError, match="ParallelStrategy.tp"):
        ParallelStrategy(tp=0)
    m = DeviceMesh([0, 1, 2])
    assert m.workers == (0, 1, 2) and m.size == 3 and 1 in m and str(m) == "w0-2"
    assert str(DeviceMesh((3, 1))) == "w[3,1]" and str(DeviceMesh((4,))) == "w4"
    assert DeviceMesh.range(2, 4).overlaps(m) and not DeviceMesh.range(3, 5).overlaps(m)
    for bad, needle in [((), "non-empty"), ((0, 0), "twice"), ((-1,), ">= 0"), (("a",), ">= 0")]:
        with pytest.raises(AllocationError, match=needle):
            DeviceMesh(bad)


def test_parse_allocation_single_strategy():
    a = parse_allocation("d2", ["gen", "train"], 2)
    assert isinstance(a, Allocation) and list(a) == ["gen", "train"] and len(a) == 2
    mesh, strategy = a["gen"]
    assert mesh == DeviceMesh((0, 1)) and strategy == ParallelStrategy(dp=2)
    assert a["train"].strategy.world_size == 2 and a.workers() == [0, 1]
    assert parse_allocation("t2p2", ["x"], 4)["x"] == MFCAllocation(DeviceMesh((0, 1, 2, 3)), ParallelStrategy(1, 2, 2))
    with pytest.raises(AllocationError, match="no allocation for MFC 'nope'"):
        a["nope"]


@pytest.mark.parametrize("text, n, needle", [
    ("d2", 4, "uses d2*t1*p1 = 2 workers but there are 4"),
    ("d2t2", 2, "= 4 workers but there are 2"),
    ("gen:d2+train:d2", 4, "not supported yet"),
    ("qq", 2, "bad allocation 'qq'"),
    ("", 2, "empty allocation"),
])
def test_parse_allocation_errors_show_grammar(text, n, needle):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text, ["gen", "train"], n)
    assert needle in str(e.value) and "allocation :=" in str(e.value)


def test_parse_allocation_argument_checks_and_allocation_checks():
    with pytest.raises(AllocationError, match="n_workers"):
        parse_allocation("d1", ["a"], 0)
    with pytest.raises(AllocationError, match="no MFC names"):
        parse_allocation("d1", [], 1)
    with pytest.raises(AllocationError, match=r"listed twice: \['a'\]"):
        parse_allocation("d2", ["a", "a"], 2)
    with pytest.raises(AllocationError, match="MFC 'x': strategy d2t1p1 needs 2 workers but its mesh w0-2 has 3"):
        Allocation({"x": (DeviceMesh((0, 1, 2)), ParallelStrategy(dp=2))})
