"""Mixture-of-experts RL end to end through the real launcher (issue 38).

The start is a tiny Qwen3-MoE (4 experts, top-2 in every layer) trained from scratch by the SFT
experiment (``model.arch.num_experts=4``).  Sync GRPO (the actor's colocated generator emits the
experts it chose; the trainer replays them) and async GRPO (the generation server returns them
through the trajectories) both raise the reward over a seeded run, report the routing statistics
(load-balancing loss, expert load, replay mismatch), sample from exactly the trained policy on
fresh data (behaviour log-probs equal the trainer's with replay), and leave no process behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import left_behind

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_SFT_START = ["dataset.n_train=3000", "dataset.n_test=64", "model.arch.hidden_size=64",
                 "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=128", "model.arch.num_experts=4",
                 "batch_size=32", "max_train_steps=400", "optimizer.lr=3e-3"]


def _run(module, fileroot, *overrides, timeout=600):
    cmd = [sys.executable, "-m", module, f"fileroot={fileroot}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _rows(run_dir):
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if "actor_train/reward" in r]



@pytest.fixture(scope="module")
def fileroot(tmp_path_factory):
    """A file root holding the MoE SFT start (~75 s on 2 cores) and its data."""
    root = tmp_path_factory.mktemp("moe")
    res = _run("realflow.apps.main_sft", root, *MOE_SFT_START, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(root / "sft" / "trial0" / "checkpoints" / "default" / "final" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_moe" and (cfg.get("num_experts") or cfg.get("num_local_experts")) == 4
    return root


def _check_learned_with_replay(rows, steps):
    assert len(rows) == steps
    first = sum(r["actor_train/reward"] for r in rows[:5]) / 5
    last = sum(r["actor_train/reward"] for r in rows[-5:]) / 5
    assert last > first + 0.15, ([round(r["actor_train/reward"], 3) for r in rows], first, last)
    for r in rows:
        assert r["actor_train/moe/replayed_tokens"] > 0 and 0.0 <= r["actor_train/moe/replay_mismatch"] <= 1.0
        assert r["actor_train/moe/aux_loss"] > 0 and r["actor_train/moe/expert_load"] >= 1.0
    # the first train step's data came from the weights being trained: with the generator's experts
    # replayed, the trainer's log-probs are the generator's
    assert rows[0]["actor_train/gen_train_kl"] < 1e-8, rows[0]["actor_train/gen_train_kl"]


@pytest.mark.timeout(600)
def test_sync_grpo_on_moe_replays_the_generators_experts_and_learns(fileroot):
    steps = 16
    res = _run("realflow.apps.main_sync_ppo", fileroot, f"max_train_steps={steps}", "batch_size=32",
               "ppo.n_samples=8", "ppo.n_minibatches=1", "actor_optimizer.lr=2e-3",
               "reward=arithmetic_consistency", "dataset.n_test=32", "seed=3", "trial_name=moe")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(fileroot / "grpo-math" / "moe")
    _check_learned_with_replay(rows, steps)
    # one optimizer step per batch (ppo.n_minibatches=1): every forward ran at the generation
    # weights, so the trainer's own router agrees with the replayed experts (up to ties)
    assert max(r["actor_train/moe/replay_mismatch"] for r in rows) < 0.02, rows[0]
    assert not left_behind(fileroot)


@pytest.mark.timeout(600)
def test_async_grpo_on_moe_carries_experts_from_the_server_and_learns(fileroot):
    steps = 24
    res = _run("realflow.apps.main_async_ppo", fileroot, "dataset.task=arithmetic", "ppo.max_new_tokens=16",
               "dataset.n_test=32", "eval_n_samples=2", "dataset.n_train=4000", f"max_train_steps={steps}",
               "batch_size=16", "reward=arithmetic_consistency", "actor_optimizer.lr=5e-4", "ppo.n_minibatches=1",
               "seed=3", "trial_name=amoe")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(fileroot / "async-grpo-math" / "amoe")
    _check_learned_with_replay(rows, steps)
    assert abs(rows[0]["actor_train/behav_imp_weight"] - 1.0) < 1e-4, rows[0]["actor_train/behav_imp_weight"]
    # the first step trains on data the server made with the same weights: the routers agree; later,
    # off-policy data (the trainer's router has moved since the server chose): replay covers the drift
    assert rows[0]["actor_train/moe/replay_mismatch"] < 0.02, rows[0]["actor_train/moe/replay_mismatch"]
    assert max(r["actor_train/moe/replay_mismatch"] for r in rows) > 0.01
    assert not left_behind(fileroot)
