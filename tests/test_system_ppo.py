"""Synchronous PPO / GRPO end to end through the real launcher (master + 2 model workers).

The GRPO run names the reallocating layout (the actor trains tensor-parallel, d1t2, and
generates data-parallel, d2, so parameters are reallocated before every generation); the
default layout is data-parallel everywhere.  A small SFT run first produces the starting
checkpoint, as the default ``main_sync_ppo`` does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import copy_sft_start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module_args, fileroot, *overrides, timeout=600):
    cmd = [sys.executable, "-m", *module_args, f"fileroot={fileroot}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _stats(run_dir):
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def fileroot(tmp_path_factory, small_sft_start):
    """A weak SFT checkpoint (lots of room for RL) where the PPO experiments look for it."""
    return copy_sft_start(small_sft_start, tmp_path_factory.mktemp("rl"))


#: the explicit reallocating layout (the default, data-parallel everywhere, reallocates nothing):
#: train tensor-parallel, generate data-parallel, the actor's weights moved between them every step
REALLOC = "allocation=actor_train:d1t2,*:d2"


@pytest.mark.timeout(600)
def test_grpo_raises_reward_with_reallocation_every_step(fileroot):
    # the self-consistency reward of the arithmetic format is dense enough for a weak model to learn
    # within a CI-sized run (the correctness reward of the default is shown by main_sync_ppo itself)
    steps = 30
    res = _run(["realflow.apps.main_sync_ppo"], fileroot, f"max_train_steps={steps}", "batch_size=32",
               "ppo.n_samples=8", "actor_optimizer.lr=1e-4", "reward=arithmetic_consistency",
               "dataset.n_test=64", "seed=3", REALLOC)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _stats(fileroot / "grpo-math" / "trial0") if "actor_train/reward" in r]
    assert len(rows) == steps
    # reallocation ran before every generation, and the generator then sampled from exactly the
    # trained weights: KL(behaviour || trainer) on the first mini-batch is at fp32 round-off
    assert all(r["actor_gen/hooks_pre_s"] > 0 for r in rows)
    assert max(r["actor_train/gen_train_kl"] for r in rows) < 1e-8, [r["actor_train/gen_train_kl"] for r in rows]
    # the train-inference gap logged every step (first mini-batch, mfc.mismatch): fp32 round-off
    assert max(r["actor_train/mismatch/abs_mean"] for r in rows) <= 1e-5
    first = sum(r["actor_train/reward"] for r in rows[:5]) / 5
    last = sum(r["actor_train/reward"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert "held-out sampled_accuracy:" in res.stdout
    # training.shared_prefix=auto (the default): each group's prompt computed once
    assert all(r["actor_train/n_computed_tokens"] < 0.8 * r["actor_train/n_tokens"] for r in rows), rows[0]


@pytest.mark.timeout(600)
def test_grpo_with_shared_prompts_ends_with_the_parameters_of_recomputed_prompts(fileroot):
    """``training.shared_prefix=auto`` vs ``off``, same seed, fp32: the same samples, rewards and
    final parameters (the same loss and gradients, summed over a group instead of recomputed),
    with about half the training tokens computed on the default task."""
    from safetensors.torch import load_file

    params, rows = {}, {}
    for mode in ("auto", "off"):
        res = _run(["realflow.apps.main_sync_ppo"], fileroot, "max_train_steps=3", "batch_size=16",
                   "ppo.n_samples=8", "dataset.n_test=8", "seed=5", f"training.shared_prefix={mode}",
                   f"trial_name=shared_{mode}")
        assert res.returncode == 0, res.stderr[-3000:]
        run = fileroot / "grpo-math" / f"shared_{mode}"
        rows[mode] = [r for r in _stats(run) if "actor_train/reward" in r]
        params[mode] = load_file(str(run / "checkpoints" / "actor" / "final" / "model.safetensors"))
    assert [r["actor_train/reward"] for r in rows["auto"]] == [r["actor_train/reward"] for r in rows["off"]]
    scale = max(p.abs().max().item() for p in params["off"].values())
    err = max((params["auto"][k] - p).abs().max().item() for k, p in params["off"].items()) / scale
    assert err <= 1e-5, err
    for a, o in zip(rows["auto"], rows["off"]):
        assert a["actor_train/n_tokens"] == o["actor_train/n_tokens"] == o["actor_train/n_computed_tokens"]
        assert a["actor_train/n_computed_tokens"] < 0.7 * a["actor_train/n_tokens"], a


@pytest.mark.timeout(600)
def test_ppo_with_critic_reference_ema_and_offload(fileroot):
    # (the same run:) truncated importance sampling of the train-inference gap: actor_inf recomputes
    # the trainer's log-probs before actor_train; every 2nd step leaves a dump for the doctor
    res = _run(["realflow.apps.main", "experiment=ppo-math"], fileroot, "max_train_steps=3", "batch_size=16",
               "ppo.kl_coef=0.05", "ppo.ref_ema_eta=0.5", "trial_name=ppo", "ppo.mismatch_correction=tis",
               "mismatch_dump_every=2")
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = fileroot / "ppo-math" / "ppo"
    rows = [r for r in _stats(run_dir) if "actor_train/reward" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["critic_train/loss"] >= 0 and "actor_train/kl_ref" in r
        assert r["actor_train/gen_train_kl"] < 1e-8
        assert r["actor_train/hooks_post_s"] > 0  # the EMA update actor -> ref
        assert r["time/actor_inf"] > 0 and r["actor_train/mismatch/abs_mean"] <= 1e-5
        assert r["actor_train/mismatch/corrected_frac"] == 0.0  # nothing near C = 2 in fp32
        assert abs(r["actor_train/behav_imp_weight"] - 1.0) < 1e-4
    from realflow.system.mismatch_dump import dump_steps, load_dump

    assert dump_steps(str(run_dir)) == [2]
    dump = load_dump(str(run_dir))
    assert dump.settings["trainer_precision"] == dump.settings["gen_precision"] == "fp32"
    assert len(dump.samples) == 8 and dump.samples[0].trainer_logprobs is not None
    for role in ("actor", "critic"):
        assert (run_dir / "checkpoints" / role / "final" / "config.json").is_file()
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(run_dir / "checkpoints" / "critic" / "final").num_labels == 1


def test_sync_ppo_dry_run_shows_reallocation(fileroot):
    res = _run(["realflow.apps.main_sync_ppo"], fileroot, "--dry-run", REALLOC, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "realloc actor d1t2p1@[0, 1] -> actor d2t1p1@[0, 1] [to MFC layout]" in res.stdout
    # the default: a replica of the small default model trains within a worker's memory, so every
    # MFC runs data-parallel on both workers (the fastest layout) and nothing is reallocated
    res = _run(["realflow.apps.main_sync_ppo"], fileroot, "--dry-run", "trial_name=default_alloc", timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "realloc actor" not in res.stdout, res.stdout
    assert "actor d2t1p1@[0, 1] (home; MFCs: actor_gen, actor_train)" in res.stdout, res.stdout
    assert (fileroot / "grpo-math" / "trial0" / "plan.png").is_file()
