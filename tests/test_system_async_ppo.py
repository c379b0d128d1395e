"""Asynchronous PPO end to end through the real launcher: master, model worker, generation
server, rollout controller and rollout worker as separate processes (``gen:d1+train:d1``).

A small SFT run first produces the starting checkpoint, as the default does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import copy_sft_start

from realflow.base.fault_injection import ENV as FAULT_ENV
from realflow.base.fault_injection import fired

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = os.path.join(REPO, "tests", "plugins")
# the short-answer task (the async default is worked_arithmetic, whose SFT start takes minutes)
FAST = ["dataset.task=arithmetic", "ppo.max_new_tokens=16", "dataset.n_test=32", "eval_n_samples=2",
        "dataset.n_train=4000"]


def _run(module_args, fileroot, *overrides, timeout=600, env=None):
    cmd = [sys.executable, "-m", *module_args, f"fileroot={fileroot}", *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGINS, os.environ.get("PYTHONPATH", "")]), **(env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _rows(run_dir):
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if "actor_train/reward" in r]


@pytest.fixture(scope="module")
def fileroot(tmp_path_factory, small_sft_start):
    return copy_sft_start(small_sft_start, tmp_path_factory.mktemp("async"))


@pytest.mark.timeout(300)
def test_async_grpo_raises_reward_within_the_staleness_bound(fileroot):
    steps, eta = 30, 2
    res = _run(["realflow.apps.main_async_ppo"], fileroot, *FAST, f"max_train_steps={steps}", "batch_size=16",
               "actor_optimizer.lr=1e-4", "reward=arithmetic_consistency", f"rollout.max_head_offpolicyness={eta}",
               "seed=3", "trial_name=learn")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(fileroot / "async-grpo-math" / "learn")
    assert len(rows) == steps
    assert max(r["async/offpolicy_head_max"] for r in rows) <= eta
    assert [r["async/version"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["async/weight_rounds"] >= steps - 2  # a round per step (a superseded one may be skipped)
    # train-inference mismatch, split by version offset: the tokens of the trainer's own version (offset 0)
    # differ by fp32 round-off only; staler ones by what the trainer learned since (mfc.mismatch)
    fresh = [r["actor_train/mismatch/v0_abs_mean"] for r in rows if "actor_train/mismatch/v0_abs_mean" in r]
    assert fresh and max(fresh) <= 1e-5, fresh
    assert any(r.get("actor_train/mismatch/v1_abs_mean", 0) > 1e-4 for r in rows)
    first = sum(r["actor_train/reward"] for r in rows[:5]) / 5
    last = sum(r["actor_train/reward"] for r in rows[-5:]) / 5
    assert last > first + 0.15, (first, last)
    assert "held-out sampled_accuracy:" in res.stdout


@pytest.mark.timeout(300)
def test_on_policy_eta_zero_trains_only_the_current_version(fileroot):
    res = _run(["realflow.apps.main_async_ppo"], fileroot, *FAST, "max_train_steps=4", "batch_size=8",
               "rollout.max_head_offpolicyness=0", "trial_name=eta0", "rollout.interrupt_mode=recompute",
               "rollout.weight_sync=broadcast")  # the path to servers on other hosts, forced on one host
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = fileroot / "async-grpo-math" / "eta0"
    rows = _rows(run_dir)
    logs = "".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))
    assert "(broadcast to 1, " in logs and "joined weight group 'realflow-weights'" in logs
    assert "not delivered" not in logs and "keep their weights until" not in logs  # (no failed round)
    assert len(rows) == 4
    for r in rows:
        assert r["async/offpolicy_head_max"] == 0 and r["async/offpolicy_tail_mean"] == 0
        # every token came from the weights being trained: behaviour == proximal policy
        assert r["actor_train/gen_train_kl"] < 1e-8
        assert abs(r["actor_train/behav_imp_weight"] - 1.0) < 1e-4
        assert r["actor_train/mismatch/v0_frac"] == 1.0 and r["actor_train/mismatch/abs_mean"] <= 1e-5


@pytest.mark.timeout(300)
def test_failing_agent_and_slow_reward_are_counted_not_fatal(fileroot):
    res = _run(["realflow.apps.main_async_ppo", "--import", "flaky_agent"], fileroot, *FAST, "max_train_steps=3",
               "batch_size=8", "rollout.agent=flaky", "rollout.agent_args={\"every\": 10}",
               "rollout.reward_timeout_s=1", "trial_name=flaky",
               "rollout.weight_sync=disk",
               # (the same run:) bf16 servers of an fp32 trainer, loading every version from disk,
               # with IcePop and the doctor's dumps
               "rollout.precision=bf16", "ppo.mismatch_correction=icepop", "mismatch_dump_every=2")
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = fileroot / "async-grpo-math" / "flaky"
    rows = _rows(run_dir)
    assert len(rows) == 3 and rows[-1]["async/agent_errors"] > 0
    # the servers' bf16 shows as a gap far above fp32 round-off, at every version offset
    for r in rows:
        assert r["actor_train/mismatch/abs_mean"] > 1e-4 and "actor_train/mismatch/corrected_frac" in r, r
    from realflow.system.mismatch_dump import load_dump

    dump = load_dump(str(run_dir), 2)
    assert dump.settings["gen_precision"] == "bf16" and dump.settings["trainer_precision"] == "fp32"
    assert dump.samples and all(len(s.behaviour_logprobs) == len(s.input_ids) - s.prompt_len for s in dump.samples)
    assert all(s.trainer_logprobs is not None and s.versions for s in dump.samples)
    log = (run_dir / "logs" / "rollout_worker" / "0.log").read_text()
    assert "flaky agent refuses row" in log
    assert "reward 'sleepy' did not finish" in log


@pytest.mark.timeout(300)
def test_generation_server_killed_mid_run_the_run_goes_on(fileroot):
    trial = "killed"
    run_dir = fileroot / "async-grpo-math" / trial
    # gen_server/0 (of 2) kills itself (SIGKILL) as its 5th request arrives: see realflow.base.fault_injection
    res = _run(["realflow.apps.main_async_ppo"], fileroot, *FAST, "max_train_steps=10", "batch_size=8",
               "allocation=gen:d2+train:d1", f"trial_name={trial}", timeout=240,
               env={FAULT_ENV: "gen_server/0@generate=5"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert fired(str(run_dir))["process"] == "gen_server/0"  # killed
    rows = _rows(run_dir)
    assert len(rows) == 10
    log = (run_dir / "logs" / "rollout_controller.log").read_text()
    assert "generation server gen_server/0" in log and "lost" in log


def test_dry_run_prints_and_draws_processes_and_flows(tmp_path):
    res = _run(["realflow.apps.main_async_ppo"], tmp_path, "--dry-run", "allocation=gen:d2+train:d1", timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "gen_server/0..1: builtin backend" in res.stdout
    assert "rollout_worker -> model_worker inbox: trajectories" in res.stdout
    assert (tmp_path / "async-grpo-math" / "trial0" / "processes.png").stat().st_size > 10_000
