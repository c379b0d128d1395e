"""End to end through the real launcher: master + 2 model workers as OS processes,
ZMQ control plane, shared-memory data plane, gloo DDP, megatron-core model."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from realflow.base.fault_injection import ENV as FAULT_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["dataset.n_train=3000", "dataset.n_test=64", "model.arch.hidden_size=64", "model.arch.num_hidden_layers=2",
         "model.arch.intermediate_size=128", "batch_size=32", "max_train_steps=150"]


def run_sft(fileroot, *overrides, timeout=300):
    cmd = [sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={fileroot}", *SMALL, *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def read_stats(run_dir):
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.timeout(400)
def test_sft_through_launcher_lowers_loss_and_saves_loadable_checkpoint(tmp_path):
    wandb = ["wandb.mode=offline"] if importlib.util.find_spec("wandb") else []  # the [wandb] extra, if installed
    res = run_sft(tmp_path, "max_train_steps=150", "total_train_epochs=2", "optimizer.lr=3e-3", *wandb)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "sft" / "trial0"
    steps = [r for r in read_stats(run_dir) if "sft_train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 151))
    first = sum(r["sft_train/loss"] for r in steps[:5]) / 5
    last = sum(r["sft_train/loss"] for r in steps[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert "held-out accuracy:" in res.stdout

    # every process wrote its part of the timeline, merged into one Perfetto trace
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e.get("name") for e in events}
    assert "sft_train" in names and "setup" in names

    # TensorBoard event files exist next to the jsonl
    assert any(f.startswith("events.out.tfevents") for _, _, fs in os.walk(run_dir) for f in fs)

    # the run ended by drawing its plots (SFT: no reward panel) and, with W&B offline, left its W&B run
    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert plots == ["heldout.png", "loss.png", "mfc_time.png", "throughput.png"], plots
    assert all((run_dir / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    assert f"plots: {run_dir / 'plots'}" in res.stdout
    if wandb:
        run_id = (run_dir / "wandb_run_id").read_text().strip()
        assert list(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")), os.listdir(run_dir / "wandb")

    # the saved checkpoint loads in transformers and answers the held-out set exactly as the run reported
    from mfc.math_reward import verify_answer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reported = [r["eval/accuracy"] for r in read_stats(run_dir) if "eval/accuracy" in r][-1]
    ckpt = run_dir / "checkpoints" / "default" / "final"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = [json.loads(line) for line in open(tmp_path / "data" / "arith-d2-s0" / "test.jsonl")]
    correct = 0.0
    for row in rows:
        ids = tok([row["prompt"]], return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        correct += verify_answer(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), row["answer"],
                                 allow_last_number=False).reward
    assert correct / len(rows) == pytest.approx(reported, abs=1.5 / len(rows))  # one argmax tie may flip


@pytest.mark.timeout(300)
def test_worker_death_stops_everything_and_names_the_worker(tmp_path):
    # model_worker/1 kills itself (SIGKILL) in its second train step: see realflow.base.fault_injection
    cmd = [sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={tmp_path}", *SMALL, "max_train_steps=100000", "recover_mode=off"]
    console = tmp_path / "console.txt"
    with open(console, "w") as out_f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out_f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, FAULT_ENV: "model_worker/1@train_step=2"})
    try:
        proc.wait(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = console.read_text()
    pids = {name: int(pid) for name, pid in re.findall(r"started worker (\S+) \(pid (\d+)", out)}
    assert len(pids) == 3, out[-3000:]
    assert proc.returncode != 0
    assert "model_worker/1" in out and "worker 'model_worker/1' was killed by SIGKILL" in out, out[-3000:]
    time.sleep(0.5)
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} (pid {pid}) survived"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "overrides, expected",
    [  # the whole set is tests/bad_inputs (in-process, --check); these few prove the real command line
        (["optimzer.lr=1"], "unknown config key 'optimzer.lr'; did you mean optimizer.lr"),
        (["total_train_epochs=0"], "total_train_epochs=0 must be an integer >= 1"),
        # checked against the checkpoint that preparing the run creates, before any worker starts
        (["allocation=d1t3", "n_workers=3"], "tp=3 does not divide num_attention_heads=4"),
    ],
)
def test_bad_config_is_one_line_error(tmp_path, overrides, expected):
    res = run_sft(tmp_path, *overrides, timeout=120)
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    # one error line; an allocation error may be followed by the grammar it violates
    assert err[0].startswith("error:") and expected in err[0], res.stderr
    assert len(err) == 1 or err[1].startswith("allocation grammar"), res.stderr
    assert "Traceback" not in res.stderr


def test_bad_data_row_is_reported_with_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "solution": "#### 2", "answer": "2"}\n{"prompt": "", "solution": "x"}\n')
    res = run_sft(tmp_path, f"dataset.train_path={data}", f"dataset.test_path={data}", timeout=120)
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and f"{data}:2:" in err[0], res.stderr
