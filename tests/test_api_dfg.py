"""MFCDef validation and DataFlowGraph construction, queries, summary and drawing."""
from __future__ import annotations

import struct

import pytest
import torch

from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import DataFlowGraph, GraphError, build_graph, graph_registry, register_graph
from realflow.api.mfc import MFCDef, MFCDefError, ModelInterfaceType, OffloadHook, ParamReallocHook

torch.set_num_threads(1)
G, I, TR = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP


def mfc(name, role, itype, ins=(), outs=(), **kw) -> MFCDef:
    return MFCDef(name=name, model_name=role, interface_type=itype, interface_impl="impl",
                  input_keys=tuple(ins), output_keys=tuple(outs), **kw)


def ppo_mfcs() -> list[MFCDef]:
    return [
        mfc("actor_gen", "actor", G, ["prompts"], ["seqs", "logprobs"]),
        mfc("rew_inf", "reward", I, ["seqs"], ["rewards"]),
        mfc("ref_inf", "ref", I, ["seqs"], ["ref_logprobs"]),
        mfc("critic_inf", "critic", I, ["seqs"], ["values"]),
        mfc("actor_train", "actor", TR, ["seqs", "logprobs", "ref_logprobs", "rewards", "values"]),
        mfc("critic_train", "critic", TR, ["seqs", "logprobs", "ref_logprobs", "rewards", "values"]),
    ]


# ---- MFCDef ------------------------------------------------------------------------------------


def test_mfcdef_normalises_and_exposes_remaps():
    m = MFCDef("a", "actor", "generate", "impl", input_keys=["x", "y"], output_keys=["z"],
               input_key_remap={"x": "input_ids"}, output_key_remap={"out": "z"},
               pre_hooks=[ParamReallocHook("actor", "actor_gen", eta=0.5)], post_hooks=[OffloadHook()])
    assert m.interface_type is G and m.input_keys == ("x", "y") and m.output_keys == ("z",)
    assert m.interface_input_keys == ("input_ids", "y")
    assert m.interface_output_keys == ("out",)
    assert m.role == "actor" and not m.is_train
    assert isinstance(m.mb_spec, MicroBatchSpec) and m.pre_hooks[0].eta == 0.5


@pytest.mark.parametrize("kw, needle", [
    (dict(name=""), "MFC name"),
    (dict(name="has space"), "MFC name"),
    (dict(model_name=""), "model_name"),
    (dict(interface_impl=" "), "interface_impl"),
    (dict(interface_type="train"), "interface_type must be one of generate, inference, train_step"),
    (dict(input_keys="abc"), "input_keys must be a tuple"),
    (dict(input_keys=("a", "a")), "listed twice in input_keys"),
    (dict(output_keys=("",)), "output_keys"),
    (dict(input_keys=("a",), output_keys=("a",)), "both input and output"),
    (dict(n_seqs=0), "n_seqs"),
    (dict(n_seqs=True), "n_seqs"),
    (dict(mb_spec={"n_mbs": 2}), "mb_spec must be a MicroBatchSpec"),
    (dict(input_keys=("a",), input_key_remap={"b": "c"}), "input_key_remap renames 'b'"),
    (dict(output_keys=("z",), output_key_remap={"o": "q"}), "output_key_remap produces ['q']"),
    (dict(input_keys=("a", "b"), input_key_remap={"a": "x", "b": "x"}), "maps several keys onto ['x']"),
    (dict(pre_hooks=["realloc"]), "pre_hooks must be a list of hooks"),
    (dict(interface_args={1: 2}), "interface_args"),
    (dict(log_return_value="yes"), "log_return_value"),
])
def test_mfcdef_field_errors_name_mfc_and_field(kw, needle):
    base = dict(name="m1", model_name="actor", interface_type="inference", interface_impl="impl")
    base.update(kw)
    with pytest.raises(MFCDefError) as e:
        MFCDef(**base)
    assert needle in str(e.value)
    if base["name"] == "m1":
        assert "'m1'" in str(e.value)


def test_hook_validation():
    with pytest.raises(MFCDefError, match="eta"):
        ParamReallocHook("a", "b", eta=1.5)
    with pytest.raises(MFCDefError, match="source_role"):
        ParamReallocHook("", "b")


# ---- graph validation --------------------------------------------------------------------------


def err(mfcs, ds=("prompts",)) -> str:
    with pytest.raises(GraphError) as e:
        DataFlowGraph(mfcs, set(ds))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_duplicate_mfc_names():
    msg = err([mfc("a", "actor", G, ["prompts"], ["x"]), mfc("a", "ref", I, ["x"], ["y"])])
    assert "duplicate MFC name 'a'" in msg


def test_key_produced_twice():
    msg = err([mfc("a", "actor", G, ["prompts"], ["x"]), mfc("b", "ref", I, ["prompts"], ["x"])])
    assert "key 'x'" in msg and "'a', 'b'" in msg


def test_key_produced_by_mfc_and_dataset():
    msg = err([mfc("a", "actor", G, [], ["prompts"])])
    assert "key 'prompts'" in msg and "'a'" in msg and "data set" in msg


def test_missing_input_names_mfc_key_and_suggestion():
    msg = err([mfc("a", "actor", G, ["prompts"], ["seqs"]), mfc("b", "ref", I, ["seq"], ["y"])])
    assert "MFC 'b' needs key 'seq'" in msg and "did you mean 'seqs'" in msg


def test_two_train_steps_per_role():
    msg = err([mfc("t1", "actor", TR, ["prompts"]), mfc("t2", "actor", TR, ["prompts"])])
    assert "role 'actor'" in msg and "'t1', 't2'" in msg


def test_cycle_names_mfcs_and_keys():
    msg = err([mfc("a", "actor", G, ["prompts", "z"], ["x"]), mfc("b", "ref", I, ["x"], ["y"]),
               mfc("c", "critic", I, ["y"], ["z"]), mfc("d", "rew", I, ["prompts"], ["w"])])
    assert "cycle between MFCs 'a', 'b', 'c'" in msg
    assert "-[x]->" in msg and "-[y]->" in msg and "-[z]->" in msg and "'d'" not in msg


def test_empty_names_after_mutation_and_non_mfc_entries():
    m = mfc("a", "actor", G, ["prompts"], ["x"])
    m.name = ""  # dataclasses are mutable; the graph re-validates
    assert "MFC name" in err([m])
    m2 = mfc("b", "actor", G, ["prompts"], ["x"])
    m2.output_keys = ("",)
    assert "'b'" in err([m2]) and "output_keys" in err([m2])
    assert "not an MFCDef" in err([{"name": "a"}])
    assert "no MFCs" in err([])
    assert "data set key ''" in err([mfc("a", "actor", G, ["prompts"])], ds=("prompts", ""))


def test_all_problems_of_a_stage_reported():
    with pytest.raises(GraphError) as e:
        DataFlowGraph([mfc("a", "actor", G, ["p1"], ["x"]), mfc("b", "ref", I, ["p2"], ["x"])], set())
    assert len(e.value.problems) == 3  # x twice, p1 missing, p2 missing


# ---- queries -----------------------------------------------------------------------------------


def test_ppo_graph_structure():
    g = DataFlowGraph(ppo_mfcs(), {"prompts"})
    assert g.topological_generations() == [
        ["actor_gen"], ["rew_inf", "ref_inf", "critic_inf"], ["actor_train", "critic_train"]]
    assert g.topological_order()[0] == "actor_gen"
    assert g.producers("seqs") == ["actor_gen"] and g.producers("prompts") == []
    assert g.consumers("values") == ["actor_train", "critic_train"]
    assert g.roles() == ["actor", "reward", "ref", "critic"]
    assert g.train_mfc("actor") == "actor_train" and g.train_mfc("ref") is None
    assert g.mfcs_of_role("critic") == ["critic_inf", "critic_train"]
    assert ("actor_gen", "actor_train", ("seqs", "logprobs")) in g.edges()
    assert g.edges()[0][:2] == ("actor_gen", "rew_inf")
    assert g.dataset_inputs("actor_gen") == ("prompts",)
    assert g.predecessors("actor_train") == ["actor_gen", "rew_inf", "ref_inf", "critic_inf"]
    assert g.successors("rew_inf") == ["actor_train", "critic_train"]
    assert g.final_keys() == [] and len(g) == 6 and "ref_inf" in g
    assert g.nx_graph.number_of_edges() == 11
    with pytest.raises(GraphError, match="no MFC named 'ref'; did you mean 'ref_inf', 'rew_inf'"):
        g.mfc("ref")
    with pytest.raises(GraphError, match="unknown key 'value'; did you mean 'values'"):
        g.consumers("value")


def test_final_keys_and_summary():
    mfcs = ppo_mfcs()[:2] + [mfc("stats", "actor", I, ["rewards"], ["report"])]
    g = DataFlowGraph(mfcs, {"prompts"})
    assert g.final_keys() == ["logprobs", "report"]
    s = g.summary()
    assert "3 MFCs" in s and "generation 2:" in s and "rewards <- rew_inf" in s and "prompts <- dataset" in s
    assert "actor_gen -> rew_inf: seqs" in s and "final keys: logprobs, report" in s


def test_check_references():
    g = DataFlowGraph(ppo_mfcs(), {"prompts"})
    with pytest.raises(GraphError, match="MFC 'ref_inf' uses unknown role 'ref'"):
        g.check_references(roles=["actor", "reward", "critic", "reff"], interfaces={"impl"})
    with pytest.raises(GraphError, match="unregistered interface 'impl'.*did you mean 'impl2'"):
        g.check_references(interfaces={"impl2"})
    g.check_references(roles=["actor", "reward", "ref", "critic"], interfaces={"impl"})


def test_graph_registry_and_build_graph():
    @register_graph("test_api_dfg_chain")
    def chain(n: int) -> list[MFCDef]:
        return [mfc(f"m{i}", f"r{i}", I, ["k0" if i == 0 else f"k{i}"], [f"k{i + 1}"]) for i in range(n)]

    try:
        g = build_graph("test_api_dfg_chain", 3, dataset_keys={"k0"})
        assert g.topological_generations() == [["m0"], ["m1"], ["m2"]]
        with pytest.raises(KeyError, match="did you mean 'test_api_dfg_chain'"):
            build_graph("test_api_dfg_chian", 3)
    finally:
        graph_registry.unregister("test_api_dfg_chain")


# ---- drawing -----------------------------------------------------------------------------------


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_draw_png(tmp_path):
    from realflow.system.plan_draw import draw_dataflow

    g = DataFlowGraph(ppo_mfcs(), {"prompts"})
    out = draw_dataflow(g, tmp_path / "sub" / "g.png", placement={n: "w0-1 d2" for n in g.names})
    w, h = _png_size(out)
    assert w > 600 and h > 300
    out2 = draw_dataflow(g, tmp_path / "plain.png")
    assert _png_size(out2)[0] > 600
    with pytest.raises(GraphError, match="unknown MFC 'actor_tran'; did you mean 'actor_train'"):
        draw_dataflow(g, tmp_path / "x.png", placement={"actor_tran": "w0"})
