"""LoRA RL end to end through the real launcher: the actor trains adapters on a frozen base.

Sync GRPO with a KL penalty in the reallocating layout (train d1t2, generate d2): the adapters
move with the weights, the reference is the actor's base with its adapters off (no REF model
is built), the generator samples from exactly the trained policy (gen/train KL at round-off),
the reward rises, and the final checkpoint is a PEFT adapter directory. Async GRPO with LoRA:
the generation server receives the adapters only and merges them, and its samples' behaviour
log-probs equal the trainer's (the decoupled loss's importance weight stays at 1 for fresh data).
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
    return copy_sft_start(small_sft_start, tmp_path_factory.mktemp("lora"))


@pytest.mark.timeout(600)
def test_lora_grpo_with_kl_to_the_base_raises_reward(fileroot):
    steps = 24
    res = _run(["realflow.apps.main_sync_ppo"], fileroot, f"max_train_steps={steps}", "batch_size=32",
               "ppo.n_samples=8", "actor_optimizer.lr=2e-3", "reward=arithmetic_consistency",
               "ppo.kl_coef=0.01", "dataset.n_test=64", "seed=3", "model.lora.enabled=true",
               "model.lora.r=16", "model.lora.alpha=32", "model.lora.target_modules=all-linear",
               "model.lora.dropout=0", "allocation=actor_train:d1t2,*:d2", "trial_name=lora")
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = fileroot / "grpo-math" / "lora"
    rows = [r for r in _stats(run_dir) if "actor_train/reward" in r]
    assert len(rows) == steps
    assert all("ref_inf/elapsed_s" in r or any(k.startswith("ref_inf/") for k in r) for r in rows[:1]), rows[0].keys()
    # reallocation carried the adapters: the generator sampled from exactly the trained weights
    assert max(r["actor_train/gen_train_kl"] for r in rows) < 1e-8, [r["actor_train/gen_train_kl"] for r in rows]
    kls = [r["actor_train/kl_ref"] for r in rows]
    assert abs(kls[0]) < 1e-6 and max(kls) > 1e-5, kls  # starts at the base, then departs from it
    first = sum(r["actor_train/reward"] for r in rows[:5]) / 5
    last = sum(r["actor_train/reward"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
    final = run_dir / "checkpoints" / "actor" / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()


FAST_ASYNC = ["dataset.task=arithmetic", "ppo.max_new_tokens=16", "dataset.n_test=32", "eval_n_samples=2",
              "dataset.n_train=4000"]


@pytest.mark.timeout(400)
def test_async_lora_servers_receive_adapters_only(fileroot):
    """On-policy async GRPO with LoRA: every update carries the adapters (bytes << the model), the
    server merges them into its base, and its behaviour log-probs equal the trainer's. (Adapter
    directories on disk, the other transport, are applied in tests/test_parallel_lora.py.)"""
    sync = "memory"
    res = _run(["realflow.apps.main_async_ppo"], fileroot, *FAST_ASYNC, "max_train_steps=4", "batch_size=8",
               "rollout.max_head_offpolicyness=0", f"trial_name=async_{sync}", f"rollout.weight_sync={sync}",
               "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0",
               "model.lora.target_modules=all-linear", "actor_optimizer.lr=2e-3", "ppo.kl_coef=0.01")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _stats(fileroot / "async-grpo-math" / f"async_{sync}") if "actor_train/reward" in r]
    assert len(rows) == 4
    for r in rows:
        # the tokens came from the server's merged weights == the trainer's adapters on the base
        assert r["actor_train/gen_train_kl"] < 1e-8, r["actor_train/gen_train_kl"]
        assert abs(r["actor_train/behav_imp_weight"] - 1.0) < 1e-4
    if sync == "memory":
        sent = [r["async/weight_sent_frac"] for r in rows if "async/weight_sent_frac" in r]
        assert sent and max(sent) == 1.0  # the whole update is sent: it is the adapter
        sent_bytes = [r["async/weight_sent_bytes"] for r in rows if r.get("async/weight_sent_bytes")]
        model_bytes = os.path.getsize(fileroot / "sft" / "trial0" / "checkpoints" / "default" / "final" /
                                      "model.safetensors")
        assert sent_bytes and max(sent_bytes) < 0.3 * model_bytes, (sent_bytes, model_bytes)


@pytest.mark.timeout(400)
def test_sft_with_lora_on_a_checkpoint_saves_a_peft_adapter(fileroot, tmp_path):
    """main_sft with LoRA on an existing checkpoint: only adapters train (the loss falls), and the
    saved adapter loads with PEFT onto that checkpoint."""
    start = fileroot / "sft" / "trial0" / "checkpoints" / "default" / "final"
    res = _run(["realflow.apps.main_sft"], tmp_path, f"model.path={start}", "dataset.n_train=1000",
               "dataset.n_test=32", "max_train_steps=30", "batch_size=32", "optimizer.lr=3e-3",
               "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0",
               "model.lora.target_modules=all-linear", "trial_name=lora")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _stats(tmp_path / "sft" / "lora") if "sft_train/loss" in r]
    key = "sft_train/loss"
    assert len(rows) == 30
    assert sum(r[key] for r in rows[-5:]) < sum(r[key] for r in rows[:5]), [r[key] for r in rows]
    final = tmp_path / "sft" / "lora" / "checkpoints" / "default" / "final"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(start), final)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0
