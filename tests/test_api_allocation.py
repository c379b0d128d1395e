"""Parallel strategy / allocation parsing (every grammar form) and their errors (each shows the grammar)."""
from __future__ import annotations

import pytest

from realflow.api.allocation import (
    ALLOCATION_GRAMMAR, STRATEGY_GRAMMAR, Allocation, AllocationError, DeviceMesh, MFCAllocation, ParallelStrategy,
    parse_allocation, parse_strategy,
)
from realflow.api.batch import MicroBatchSpec
from realflow.api.mfc import MFCDef, ModelInterfaceType


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
    ("qq", 2, "entry 'qq': cannot parse parallel strategy 'qq'"),
    ("", 2, "empty allocation"),
])
def test_parse_allocation_errors_show_grammar(text, n, needle):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text, ["gen", "train"], n)
    assert needle in str(e.value) and ALLOCATION_GRAMMAR in str(e.value)


def test_parse_allocation_argument_checks_and_allocation_checks():
    with pytest.raises(AllocationError, match="n_workers"):
        parse_allocation("d1", ["a"], 0)
    with pytest.raises(AllocationError, match="no MFC names"):
        parse_allocation("d1", [], 1)
    with pytest.raises(AllocationError, match=r"listed twice: \['a'\]"):
        parse_allocation("d2", ["a", "a"], 2)
    with pytest.raises(AllocationError, match="MFC 'x': strategy d2t1p1 needs 2 workers but its mesh w0-2 has 3"):
        Allocation({"x": (DeviceMesh((0, 1, 2)), ParallelStrategy(dp=2))})


# ---- the full grammar: per-MFC maps, '+' splits, explicit worker sets -------------------------

PPO = {"actor_gen": "generate", "actor_inf": "inference", "ref_inf": "inference", "actor_train": "train_step",
       "critic_train": ModelInterfaceType.TRAIN_STEP}


def _placed(a: Allocation) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (m.mesh.workers, str(m.strategy)) for n, m in a.items()}


def test_one_strategy_letters_in_any_order_applies_to_every_mfc():
    for text in ("d2t2p1", "t2d2", "p1t2d2"):
        a = parse_allocation(text, PPO, 4)
        assert set(_placed(a).values()) == {((0, 1, 2, 3), "d2t2p1")} and list(a) == list(PPO)


def test_per_mfc_map_with_default_and_explicit_worker_set():
    a = parse_allocation("actor_train:d1t2p2,actor_gen:d4,*:d2t2", PPO, 4)
    assert _placed(a) == {
        "actor_gen": ((0, 1, 2, 3), "d4t1p1"), "actor_inf": ((0, 1, 2, 3), "d2t2p1"),
        "ref_inf": ((0, 1, 2, 3), "d2t2p1"), "actor_train": ((0, 1, 2, 3), "d1t2p2"),
        "critic_train": ((0, 1, 2, 3), "d2t2p1"),
    }
    # '@' puts one MFC on a subset (here: colocated with the others on workers 2-3); a bare strategy is '*'
    a = parse_allocation("d4, ref_inf:d2@2-3", PPO, 4)
    assert _placed(a)["ref_inf"] == ((2, 3), "d2t1p1") and _placed(a)["actor_gen"] == ((0, 1, 2, 3), "d4t1p1")


def test_split_gives_consecutive_blocks_and_selectors_by_interface_type():
    a = parse_allocation("gen:d4+train:d2p2", PPO, 8)
    assert _placed(a)["actor_gen"] == ((0, 1, 2, 3), "d4t1p1")
    assert {_placed(a)[n] for n in ("actor_inf", "ref_inf", "actor_train", "critic_train")} == {
        ((4, 5, 6, 7), "d2t1p2")}
    # a '+' term may be a braced (or bare) map; names beat gen/train, which beat '*'
    a = parse_allocation("actor_gen:d2+{actor_train:d2p2, ref_inf:d2@4-5, *:t4}+critic_train:d2", PPO, 8)
    assert _placed(a) == {
        "actor_gen": ((0, 1), "d2t1p1"), "actor_inf": ((2, 3, 4, 5), "d1t4p1"), "ref_inf": ((4, 5), "d2t1p1"),
        "actor_train": ((2, 3, 4, 5), "d2t1p2"), "critic_train": ((6, 7), "d2t1p1"),
    }
    assert _placed(parse_allocation("gen:d2+actor_train:d1,*:d1", PPO, 3))["critic_train"] == ((2,), "d1t1p1")
    # an explicit worker set may leave a gap that a later term fills; a term of only '@' entries is its own block
    a = parse_allocation("x:d2@2-3+y:d1@[0]+z:d1@1", ["x", "y", "z"], 4)
    assert _placed(a) == {"x": ((2, 3), "d2t1p1"), "y": ((0,), "d1t1p1"), "z": ((1,), "d1t1p1")}
    # non-contiguous worker lists keep their order (it is the layout's rank order)
    assert _placed(parse_allocation("a:d1t2@[3,0]+b:d2@[1,2]", ["a", "b"], 4))["a"] == ((3, 0), "d1t2p1")


def test_mfcdefs_are_accepted_and_an_mfc_named_like_a_selector_is_selected_by_name():
    def mfc(name, t):
        return MFCDef(name=name, model_name="m", interface_type=t, interface_impl="x", mb_spec=MicroBatchSpec())
    mfcs = [mfc("gen", "generate"), mfc("train", "train_step"), mfc("roll", "generate")]
    a = parse_allocation("gen:d1+train:d1+roll:d1", mfcs, 3)
    assert _placed(a) == {"gen": ((0,), "d1t1p1"), "train": ((1,), "d1t1p1"), "roll": ((2,), "d1t1p1")}


@pytest.mark.parametrize("text, n, needle", [
    ("gen:d4+train:d2p2", 6, "term 2 'train:d2p2' needs workers w4-7 but there are only 6 workers (w0-5): "
                             "more workers used than exist"),
    ("ref_inf:d2@6-7,*:d4", 4, "entry 'ref_inf:d2@6-7' uses worker(s) [6, 7] but there are only 4 workers"),
    ("gen:d3+train:d2", 4, "term 2 'train:d2' needs workers w3-4"),
    ("gen:d2+train:d2", 6, "workers [4, 5] are used by no term (there are 6 workers)"),
    ("ref_inf:d2@0-1,*:d2@2-3", 6, "workers [4, 5] run no MFC (there are 6 workers); they would idle"),
    ("gen:d4+{train:d2,ref_inf:d2@2-3}", 6, "entry 'ref_inf:d2@2-3': workers [2, 3] lie outside its term's "
                                            "block w4-5"),
    ("gen:d4+train:d2@2-3", 6, "terms 1 'gen:d4' and 2 'train:d2@2-3' overlap on workers [2, 3]"),
    ("gen:d2@0-1+train:d2@1-2", 3, "terms 1 'gen:d2@0-1' and 2 'train:d2@1-2' overlap on workers [1]"),
    ("actor_trian:d2,*:d2", 2, "unknown MFC 'actor_trian'; did you mean 'actor_train'"),
    ("gen:d2,gen:d2", 2, "selector 'gen' appears twice ('gen:d2' and 'gen:d2'): an MFC would be covered twice"),
    ("d2+*:d2", 4, "selector '*' appears twice"),
    ("actor_gen:d2+actor_gen:d2", 4, "selector 'actor_gen' appears twice"),
    ("actor_gen:d2,actor_train:d2", 2, "MFC(s) ['actor_inf', 'ref_inf', 'critic_train'] covered by no entry; "
                                       "name them or add a '*' default"),
    ("actor_gen:d2,gen:d1@0,*:d2", 2, "entry 'gen:d1@0' selects no generate MFC (all of ['actor_gen'] are named"),
    ("gen:d2+actor_gen:d2+*:d2", 6, "entry 'gen:d2' selects no generate MFC (all of ['actor_gen'] are named"),
    ("gen:d2", 2, "covered by no entry"),
    ("gen:d2+train:d2+*:d2", 6, "term 3 '*:d2' selects no MFC; its workers would idle"),
    ("actor_train:d1t2p2,*:d2t2", 2, "'actor_train:d1t2p2' uses d1*t2*p2 = 4 workers but there are 2"),
    ("gen:d2+{actor_train:d2p2,*:d2}", 6, "entries without '@' must use the same number of workers (d*t*p), "
                                          "got 'actor_train:d2p2' = 4, '*:d2' = 2"),
    ("ref_inf:d2@4-6,*:d8", 8, "strategy d2t1p1 needs d*t*p = 2 workers but '@4-6' names 3"),
    ("x:d2@1-0", 2, "worker range 1-0 is empty"),
    ("x:d2@a", 2, "bad worker set '@a'"),
    ("x:d2@[0,0]", 2, "lists a worker twice"),
    ("gen:dd", 2, "entry 'gen:dd': cannot parse parallel strategy 'dd'"),
    ("gen:d2++train:d2", 4, "term 2 is empty"),
    ("gen:d2,,*:d2", 2, "empty entry"),
    ("a b:d2", 2, "bad selector 'a b'"),
    ("gen:d2+{train:d2", 4, "unclosed '{'"),
    ("gen:d2}", 2, "unbalanced '}'"),
    ("{gen:d2,{train:d2}}", 2, "braces only group a whole term and do not nest"),
])
def test_allocation_errors_say_what_is_wrong_and_show_the_grammar(text, n, needle):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text, PPO, n)
    msg = str(e.value)
    assert needle in msg, msg
    assert msg.startswith(f"allocation {text!r}: ") and msg.endswith(ALLOCATION_GRAMMAR)


def test_gen_and_train_need_interface_types_and_types_are_checked():
    with pytest.raises(AllocationError, match=r"selector 'gen' needs the interface type of every MFC.*\['a', 'b'\]"):
        parse_allocation("gen:d1+train:d1", ["a", "b"], 2)
    with pytest.raises(AllocationError, match="unknown interface type 'evaluate'"):
        parse_allocation("d1", {"a": "evaluate"}, 1)
    with pytest.raises(AllocationError, match="non-empty str"):
        parse_allocation("d1", [3], 1)
