"""A newcomer's first hour, end to end: their own Qwen2-architecture checkpoint (a directory, or a
hub id in an offline Hugging Face cache) with a ChatML chat template, and their own data in the
shapes peers use, through the real launcher -- SFT, sync GRPO and async GRPO, two steps each.

Why these runs exist (each costs ~1 min): every piece is unit-tested (tests/test_data_formats.py,
tests/test_base_hf_models.py, tests/test_api_config_files.py), but only a real run shows that the
keys reach every process -- the trainer's data sets, the rollout workers, the generation servers
and the evaluation -- and that a user following the README gets a run, not a traceback. Each run
covers two data shapes (train and held-out files of different kinds); the config-file run also
checks the resolved config saved with it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from user_model_fixture import make_hub_cache, shared_chat_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [(f"What is {a} plus {b}?", a + b) for a, b in [(2, 3), (4, 4), (7, 1), (5, 6), (9, 2), (3, 3)]]
#: small and quick: one worker, 2 steps of 2 prompts, short answers, one held-out sample each
FAST = ["n_workers=1", "max_train_steps=2", "batch_size=2", "recover_mode=off", "trace=false", "log_samples=4"]
RL_FAST = FAST + ["ppo.n_samples=2", "ppo.max_new_tokens=8", "eval_n_samples=1"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(app: str, root, *args: str, env: dict | None = None, timeout: int = 420):
    cmd = [sys.executable, "-m", f"realflow.apps.{app}", f"fileroot={root}", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _logged(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _chat_ids(tok, messages, generation_prompt=True) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)["input_ids"])


def _trained_prompts(run_dir, mfc="actor_train") -> list[list[int]]:
    """The prompt ids of every sequence the trainer logged (log_samples): what it trained on."""
    recs = _logged(os.path.join(run_dir, "samples", f"{mfc}.jsonl"))
    assert recs and {r["step"] for r in recs} == {1, 2}, recs  # steps count from 1, as stats.jsonl
    return [s["input_ids"][:s["prompt_len"]] for r in recs for s in r["sequences"]]


def _steps(run_dir) -> int:
    """Train steps logged (evaluation rows have no train loss)."""
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return sum(1 for line in f if line.strip() and any(k.endswith("_train/loss") for k in json.loads(line)))


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's world: a checkpoint directory, the same checkpoint as a cached hub id, data files."""
    tok_dir, ckpt = shared_chat_model(tmp_path_factory)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    d = tmp_path_factory.mktemp("user_data")
    cache = str(d / "hf_cache")
    make_hub_cache(cache, "acme/tiny-chat", ckpt)
    gsm8k = _jsonl(d / "gsm8k.jsonl", [{"question": q, "answer": f"{q} It is {a}.\n#### {a}"} for q, a in QUESTIONS])
    trl = _jsonl(d / "trl.jsonl", [{"prompt": [{"role": "system", "content": "Answer briefly."},
                                               {"role": "user", "content": q}], "solution": str(a)}
                                   for q, a in QUESTIONS])
    verl = str(d / "verl.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "toy", "prompt": [{"role": "user", "content": q}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(a)}, "extra_info": {"index": i}}
        for i, (q, a) in enumerate(QUESTIONS)]), verl)
    custom_rows = [{"instruction": q, "meta": {"gold": a}} for q, a in QUESTIONS]
    custom = _jsonl(d / "custom.jsonl", custom_rows)
    import datasets

    saved = str(d / "custom_saved")
    datasets.Dataset.from_list(custom_rows).save_to_disk(saved)
    messages = _jsonl(d / "messages.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"It is {a}. #### {a}"}]}
        for q, a in QUESTIONS])
    return {"tok": tok, "ckpt": ckpt, "cache": cache, "gsm8k": gsm8k, "trl": trl, "verl": verl, "custom": custom,
            "saved": saved, "messages": messages, "dir": d}


@pytest.mark.timeout(600)
def test_sft_from_messages_through_a_config_file(user, tmp_path):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model:\n  path: {user['ckpt']}\ndataset:\n  train_path: {user['messages']}\n"
                   f"  test_path: {user['gsm8k']}\noptimizer:\n  lr: 0.01\neval_max_new_tokens: 8\n")
    res = _run("main_sft", tmp_path, "--config", str(cfg), "optimizer.lr=0.002", *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "sft" / "trial0"
    assert _steps(run) == 2
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())  # the resolved config, kept with the run
    assert saved["optimizer"]["lr"] == 0.002 and saved["dataset"]["train_path"] == user["messages"]
    assert "held-out accuracy:" in res.stdout
    # the trainer saw each conversation as apply_chat_template renders it, its prompt the first turn's
    tok = user["tok"]
    convs = {json.dumps(_chat_ids(tok, r["messages"], False)): r["messages"] for r in _logged(user["messages"])}
    seqs = [s for r in _logged(run / "samples" / "sft_train.jsonl") for s in r["sequences"]]
    assert len(seqs) == 4
    for s in seqs:
        msgs = convs[json.dumps(s["input_ids"])]
        assert s["input_ids"][:s["prompt_len"]] == _chat_ids(tok, msgs[:1])


@pytest.mark.timeout(600)
def test_sync_grpo_on_a_cached_hub_id_from_verl_parquet(user, tmp_path):
    env = {"HF_HUB_CACHE": user["cache"], "HF_HUB_OFFLINE": "1"}
    res = _run("main_sync_ppo", tmp_path, "model.path=acme/tiny-chat", f"dataset.train_path={user['verl']}",
               f"dataset.test_path={user['trl']}", "allocation=d1", *RL_FAST, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _steps(tmp_path / "grpo-math" / "trial0") == 2
    assert "held-out sampled_accuracy:" in res.stdout
    expected = [_chat_ids(user["tok"], [{"role": "user", "content": q}]) for q, _ in QUESTIONS]
    trained = _trained_prompts(tmp_path / "grpo-math" / "trial0")
    assert len(trained) == 8 and all(p in expected for p in trained), trained  # 4 samples x 2 answers


@pytest.mark.timeout(600)
def test_async_grpo_with_mapped_fields_from_a_saved_dataset(user, tmp_path):
    res = _run("main_async_ppo", tmp_path, f"model.path={user['ckpt']}", f"dataset.train_path={user['saved']}",
               f"dataset.test_path={user['custom']}", "dataset.prompt_key=instruction",
               "dataset.answer_key=meta.gold", "dataset.system_prompt=Answer briefly.", *RL_FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "async-grpo-math" / "trial0"
    assert _steps(run) == 2
    # the system prompt and the mapped field, rendered by the tokenizer's template, in the trainer and in
    # what the generation server was asked
    expected = [_chat_ids(user["tok"], [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": q}]) for q, _ in QUESTIONS]
    trained = _trained_prompts(run)
    assert len(trained) == 8 and all(p in expected for p in trained), trained
    served = _logged(run / "samples" / "gen_server_0.jsonl")
    assert len(served) == 4 and all(r["prompt_ids"] in expected for r in served), served
    assert all(r["prompt"].startswith("<|im_start|>system\nAnswer briefly.") for r in served)


def test_check_refuses_overlong_prompts_fast_and_writes_nothing(user, tmp_path):
    """--check tokenizes the data as the workers will: prompts over the limit are refused naming the
    key, the count and the length to set, within seconds, before anything is prepared or written."""
    import time

    long_rows = [{"question": "Please add these numbers carefully: " + " plus ".join(["7"] * 20), "answer": "140"}] * 3
    data = _jsonl(tmp_path / "long.jsonl", long_rows + [{"question": "2+3?", "answer": "5"}])
    root = tmp_path / "root"
    t0 = time.monotonic()
    res = _run("main_sync_ppo", root, f"model.path={user['ckpt']}", f"dataset.train_path={data}",
               f"dataset.test_path={user['gsm8k']}", "dataset.max_prompt_len=24", "--check", timeout=120)
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "3 of 4 prompts are longer than dataset.max_prompt_len=24" in line, line
    assert "dataset.filter_overlong=true" in line and "set dataset.max_prompt_len=" in line, line
    assert took < 20, took
    assert not root.exists()  # no run directory, no checkpoint, no SFT start
    ok = _run("main_sync_ppo", root, f"model.path={user['ckpt']}", f"dataset.train_path={data}",
              f"dataset.test_path={user['gsm8k']}", "dataset.max_prompt_len=24", "dataset.filter_overlong=true",
              "--check", timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "training data: kept 1/4 rows (dropped 3: prompt_too_long: 3)" in ok.stdout, ok.stdout


def test_check_of_the_default_trains_nothing(tmp_path):
    """The default's SFT start and data are what the run makes first: --check lists them, makes none."""
    res = _run("main_async_ppo", tmp_path / "root", "--check", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "not checked (the run creates it first)" in res.stdout
    assert not (tmp_path / "root").exists()
