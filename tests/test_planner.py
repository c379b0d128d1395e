"""The allocation planner on described clusters: the simulator prices the runtime's own plan,
the search finds the enumerated optimum, and what cannot work is a clear error.

(Predictions against measured steps on this machine: ``benchmarks/bench_planner.py``.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from realflow.config.cli import import_modules, parse_overrides
from realflow.api.experiment import experiment_registry
from realflow.system.plan_types import ParamRealloc
from realflow.planner.cluster import ClusterError, parse_cluster
from realflow.planner.models import load_model_config
from realflow.planner.bound import step_lower_bound
from realflow.planner.search import NoPlanFits, exhaustive, search
from realflow.planner.simulate import Workload, simulate

LONG = Workload(prompt_len=512, gen_len_mean=2048, gen_len_max=8192)


def _setup(name: str, tmp_path, *over: str):
    import_modules(["experiments", "parallel.backend"])
    return parse_overrides(experiment_registry.get(name), [f"fileroot={tmp_path}", *over]).setup()


def _roles(setup, model: str):
    cfg = load_model_config(model)
    return {r: cfg for r, s in setup.models.items() if s.backend != "none"}


def test_simulator_prices_the_compilers_hooks_and_overlaps_disjoint_mfcs(tmp_path):
    setup = _setup("grpo-math", tmp_path, "batch_size=64", "ppo.max_new_tokens=8192", "ppo.n_samples=8")
    cl = parse_cluster("16xh100")
    roles = _roles(setup, "qwen2.5-7b")
    same = simulate(setup, cl, roles, LONG, "d4t4")
    split = simulate(setup, cl, roles, LONG, "actor_train:d4t4,*:d16")
    assert not any(isinstance(h, ParamRealloc) for _, _, h in same.plan.hooks())
    assert all(m.hooks_s == 0 for m in same.mfcs)
    gen = next(m for m in split.mfcs if m.name == "actor_gen")
    assert any(isinstance(h, ParamRealloc) for h in split.plan.pre_hooks["actor_gen"]) and gen.hooks_s > 0
    train = next(m for m in split.mfcs if m.name == "actor_train")
    assert train.start == pytest.approx(gen.end) and split.step_s == pytest.approx(train.end)
    # the trained role's home holds weights + fp32 grads + Adam states: more than the weights alone
    assert split.max_peak_bytes > 7e9 * 2 / 16

    ppo = _setup("ppo-math", tmp_path, "batch_size=64", "ppo.max_new_tokens=8192", "ppo.n_samples=8")
    halves = simulate(ppo, cl, _roles(ppo, "qwen2.5-7b"), LONG, "actor_train:d8@0-7,critic_train:d8@8-15,*:d16")
    at, ct = (next(m for m in halves.mfcs if m.name == n) for n in ("actor_train", "critic_train"))
    assert at.workers == tuple(range(8)) and ct.workers == tuple(range(8, 16))
    assert max(at.start, ct.start) < min(at.end, ct.end)  # independent MFCs on disjoint devices overlap


@pytest.mark.parametrize("exp,model,cluster,n", [("grpo-math", "qwen2.5-1.5b", "8xh100", 32),
                                                 ("ppo-math", "qwen2.5-1.5b", "2xa100", 16)])
def test_search_finds_the_enumerated_optimum(tmp_path, exp, model, cluster, n):
    setup = _setup(exp, tmp_path, f"batch_size={n}", "ppo.max_new_tokens=8192", "ppo.n_samples=8")
    cl = parse_cluster(cluster)
    roles = _roles(setup, model)
    found = search(setup, cl, roles, LONG)
    best = exhaustive(setup, cl, roles, LONG)
    assert found.best.step_s == pytest.approx(best.step_s, rel=1e-9), (found.best.allocation, best.allocation)
    assert found.best.fits and found.best_global is not None
    assert found.best.step_s <= found.best_global.step_s  # never slower than one global strategy
    assert [p.step_s for p in found.ranked] == sorted(p.step_s for p in found.ranked)
    # the lower bound holds for the enumerated optimum, and the generation alone is below it
    bound = step_lower_bound(found.best, setup, cl, roles, LONG)
    assert 0 < bound.seconds <= best.step_s * (1 + 1e-9)
    assert bound.fastest["actor_gen"][1] <= bound.chain_s <= bound.seconds


def test_when_no_global_strategy_fits_the_search_walks_to_a_plan_that_does(tmp_path):
    """70B on 1024 H100s: no one (dp, tp, pp) fits every MFC (generation cannot pipeline and t8
    alone leaves too little memory for the training state), yet mixing layouts does."""
    setup = _setup("grpo-math", tmp_path, "batch_size=1024", "ppo.n_samples=8", "ppo.max_new_tokens=8192")
    found = search(setup, parse_cluster("1024xh100"), _roles(setup, "llama3-70b"), LONG)
    assert found.best_global is None and found.best.fits
    gen, train = (found.best.plan.placements[m].layout.strategy for m in ("actor_gen", "actor_train"))
    assert gen.pp == 1 and train.pp > 1  # the mix: a pipelined trainer, an unpipelined generator
    assert found.best_training_strategy is None or found.best.step_s <= found.best_training_strategy.step_s


def test_a_small_critic_gets_a_smaller_share_of_the_devices(tmp_path):
    """ReaLHF's shape: a 32B actor and reference, a 7B critic. The best plan splits the devices
    unequally, the critic's MFCs on the smaller share running beside the actor's."""
    setup = _setup("ppo-math", tmp_path, "batch_size=1024", "ppo.kl_coef=0.05", "ppo.max_new_tokens=1024")
    roles = {**_roles(setup, "qwen2.5-32b"), "critic": load_model_config("qwen2.5-7b")}
    found = search(setup, parse_cluster("128xh100"), roles, Workload(gen_len_mean=512, gen_len_max=1024))
    pl = found.best.plan.placements
    actor_devs, critic_devs = len(set(pl["actor_train"].layout.workers)), len(set(pl["critic_train"].layout.workers))
    assert critic_devs < actor_devs < 128 and not set(pl["actor_train"].layout.workers) & set(pl["critic_train"].layout.workers)
    times = {m.name: m for m in found.best.mfcs}
    assert times["critic_train"].start < times["actor_train"].end and times["actor_train"].start < times["critic_train"].end
    assert found.best.step_s < found.best_training_strategy.step_s


def test_a_model_that_fits_nowhere_says_how_much_memory_it_needs(tmp_path):
    setup = _setup("grpo-math", tmp_path, "batch_size=8")
    with pytest.raises(NoPlanFits, match=r"no allocation fits 2 x a100 \([\d.]+ GiB each\).*need at least [\d.]+ GiB"):
        search(setup, parse_cluster("2xa100"), _roles(setup, "llama3-70b"), LONG)


def test_bad_cluster_descriptions_name_what_is_missing(tmp_path):
    with pytest.raises(ClusterError, match="not a file, 'local' or '<N>x<profile>'"):
        parse_cluster("sixteen-gpus")
    with pytest.raises(ClusterError, match=r"no device profile 'v100'; shipped: .*h100"):
        parse_cluster("8xv100")
    with pytest.raises(ClusterError, match="do not fill nodes of 8"):
        parse_cluster("12xh100")
    bad = tmp_path / "c.json"
    for body, needle in [({"nodes": 2, "device": "h100"}, "missing field 'devices_per_node'"),
                         ({"nodes": 0, "devices_per_node": 8, "device": "h100"}, "nodes=0 must be an integer >= 1"),
                         ({"nodes": 2, "devices_per_node": 8, "device": "h100", "gpus": 3}, r"unknown field\(s\) \['gpus'\]"),
                         ({"nodes": 2, "devices_per_node": 8, "device": "h100", "inter_node": {"bandwidth": 1}},
                          "inter_node must be")]:
        bad.write_text(json.dumps(body))
        with pytest.raises(ClusterError, match=needle):
            parse_cluster(str(bad))
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"nodes": 2, "devices_per_node": 4, "device": "a100", "memory_bytes": 40 * 2**30,
                              "inter_node": {"alpha_s": 2e-5, "bandwidth": 1.25e10}}))
    cl = parse_cluster(str(ok))
    assert cl.n_devices == 8 and cl.device.memory_bytes == 40 * 2**30
    assert cl.link([0, 1]) == cl.device.intra_node and cl.link([3, 4]).bandwidth == 1.25e10


def test_plan_command_prints_ranked_plans_and_draws_the_timeline(tmp_path):
    png = tmp_path / "t.png"
    res = subprocess.run([sys.executable, "-m", "realflow.apps.main", "plan", "model=qwen2.5-7b", "cluster=16xh100",
                          "experiment=grpo-math", f"fileroot={tmp_path}", "batch_size=64", "ppo.max_new_tokens=8192",
                          "workload.gen_len_max=8192", "--timeline", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "best single global strategy:" in res.stdout and "rank" in res.stdout
    assert "best training strategy (generation's pp folded into dp):" in res.stdout
    assert png.stat().st_size > 5000
    role = subprocess.run([sys.executable, "-m", "realflow.apps.main", "plan", "model=qwen2.5-7b", "cluster=16xh100",
                           "experiment=ppo-math", f"fileroot={tmp_path}", "models.critc=qwen2.5-1.5b"],
                          capture_output=True, text=True, timeout=120)
    assert role.returncode == 2 and "models.critc: the experiment has no role 'critc'" in role.stderr
    assert "['actor', 'critic']" in role.stderr
    bad = subprocess.run([sys.executable, "-m", "realflow.apps.main", "plan", "model=qwen2.5-7b", "cluster=16xh100",
                          "experiment=grpo-math", "workload.gen_len=5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown workload key(s) ['gen_len']" in bad.stderr


def test_allocation_auto_chooses_before_the_run_and_says_why(tmp_path):
    """On this machine's profile (the shipped cpu-example unless REALFLOW_DEVICE_PROFILE names one),
    the default GRPO model is fastest data-parallel (as bench_planner measures): auto picks d2."""
    env = {k: v for k, v in os.environ.items() if k != "REALFLOW_DEVICE_PROFILE"}
    res = subprocess.run([sys.executable, "-m", "realflow.apps.main_sync_ppo", "allocation=auto", f"fileroot={tmp_path}",
                          "--dry-run"], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "allocation=auto chose 'd2'" in res.stdout and "best single global strategy: 'd2'" in res.stdout
    assert "workload assumed:" in res.stdout


def test_allocation_auto_splits_an_asynchronous_run_between_servers_and_trainer(tmp_path):
    """``n_workers`` devices in all: the planner picks how many generate and the trainer's plan;
    the dry run shows the split it will start (builtin servers are one process each)."""
    env = {k: v for k, v in os.environ.items() if k != "REALFLOW_DEVICE_PROFILE"}
    res = subprocess.run([sys.executable, "-m", "realflow.apps.main_async_ppo", "allocation=auto", "n_workers=3",
                          f"fileroot={tmp_path}", "--dry-run"], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("allocation=auto chose"))
    chosen = line.split("'")[1]
    gen, train = chosen.split("+")
    from experiments.async_ppo_math import _AsyncBase
    from realflow.api.allocation import parse_strategy

    servers = parse_strategy(gen.removeprefix("gen:"))
    assert servers.tp == 1 and servers.dp + _AsyncBase.n_train_workers(train) == 3, chosen
    assert "generation/training splits compared" in res.stdout and "predicted:" in res.stdout
    assert f"gen_server/0..{servers.dp - 1}: builtin backend, tp=1" in res.stdout  # what the run starts
    one = subprocess.run([sys.executable, "-m", "realflow.apps.main_async_ppo", "allocation=auto", "n_workers=1",
                          f"fileroot={tmp_path}", "--dry-run"], capture_output=True, text=True, timeout=180, env=env)
    assert one.returncode == 2 and "needs at least 2 workers" in one.stderr


def test_a_padded_engine_pays_for_the_batchs_longest_sequence(tmp_path):
    """SFT on the CPU engine with padded micro-batches (``training.pad_free=off``: every sequence
    of a micro-batch runs as long as its longest) costs more when the lengths vary than when all
    are the mean; pad-free micro-batches (the default) and a packed-attention device (H100) pay
    only the real tokens. A longest below the mean is refused."""
    from parallel.overheads import TINY

    for cluster, extra, padded in (("local", ["training.pad_free=off"], True), ("local", [], False),
                                   ("8xh100", [], False)):
        setup = _setup("sft", tmp_path, "batch_size=64", *extra)
        roles = {r: dict(TINY, num_hidden_layers=4) for r, s in setup.models.items() if s.backend != "none"}
        cl = parse_cluster(cluster, local_devices=setup.n_workers, local_profile="cpu-example")
        even = simulate(setup, cl, roles, Workload(seq_len=256), "d2" if cluster == "local" else "d8")
        ragged = simulate(setup, cl, roles, Workload(seq_len=256, seq_len_max=512),
                          "d2" if cluster == "local" else "d8")
        if padded:  # (the runtime's partition groups similar lengths: less than the longest for all)
            assert 1.05 * even.step_s < ragged.step_s < 2 * even.step_s
        else:
            assert ragged.step_s == pytest.approx(even.step_s)
    with pytest.raises(ValueError, match="seq_len_max=100.0 < seq_len=256"):
        Workload(seq_len=256, seq_len_max=100.0)


def test_a_groups_shared_prompt_makes_its_train_and_inference_cheaper(tmp_path):
    """GRPO's 8 answers per prompt behind a long prompt: with ``training.shared_prefix`` (the
    default) the planner prices each group's prompt once in the actor's train step, ``off`` 8
    times; generation is priced the same either way."""
    from realflow.planner.simulate import Workload

    cl = parse_cluster("8xh100")
    long_prompt = Workload(prompt_len=2048, gen_len_mean=512, gen_len_max=1024)
    times = {}
    for mode in ("auto", "off"):
        setup = _setup("grpo-math", tmp_path, "batch_size=64", "ppo.n_samples=8", f"training.shared_prefix={mode}")
        pred = simulate(setup, cl, _roles(setup, "qwen2.5-1.5b"), long_prompt, "d8")
        times[mode] = {m.name: m.end - m.start for m in pred.mfcs}
    assert times["auto"]["actor_train"] < 0.5 * times["off"]["actor_train"]
    assert times["auto"]["actor_gen"] == pytest.approx(times["off"]["actor_gen"])


def test_a_precision_the_profile_does_not_price_is_refused(tmp_path):
    from realflow.system.plan_types import PlanError

    cl = parse_cluster("16xh100")  # a bf16 profile
    bf16 = _setup("grpo-math", tmp_path, "batch_size=64", "precision=bf16")
    auto = _setup("grpo-math", tmp_path, "batch_size=64")
    roles = _roles(auto, "qwen2.5-7b")
    assert simulate(bf16, cl, roles, LONG, "d4t4").step_s == simulate(auto, cl, roles, LONG, "d4t4").step_s
    fp32 = _setup("grpo-math", tmp_path, "batch_size=64", "precision=fp32")
    with pytest.raises(PlanError, match=r"model 'actor': precision=fp32, but device profile 'h100' prices bf16"):
        simulate(fp32, cl, roles, LONG, "d4t4")
