"""Plan compiler: homes, reallocation / offload hooks (when they appear and when not), declared EMA hooks,
data transfers, group-creation order (deterministic across processes), backend layout checks with numbers,
and ``--dry-run`` of an experiment with a split allocation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

import parallel.backend  # noqa: F401  (registers the "megatron" backend the plans check layouts with)
from parallel.backend import estimate_rank_bytes
from realflow.api.allocation import AllocationError, ParallelStrategy
from realflow.api.experiment import (
    BaseExperimentConfig, DatasetSpec, ExperimentSetup, ModelSpec, OptimizerConfig, register_experiment,
)
from realflow.api.interface import ModelInterface, register_interface
from realflow.api.mfc import MFCDef, OffloadHook, ParamReallocHook
from realflow.system.plan import (
    DataTransfer, Layout, Offload, ParamRealloc, PlanError, ReallocPair, Reload, compile_plan,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=160, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False)


def write_config(path, **over) -> str:
    """An HF checkpoint directory with only config.json: all that plan checks read."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**TINY, **over}, f)
    return str(path)


def L(workers, dp=1, tp=1, pp=1) -> Layout:
    return Layout(tuple(workers), ParallelStrategy(dp, tp, pp))


def ppo_mfcs(actor_post=(), ref_pre=(), extra=()) -> list[MFCDef]:
    """actor generates, ref scores, actor trains: the smallest graph with two roles and an edge fan-in."""
    return [
        MFCDef("actor_gen", "actor", "generate", "x", input_keys=("packed_prompts",),
               output_keys=("packed_input_ids", "logprobs")),
        MFCDef("ref_inf", "ref", "inference", "x", input_keys=("packed_input_ids",), output_keys=("ref_logp",),
               pre_hooks=list(ref_pre)),
        MFCDef("actor_train", "actor", "train_step", "x", input_keys=("packed_input_ids", "logprobs", "ref_logp"),
               post_hooks=list(actor_post)),
        *extra,
    ]


def make_setup(tmp_path, allocation, n_workers, mfcs=None, actor_path=None, ref_path=None) -> ExperimentSetup:
    actor = actor_path or write_config(tmp_path / "actor")
    models = {"actor": ModelSpec("actor", actor, optimizer=OptimizerConfig()),
              "ref": ModelSpec("ref", ref_path or actor)}
    return ExperimentSetup("plan_test", "t0", mfcs if mfcs is not None else ppo_mfcs(), models,
                           DatasetSpec("prompt_answer", "unused.jsonl"), n_workers, allocation, str(tmp_path / "run"))


# ---- homes and automatic reallocation ---------------------------------------------------------


def test_matching_layouts_need_no_hooks(tmp_path):
    mfcs = [m for m in ppo_mfcs() if m.model_name == "actor"]
    mfcs[1].input_keys = ("packed_input_ids", "logprobs")
    plan = compile_plan(make_setup(tmp_path, "d2", 2, mfcs))
    assert plan.role_home == {"actor": L([0, 1], dp=2)} and not plan.needs_hooks
    assert all(plan.pre_hooks[n] == () and plan.post_hooks[n] == () for n in plan.placements)
    assert plan.realloc_pairs == [] and plan.group_order == [("actor", L([0, 1], dp=2))]
    assert plan.offloaded == {} and plan.trained_roles == ("actor",) and plan.notes == []


def test_split_reallocates_trained_role_before_and_back_after_and_offloads_colocated_untrained_role(tmp_path):
    plan = compile_plan(make_setup(tmp_path, "gen:d2+train:d1t2", 4))
    gen, home = L([0, 1], dp=2), L([2, 3], tp=2)
    assert plan.role_home == {"actor": home, "ref": home}
    assert plan.pre_hooks["actor_gen"] == (ParamRealloc("actor", home, "actor", gen, 1.0, "to MFC layout"),)
    assert plan.post_hooks["actor_gen"] == (ParamRealloc("actor", gen, "actor", home, 1.0, "back home"),)
    # ref is never trained and shares workers 2-3 with actor: reloaded before, offloaded after its MFC
    assert plan.offloaded == {"ref": ["actor"]}
    assert [type(h) for h in plan.pre_hooks["ref_inf"]] == [Reload]
    assert plan.post_hooks["ref_inf"] == (Offload("ref", home, "never trained, shares workers with actor"),)
    assert plan.pre_hooks["actor_train"] == () and plan.post_hooks["actor_train"] == ()  # train runs at home
    assert plan.realloc_pairs == [ReallocPair("actor", home, "actor", gen), ReallocPair("actor", gen, "actor", home)]
    assert [(m, w, type(h).__name__) for m, w, h in plan.hooks()] == [
        ("actor_gen", "before", "ParamRealloc"), ("actor_gen", "after", "ParamRealloc"),
        ("ref_inf", "before", "Reload"), ("ref_inf", "after", "Offload")]
    assert plan.needs_hooks


def test_untrained_role_moves_to_other_layouts_but_never_back_and_disjoint_roles_are_not_offloaded(tmp_path):
    extra = [MFCDef("ref_inf2", "ref", "inference", "x", input_keys=("packed_input_ids",),
                    output_keys=("ref_logp2",))]
    plan = compile_plan(make_setup(tmp_path, "d2@0-1,ref_inf:d1@2,ref_inf2:d2@2-3", 4, ppo_mfcs(extra=extra)))
    ref_home = L([2])
    assert plan.role_home["ref"] == ref_home and plan.offloaded == {}  # ref's workers 2-3 hold no actor
    assert plan.pre_hooks["ref_inf2"] == (ParamRealloc("ref", ref_home, "ref", L([2, 3], dp=2), 1.0,
                                                       "to MFC layout"),)
    assert plan.post_hooks["ref_inf2"] == ()  # the home copy of a never-trained role stays valid
    assert plan.pre_hooks["ref_inf"] == plan.post_hooks["ref_inf"] == ()
    assert all(not plan.pre_hooks[n] and not plan.post_hooks[n] for n in ("actor_gen", "actor_train"))


# ---- declared hooks ---------------------------------------------------------------------------


def test_declared_ema_hook_runs_between_home_layouts_after_the_automatic_ones(tmp_path):
    ema = ParamReallocHook("actor", "ref", eta=0.05)
    plan = compile_plan(make_setup(tmp_path, "actor_gen:d2+{actor_train:d2,ref_inf:d1@3}", 4,
                                   ppo_mfcs(actor_post=[ema])))
    actor_home, ref_home = L([2, 3], dp=2), L([3])
    assert plan.post_hooks["actor_train"][-1] == ParamRealloc("actor", actor_home, "ref", ref_home, 0.05, "declared")
    assert "realloc actor d2t1p1@[2, 3] -> ref d1t1p1@[3] (eta=0.05) [declared]" in plan.describe()
    assert ReallocPair("actor", actor_home, "ref", ref_home) in plan.realloc_pairs
    # a pre hook is placed before the MFC's own reload / reallocation
    plan = compile_plan(make_setup(tmp_path, "d2", 2, ppo_mfcs(ref_pre=[ParamReallocHook("actor", "ref", 1.0)])))
    assert [type(h) for h in plan.pre_hooks["ref_inf"]] == [ParamRealloc, Reload]


def test_declared_realloc_checks_roles_and_architectures(tmp_path):
    with pytest.raises(PlanError, match=r"MFC 'actor_train': post_hooks ParamReallocHook target_role 'rfe' is not a "
                                        r"role of any MFC; did you mean 'ref'\?"):
        compile_plan(make_setup(tmp_path, "d2", 2, ppo_mfcs(actor_post=[ParamReallocHook("actor", "rfe")])))
    with pytest.raises(PlanError, match="moves role 'actor' onto itself"):
        compile_plan(make_setup(tmp_path, "d2", 2, ppo_mfcs(actor_post=[ParamReallocHook("actor", "actor")])))
    other = write_config(tmp_path / "ref_small", hidden_size=32, num_hidden_layers=3)
    with pytest.raises(PlanError, match=r"ParamReallocHook actor -> ref: models 'actor' \(.*\) and 'ref' \(.*\) differ "
                                        r"in architecture: hidden_size: 64 vs 32; num_hidden_layers: 2 vs 3"):
        compile_plan(make_setup(tmp_path, "d2", 2, ppo_mfcs(actor_post=[ParamReallocHook("actor", "ref", 0.1)]),
                                ref_path=other))
    same = write_config(tmp_path / "ref_same")  # another checkpoint of the same architecture is fine
    plan = compile_plan(make_setup(tmp_path, "d2", 2, ppo_mfcs(actor_post=[ParamReallocHook("actor", "ref", 0.1)]),
                                   ref_path=same))
    assert plan.post_hooks["actor_train"][-1].eta == 0.1
    missing = str(tmp_path / "not_written_yet")  # a dry run before prepare(): noted, not an error
    plan = compile_plan(make_setup(tmp_path, "d2", 2, ppo_mfcs(actor_post=[ParamReallocHook("actor", "ref", 0.1)]),
                                   ref_path=missing))
    assert any("not_written_yet" in n and "architectures not compared" in n for n in plan.notes)
    assert any("not_written_yet" in n and "layout d2t1p1 not checked" in n for n in plan.notes)


def test_declared_offload_reloads_before_the_roles_next_mfc_cyclically(tmp_path):
    plan = compile_plan(make_setup(tmp_path, "actor_gen:d2+{actor_train:d2,ref_inf:d2}", 4,
                                   ppo_mfcs(actor_post=[OffloadHook()])))
    home = L([2, 3], dp=2)
    assert Offload("actor", home, "declared OffloadHook") in plan.post_hooks["actor_train"]
    # the actor's next MFC is actor_gen of the next step: reload home, then move to the generation layout
    assert [type(h) for h in plan.pre_hooks["actor_gen"]] == [Reload, ParamRealloc]
    assert plan.pre_hooks["actor_gen"][0] == Reload("actor", home, "offloaded after its previous MFC")
    bad = ppo_mfcs()
    bad[0].pre_hooks = [OffloadHook()]
    with pytest.raises(PlanError, match="MFC 'actor_gen': OffloadHook belongs in post_hooks"):
        compile_plan(make_setup(tmp_path, "d2", 2, bad))


# ---- data transfers and group order ----------------------------------------------------------


def test_generation_never_gets_pipeline_stages(tmp_path):
    with pytest.raises(PlanError, match=r"MFC 'actor_gen' generates, and generation does not pipeline: its layout "
                                        r"d1t1p2@\[0, 1\] has pp=2; give it pp=1"):
        compile_plan(make_setup(tmp_path, "gen:d1t1p2+train:d1t2", 4))


def test_transfers_go_from_producer_dp_heads_to_every_consumer_worker(tmp_path):
    plan = compile_plan(make_setup(tmp_path, "{actor_gen:d2,ref_inf:d1p2}+train:d1t2", 4))
    by = {(t.producer, t.consumer, t.key): t for t in plan.transfers}
    assert set(by) == {("actor_gen", "ref_inf", "packed_input_ids"), ("actor_gen", "actor_train", "packed_input_ids"),
                       ("actor_gen", "actor_train", "logprobs"), ("ref_inf", "actor_train", "ref_logp")}
    # pipeline producer: its output lives on the last stage (worker 1); tp consumer: both tp ranks receive
    assert by[("ref_inf", "actor_train", "ref_logp")] == DataTransfer("ref_logp", "ref_inf", "actor_train",
                                                                      (1,), (2, 3))
    assert not by[("ref_inf", "actor_train", "ref_logp")].local
    # data-parallel producer: every dp head holds its part
    assert by[("actor_gen", "actor_train", "logprobs")].src_workers == (0, 1)
    assert by[("actor_gen", "ref_inf", "packed_input_ids")].local  # the same two workers: nothing moves
    same = compile_plan(make_setup(tmp_path, "d2", 2))
    assert all(t.local for t in same.transfers) and len(same.transfers) == 4


def test_group_order_lists_homes_then_mfc_layouts_once_each(tmp_path):
    plan = compile_plan(make_setup(tmp_path, "actor_gen:d4+{actor_train:d2p2,ref_inf:d1t2@6-7}", 8))
    assert plan.group_order == [("actor", L([4, 5, 6, 7], dp=2, pp=2)), ("ref", L([6, 7], tp=2)),
                                ("actor", L([0, 1, 2, 3], dp=4))]


def test_plan_is_identical_in_fresh_processes_with_different_hash_seeds(tmp_path):
    """Workers compile the plan independently; any set-order dependence would desynchronise group creation."""
    write_config(tmp_path / "actor")
    code = (
        "import sys, pathlib; sys.path.insert(0, %r); import tests.test_system_plan as t; "
        "from realflow.system.plan import compile_plan; "
        "p = compile_plan(t.make_setup(pathlib.Path(%r), %r, 8, t.ppo_mfcs(actor_post=[t.ParamReallocHook('actor', "
        "'ref', 0.5)]))); print(repr(p.group_order)); print(repr(p.realloc_pairs)); print(p.describe())"
    )
    alloc = "actor_gen:d2t2+{actor_train:d1t2p2,ref_inf:d2@6-7}"
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONWARNINGS="ignore")
        res = subprocess.run([sys.executable, "-c", code % (REPO, str(tmp_path), alloc)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout)
    here = compile_plan(make_setup(tmp_path, alloc, 8, ppo_mfcs(actor_post=[ParamReallocHook("actor", "ref", 0.5)])))
    assert outs[0] == outs[1] == f"{here.group_order!r}\n{here.realloc_pairs!r}\n{here.describe()}\n"


# ---- backend layout checks ---------------------------------------------------------------------


@pytest.mark.parametrize("over, alloc, n, needle", [
    ({}, "d1t3", 3, "MFC 'actor_gen' (role 'actor', layout d1t3p1@[0, 1, 2]): model 'actor' (qwen2, 2 layers, "
                    "hidden 64, 4 heads / 2 KV heads, vocab 160) in layout d1t3p1: tp=3 does not divide "
                    "num_attention_heads=4"),
    (dict(num_attention_heads=8, hidden_size=128), "t4", 4, "tp=4 does not divide num_key_value_heads=2"),
    (dict(intermediate_size=129), "t2", 2, "tp=2 does not divide intermediate_size=129"),
    ({}, "actor_train:p3,*:d3", 3, "pp=3 is larger than num_hidden_layers=2"),  # (generation never pipelines)
    (dict(num_hidden_layers=3), "actor_train:p2,*:d2", 2, "pp=2 does not divide num_hidden_layers=3"),
    (dict(hidden_act="gelu"), "d1", 1, "hidden_act='gelu' (only SwiGLU/silu)"),
])
def test_backend_rejects_layouts_megatron_cannot_build(tmp_path, over, alloc, n, needle):
    setup = make_setup(tmp_path, alloc, n, actor_path=write_config(tmp_path / "m", **over))
    with pytest.raises(PlanError) as e:
        compile_plan(setup)
    assert needle in str(e.value)


def test_backend_rejects_a_layout_that_cannot_hold_the_model_and_names_the_numbers(tmp_path):
    big = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
               num_key_value_heads=8, vocab_size=128256)  # a 70B-class llama-shaped model
    path = write_config(tmp_path / "big", **big)
    mfcs = [m for m in ppo_mfcs() if m.model_name == "actor"]
    mfcs[1].input_keys = ("packed_input_ids", "logprobs")
    with pytest.raises(PlanError) as e:
        compile_plan(make_setup(tmp_path, "actor_gen:d2+actor_train:t2p2", 6, mfcs, actor_path=path))
    cfg = {**TINY, **big}
    params, need = estimate_rank_bytes(cfg, ParallelStrategy(dp=2), False)
    msg = str(e.value)
    assert msg.startswith("MFC 'actor_gen' (role 'actor', layout d2t1p1@[0, 1]): model 'actor' (qwen2, 80 layers")
    assert f"cannot fit: {params / 1e6:.1f}M parameters per rank need at least {need / 2**30:.2f} GiB (weights)" in msg
    assert "but a worker has" in msg and "/ 6 workers on this host)" in msg


def test_rank_estimate_matches_real_parameter_counts(tmp_path):
    """d1t1p1 = the HF model with megatron's padded vocabulary; tp and pp split it as megatron does."""
    import transformers as tf

    for family, cls, over in [("qwen2", tf.Qwen2ForCausalLM, {}), ("qwen3", tf.Qwen3ForCausalLM, {"head_dim": 16}),
                              ("llama", tf.LlamaForCausalLM, {"tie_word_embeddings": True})]:
        cfg = {**TINY, "model_type": family, "vocab_size": 256, **over}
        hf_cfg = getattr(tf, cls.__name__.replace("ForCausalLM", "Config"))(**cfg)
        n = sum(p.numel() for p in cls(hf_cfg).parameters())
        assert estimate_rank_bytes(cfg, ParallelStrategy(), False) == (n, 4 * n), family
    cfg = {**TINY, "vocab_size": 256}
    full, _ = estimate_rank_bytes(cfg, ParallelStrategy(), False)
    emb = 256 * 64
    tp2, _ = estimate_rank_bytes(cfg, ParallelStrategy(tp=2), False)
    assert tp2 == (full - 2 * 64 * 2 - 64) // 2 + 2 * 64 * 2 + 64  # norms replicated, everything else halved
    pp2, _ = estimate_rank_bytes(cfg, ParallelStrategy(pp=2), False)
    assert pp2 == (full - 2 * emb - 64) // 2 + emb + 64  # one layer + output layer + final norm on the last stage
    _, trained = estimate_rank_bytes(cfg, ParallelStrategy(dp=2), True)
    assert trained == full * (4 + 4 + 8 // 2)  # weights + fp32 grads + Adam moments sharded over dp=2


def test_allocation_errors_pass_through_the_compiler(tmp_path):
    with pytest.raises(AllocationError, match="term 2 'train:d2' needs workers w2-3 but there are only 3"):
        compile_plan(make_setup(tmp_path, "gen:d2+train:d2", 3))


# ---- --dry-run ----------------------------------------------------------


@register_interface("x")
class _PlanOnlyInterface(ModelInterface):
    """The interface the plan tests' MFCs name: registered, as the launcher checks (never run here)."""


@register_experiment("test_plan_split")
@dataclass
class SplitPlanExperiment(BaseExperimentConfig):
    """A PPO-shaped graph (generate, reference inference, train) on tiny configs, for --dry-run."""

    model_dir: str = field(default="", metadata={"help": "directory with config.json"})
    n_workers: int = field(default=4, metadata={"help": "model workers"})
    allocation: str = field(default="gen:d2+train:d1t2", metadata={"help": "allocation"})

    def setup(self) -> ExperimentSetup:
        import pathlib

        s = make_setup(pathlib.Path(self.fileroot), self.allocation, self.n_workers,
                       ppo_mfcs(actor_post=[ParamReallocHook("actor", "ref", 0.1)]), actor_path=self.model_dir)
        return s.replace(run_dir=self.run_dir("test_plan_split"))


def test_dry_run_prints_the_plan_and_draws_graph_and_placement(tmp_path, capsys):
    from parallel.testing import make_tiny_hf
    from realflow.apps.launch import main

    make_tiny_hf(str(tmp_path / "tiny"))
    rc = main("test_plan_split", [f"fileroot={tmp_path}", f"model_dir={tmp_path / 'tiny'}", "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    text = out.out
    for needle in [
        "ExecutionPlan: 4 model workers, 2 roles, 3 MFCs, 5 hooks",
        "actor        d1t2p1@[2, 3]  trained",
        "ref          d1t2p1@[2, 3]  never trained; offloaded between its MFCs (shares workers with actor)",
        "  actor d2t1p1@[0, 1] (MFC layout; MFCs: actor_gen)\n      pp0: dp0 [w0] | dp1 [w1]",
        "  actor d1t2p1@[2, 3] (home; MFCs: actor_train)\n      pp0: dp0 [w2 w3]",
        "before: realloc actor d1t2p1@[2, 3] -> actor d2t1p1@[0, 1] [to MFC layout]",
        "after : realloc actor d2t1p1@[0, 1] -> actor d1t2p1@[2, 3] [back home]",
        "after : offload ref d1t2p1@[2, 3]",
        "after : realloc actor d1t2p1@[2, 3] -> ref d1t2p1@[2, 3] (eta=0.1) [declared]",
        "logprobs: actor_gen -> actor_train (w[0, 1] -> w[2, 3])",
        "ref_logp: ref_inf -> actor_train (w[2] -> w[2, 3])",
        "   0. actor        d1t2p1@[2, 3]\n   1. ref          d1t2p1@[2, 3]\n   2. actor        d2t1p1@[0, 1]",
        "  actor_gen    d0 t0 p0  d1 t0 p0  .         .       ",
        "  actor_train  .         .         d0 t0 p0  d0 t1 p0",
    ]:
        assert needle in text, f"missing {needle!r} in:\n{text}"
    png = tmp_path / "test_plan_split" / "trial0" / "plan.png"
    assert f"graph and placement drawn to {png}" in text
    from matplotlib.image import imread

    img = imread(str(png))
    assert img.shape[0] > 400 and img.shape[1] > 400 and img[..., :3].std() > 0.05  # two panels, not blank

    rc = main("test_plan_split", [f"fileroot={tmp_path}", f"model_dir={tmp_path / 'tiny'}", "allocation=t3",
                                  "n_workers=3", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "tp=3 does not divide num_attention_heads=4" in err


def test_default_layout_is_data_parallel_unless_a_replica_does_not_fit(monkeypatch):
    """The rule behind the RL experiments' default allocation (benchmarks/bench_e2e_rl.py measured
    data parallelism fastest when a replica fits): tp=1 for a small model; the smallest tp whose
    training state fits a worker's memory for a large one; 1 when nothing divides or fits."""
    import parallel.backend as backend
    from parallel.backend import smallest_fitting_tp

    assert smallest_fitting_tp(TINY, 4, 4) == 1
    big = {**TINY, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
           "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
    gib = 1 << 30
    monkeypatch.setattr(backend, "_memory_per_worker", lambda n: (320 * gib, "test: 320 GiB per worker"))
    assert smallest_fitting_tp(big, 8, 8) == 8  # 70B fp32: weights, grads and Adam fit (2x headroom) only at tp=8
    _, need = estimate_rank_bytes(big, ParallelStrategy(dp=1, tp=8), True)
    _, need4 = estimate_rank_bytes(big, ParallelStrategy(dp=2, tp=4), True)
    assert 2 * need <= 320 * gib < 2 * need4
    monkeypatch.setattr(backend, "_memory_per_worker", lambda n: (80 * gib, "test: 80 GiB per worker"))
    assert smallest_fitting_tp(big, 8, 8) == 1  # fits nowhere: the layout check names the shortfall
    assert smallest_fitting_tp({**big, "num_attention_heads": 63, "num_key_value_heads": 7}, 8, 8) == 1
