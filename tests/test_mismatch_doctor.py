"""The mismatch doctor names the injected cause: a bf16 generator, a perturbed layer in the
generator's weight copy, stale weights; a clean fp32 dump is no mismatch; bad input is one line.

The doctor runs as the user runs it (``realflow doctor mismatch RUN_DIR``, through
``realflow.apps.main``), on dumps written with ``write_dump`` from samples that the built-in
generation engine really generated under the fault.  The four replays share one process
(:func:`parallel.testing.run_cases`, a world of one: megatron is imported once).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from parallel.testing import make_tiny_hf, run_cases

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = __name__.rsplit(".", 1)[-1]
REPO = os.path.dirname(HERE)
LAYER = 1  # the layer whose MLP the generator's copy gets wrong


def _model(ctx) -> str:
    path = os.path.join(ctx.tmpdir, "model")
    if "model" not in ctx.cache:
        make_tiny_hf(path, "qwen2", seed=3)
        ctx.cache["model"] = path
    return path


def _doctor(run_dir: str) -> dict:
    """``realflow doctor mismatch RUN_DIR``: exit code, printed lines and the JSON report."""
    from realflow.apps.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["doctor", "mismatch", run_dir])
    files = sorted(os.listdir(os.path.join(run_dir, "mismatch")))
    js = [f for f in files if f.startswith("doctor_step_") and f.endswith(".json")]
    report = json.load(open(os.path.join(run_dir, "mismatch", js[0]))) if js else {}
    return {"rc": rc, "text": out.getvalue(), "report": report, "png": any(f.endswith(".png") for f in files)}


def case_clean(ctx):
    import mismatch_faults as mf

    m, run = _model(ctx), os.path.join(ctx.tmpdir, "clean")
    mf.write(run, 1, m, mf.generate(m), 0)
    return _doctor(run)


def case_bf16_generator(ctx):
    import mismatch_faults as mf

    m, run = _model(ctx), os.path.join(ctx.tmpdir, "bf16")
    mf.write(run, 1, m, mf.generate(m, "bf16"), 0, settings={"gen_precision": "bf16"})
    return _doctor(run)


def case_perturbed_layer(ctx):
    import mismatch_faults as mf

    m, run = _model(ctx), os.path.join(ctx.tmpdir, "layer")
    copy = mf.perturbed(m, os.path.join(ctx.tmpdir, "perturbed"), layer=LAYER, op="mlp")
    mf.write(run, 1, m, mf.generate(copy), 0, gen_weights=copy)
    return _doctor(run)


def case_stale_version(ctx):
    import mismatch_faults as mf

    m, run = _model(ctx), os.path.join(ctx.tmpdir, "stale")
    v1 = mf.perturbed(m, os.path.join(ctx.tmpdir, "v1"))  # the weights after one more update
    mf.write(run, 1, m, mf.generate(m, seed=7), 0)
    mf.write(run, 2, v1, mf.generate(m), 1)  # labelled version 1, generated with version 0
    return _doctor(run)


def case_honestly_stale(ctx):
    """Asynchronous runs: samples of version 0, honestly labelled, in the dump of the trainer's version 1.
    With version 0's weights in an earlier dump the sides are compared on them; without, no replay."""
    import mismatch_faults as mf

    m = _model(ctx)
    v1 = mf.perturbed(m, os.path.join(ctx.tmpdir, "v1_honest"))
    with_old, without = os.path.join(ctx.tmpdir, "honest"), os.path.join(ctx.tmpdir, "honest_lost")
    mf.write(with_old, 1, m, mf.generate(m, seed=7), 0)
    # the trainer's weights are version 1, the samples (truly) version 0's
    mf.write(with_old, 2, v1, mf.generate(m), 0, weights_version=1)
    mf.write(without, 2, v1, mf.generate(m), 0, weights_version=1)
    return {"with_old": _doctor(with_old), "without": _doctor(without)}


def case_moe_bf16(ctx):
    """A Qwen3-MoE with a bf16 generator: routing ties break differently; the report gives the gap with
    the trainer on the generator's experts (routing replay) beside each side on its own router."""
    import mismatch_faults as mf

    m, run = os.path.join(ctx.tmpdir, "moe"), os.path.join(ctx.tmpdir, "moe_run")
    make_tiny_hf(m, "qwen3_moe", seed=3)
    mf.write(run, 1, m, mf.generate(m, "bf16"), 0, settings={"gen_precision": "bf16"})
    return _doctor(run)


CASES = ["case_clean", "case_bf16_generator", "case_perturbed_layer", "case_stale_version", "case_honestly_stale",
         "case_moe_bf16"]


@pytest.fixture(scope="module")
def doctor():
    res = run_cases([f"{MODULE}:{c}" for c in CASES], world_size=1, timeout=300, pythonpath=[HERE])
    for name, r in res.items():
        assert r.ok, f"{name}: {r.error}"
    return {name: r.data[0] for name, r in res.items()}


def _verdict(d: dict) -> str:
    lines = [ln for ln in d["text"].splitlines() if ln.startswith("verdict: ")]
    assert d["rc"] == 0 and len(lines) == 1 and d["png"], d
    return lines[0]


def test_clean_fp32_dump_is_no_mismatch(doctor):
    d = doctor["case_clean"]
    assert _verdict(d).startswith("verdict: no mismatch"), d["text"]
    assert d["report"]["gap_recorded"]["mean_abs"] <= 1e-5
    assert d["report"]["fidelity"]["max_abs"] <= 1e-5  # the replay reproduces the engine's own log-probs
    assert d["report"]["first_divergence"] is None


def test_bf16_generator_is_named_precision_and_fp32_closes_it(doctor):
    d = doctor["case_bf16_generator"]
    rep = d["report"]
    assert rep["verdict"]["cause"] == "precision" and "bf16" in _verdict(d), d["text"]
    assert rep["gap_recorded"]["mean_abs"] > 1e-4
    knob = {k["knob"]: k for k in rep["knobs"]}["generator in fp32"]
    assert knob["closes"] and knob["gap"]["mean_abs"] <= 1e-5, rep["knobs"]
    assert rep["first_divergence"]["point"] == "embedding"  # bf16 rounding of the weights themselves
    assert rep["first_divergence_fp32"] is None  # with precision taken out, the forwards agree


def test_perturbed_layer_is_named_with_its_op(doctor):
    d = doctor["case_perturbed_layer"]
    rep = d["report"]
    assert rep["verdict"]["cause"] == "weight copy", d["text"]
    assert f"layer {LAYER} mlp" in _verdict(d)
    assert rep["first_divergence"]["point"] == f"layer {LAYER} mlp", rep["divergence"]
    assert [w["tensor"] for w in rep["weight_diff"]] == [f"model.layers.{LAYER}.mlp.down_proj.weight"]


def test_stale_version_is_named(doctor):
    d = doctor["case_stale_version"]
    rep = d["report"]
    assert rep["verdict"]["cause"] == "stale weights", d["text"]
    assert "step 1's weights (version 0)" in _verdict(d) and "labelled version 1" in _verdict(d)
    assert rep["fidelity"]["mean_abs"] > 1e-4  # this step's own weights do not reproduce the samples


def test_honestly_stale_samples_are_compared_on_their_own_version(doctor):
    d = doctor["case_honestly_stale"]["with_old"]
    assert d["report"]["verdict"]["cause"] == "none", d["text"]
    assert "compared on step 1's weights (version 0, which generated the samples)" in d["text"]
    lost = doctor["case_honestly_stale"]["without"]
    assert lost["rc"] == 0 and lost["report"]["verdict"]["cause"] == "stale samples", lost["text"]
    assert "mismatch_dump_every=1" in lost["text"] and not lost["png"]


def test_moe_routing_is_a_knob(doctor):
    d = doctor["case_moe_bf16"]
    rep = d["report"]
    assert rep["verdict"]["cause"] == "precision", d["text"]
    (knob,) = [k for k in rep["knobs"] if k["cause"] == "MoE routing"]
    # replaying the generator's experts leaves the bf16 rounding, not more than each router on its own
    assert 0 < knob["gap"]["mean_abs"] <= rep["gap_replayed"]["mean_abs"] * 1.5, rep["knobs"]
    assert "routing replay" in rep["moe"] and "MoE routing: each side on its own router" in d["text"]


# ---------------------------------------------------------------- bad input: one line, exit code 2

def _one_line(capsys, argv: list[str]) -> str:
    from realflow.apps.main import main

    capsys.readouterr()  # what came before (a model's save progress) is not the doctor's
    rc = main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, out.err, out.out)
    return lines[0]


def test_run_dir_without_samples_says_how_to_save_them(tmp_path, capsys):
    line = _one_line(capsys, ["doctor", "mismatch", str(tmp_path)])
    assert "no mismatch samples saved" in line and "mismatch_dump_every=N" in line


def test_unknown_step_lists_the_saved_ones(tmp_path, capsys):
    from realflow.system.mismatch_dump import MismatchDump, dump_dir, write_dump

    os.makedirs(os.path.join(dump_dir(str(tmp_path), 3), "weights"))
    with open(os.path.join(dump_dir(str(tmp_path), 3), "weights", "config.json"), "w") as f:
        f.write("{}")  # the step is refused before its weights are read
    write_dump(str(tmp_path), MismatchDump(step=3, model="actor", weights_version=2, settings={}, samples=[]))
    line = _one_line(capsys, ["doctor", "mismatch", str(tmp_path), "--step", "4"])
    assert "no mismatch samples for step 4 (saved: 3)" in line


def test_missing_run_dir_and_bad_arguments_are_one_line(tmp_path, capsys):
    assert "no such run directory" in _one_line(capsys, ["doctor", "mismatch", str(tmp_path / "nope")])
    assert "usage: realflow doctor mismatch" in _one_line(capsys, ["doctor", "mismatch"])
    assert "--samples=0" in _one_line(capsys, ["doctor", "mismatch", str(tmp_path), "--samples", "0"])


# ---------------------------------------------------------------- --check check.mismatch=true

def test_check_mismatch_prints_the_gap(tmp_path):
    """The default RL experiment on a tiny model: ``--check check.mismatch=true`` generates and prints
    the gap (fp32 on both sides here: no gap), starting no worker."""
    import glob

    from realflow.api.experiment import experiment_registry
    from realflow.config.cli import import_modules, parse_overrides

    import_modules(["experiments"])
    parse_overrides(experiment_registry.get("sft"), [f"fileroot={tmp_path}"]).prepare()  # tokenizer, init model
    ckpt = os.path.dirname(glob.glob(os.path.join(tmp_path, "**", "realflow_init.json"), recursive=True)[0])
    args = [f"fileroot={tmp_path}", f"model.path={ckpt}", "dataset.n_train=16", "dataset.n_test=8"]
    parse_overrides(experiment_registry.get("grpo-math"), args).prepare()  # the generated data
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "realflow.apps.main", "run", "experiment=grpo-math", *args,
                          "check.mismatch=true", "check.mismatch_samples=3", "--check"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if "check.mismatch: 3 samples" in ln]
    assert line and "mean |Δ log p|" in line[0] and "k3 KL" in line[0] and "|Δ|>0.1" in line[0], res.stdout
    mean = float(line[0].split("mean |Δ log p| ")[1].split(",")[0])
    assert mean <= 1e-5, line[0]
    assert not glob.glob(os.path.join(tmp_path, "grpo-math", "*", "config.yaml"))  # nothing started
