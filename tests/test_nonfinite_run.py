"""A run never trains on a non-finite step (issue 22): real launcher, master and two model workers.

The ``sft-poison`` experiment (tests/plugins/poison_sft.py) is SFT whose loss turns NaN at
step 2 in the micro-batch that holds one chosen data row. Every step trains on the whole
data set, so that row is in step 2's batch. In d2 and in t2:

* ``on_nonfinite=stop`` ends the run at step 2 with one line naming the step, the MFC, the
  model, the micro-batch, the row's id and the last good checkpoint and recover point, and
  nothing is written after the fault (no step-2 checkpoint, no final one, no later recover point);
* ``on_nonfinite=skip`` finishes, counts the skipped step, and its parameters equal, bit for
  bit, those of a run that stopped after step 1 (the poisoned update was not applied).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = os.path.join(REPO, "tests", "plugins")
FAST = ["dataset.n_train=48", "dataset.n_test=8", "model.arch.hidden_size=64", "model.arch.num_hidden_layers=2",
        "model.arch.intermediate_size=128", "batch_size=48", "total_train_epochs=8", "optimizer.lr=3e-3",
        "optimizer.lr_scheduler_type=constant", "optimizer.warmup_steps_proportion=0", "eval_max_new_tokens=4",
        "max_tokens_per_mb=96"]  # a few rows per micro-batch: the message lists the poisoned one
ALLOCATIONS = {"d2": "d2", "t2": "d1t2"}


def _run(fileroot, trial, *overrides, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGINS, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "realflow.apps.main_sft", "experiment=sft-poison", "--import", "poison_sft",
           f"fileroot={fileroot}", f"trial_name={trial}", *FAST, *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A data set, tokenizer and start shared by every run, and the id of the row to poison."""
    from realflow.config.cli import import_modules, parse_overrides
    from realflow.api.experiment import experiment_registry

    fileroot = tmp_path_factory.mktemp("nonfinite")
    sys.path.insert(0, PLUGINS)
    import_modules(["experiments", "poison_sft"])  # --check prepares nothing: prepare as the launcher does
    cls = experiment_registry.get("sft-poison")
    parse_overrides(cls, [f"fileroot={fileroot}", "trial_name=prep", *FAST]).prepare()
    res = _run(fileroot, "prep", "--check")
    assert res.returncode == 0, res.stderr[-2000:]
    train = glob.glob(str(fileroot / "data" / "*" / "train.jsonl"))
    assert len(train) == 1, train
    with open(train[0]) as f:
        poison = str(json.loads(f.readline())["id"])
    return fileroot, poison


def _params(run_dir) -> dict:
    files = glob.glob(os.path.join(run_dir, "checkpoints", "default", "final", "*.safetensors"))
    assert files, f"no final checkpoint in {run_dir}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("layout", list(ALLOCATIONS))
def test_stop_names_the_step_and_row_and_saves_nothing_after_it(root, layout):
    fileroot, poison = root
    trial = f"stop-{layout}"
    res = _run(fileroot, trial, f"allocation={ALLOCATIONS[layout]}", f"poison_id={poison}", "poison_steps=2",
               "max_train_steps=4", "save_freq_steps=1", "recover_freq_steps=1", "on_nonfinite=stop")
    assert res.returncode != 0, res.stdout[-2000:]
    err = res.stderr
    assert "step 2: MFC 'sft_train' of model 'default': non-finite loss (nan) in micro-batch" in err, err[-3000:]
    assert f"'{poison}'" in err and "the update was not applied" in err, err[-3000:]
    run_dir = fileroot / "sft" / trial
    assert f"last good checkpoint: {run_dir / 'checkpoints' / 'default' / 'step1'} (step 1)" in err, err[-3000:]
    assert "last good recover point:" in err and "(step 1)" in err
    assert sorted(os.listdir(run_dir / "checkpoints" / "default")) == ["step1"]
    points = [p for p in os.listdir(run_dir / "recover") if not p.startswith(".")] \
        if (run_dir / "recover").is_dir() else []
    assert all("2" not in p.split("step")[-1] for p in points if "step" in p), points


@pytest.mark.parametrize("layout", list(ALLOCATIONS))
def test_skip_leaves_the_parameters_of_the_steps_before(root, layout):
    fileroot, poison = root
    alloc = f"allocation={ALLOCATIONS[layout]}"
    skip = _run(fileroot, f"skip-{layout}", alloc, f"poison_id={poison}", "poison_steps=2", "max_train_steps=2",
                "on_nonfinite=skip")
    assert skip.returncode == 0, skip.stderr[-3000:]
    assert "non-finite loss or gradient; the update was skipped" in skip.stdout + skip.stderr
    with open(fileroot / "sft" / f"skip-{layout}" / "stats.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = {r["step"]: r for r in rows if "sft_train/nonfinite_skipped" in r}
    assert steps[1]["sft_train/nonfinite_skipped"] == 0.0 and steps[2]["sft_train/nonfinite_skipped"] == 1.0
    assert steps[2]["nonfinite_skipped_steps"] == 1.0
    ref = _run(fileroot, f"ref-{layout}", alloc, "max_train_steps=1")
    assert ref.returncode == 0, ref.stderr[-3000:]
    a, b = _params(fileroot / "sft" / f"skip-{layout}"), _params(fileroot / "sft" / f"ref-{layout}")
    assert sorted(a) == sorted(b)
    assert all((a[k] == b[k]).all() for k in a), [k for k in a if not (a[k] == b[k]).all()]
