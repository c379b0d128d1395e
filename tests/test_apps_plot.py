"""``realflow plot RUN_DIR``: PNG panels from a run's stats.jsonl, with the key names real runs log."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from realflow.apps import plot as plot_mod
from realflow.apps.plot_panels import run_panels

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk of a PNG file, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def _write_run(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    with open(run_dir / "stats.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"time": 1.7e9 + r["step"], **r}) + "\n")
    return run_dir


def _ppo_rows(n: int = 50, async_run: bool = True) -> list[dict]:
    """Rows named as a sync/async GRPO run names them (see realflow/system/master.py, async_master.py)."""
    rows = [{"step": 0, "eval/accuracy": 0.2, "eval/sampled_accuracy": 0.1, "eval/n_eval": 64}]
    for s in range(1, n + 1):
        row = {"step": s, "actor_train/reward": s / n, "actor_train/loss": 1.0 - s / (2 * n),
               "reward_inf/hooks_pre_s": 0.01, "time/fetch": 0.01, "time/actor_gen": 0.5,
               "time/reward_inf": 0.02, "time/actor_train": 0.4, "time/step": 0.95, "epoch": 0}
        if async_run:
            row.update({"async/gen_tokens_per_s": 3000.0 + s, "async/trained_samples_per_s": 15.0})
        rows.append(row)
    rows.append({"step": n, "eval/accuracy": 0.6, "eval/sampled_accuracy": 0.5, "eval/n_eval": 64})
    rows.append({"step": n, "time/recover_point": 0.3})
    return rows


def test_plot_command_writes_every_panel_as_png(tmp_path):
    run_dir = _write_run(tmp_path / "async-grpo-math" / "trial0", _ppo_rows())
    res = subprocess.run([sys.executable, "-m", "realflow.apps.main", "plot", str(run_dir)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    names = {"reward.png", "heldout.png", "loss.png", "throughput.png", "mfc_time.png"}
    assert {p.name for p in (run_dir / "plots").iterdir()} == names
    assert sorted(Path(line).name for line in res.stdout.split()) == sorted(names)
    for name in names:
        w, h = _png_size(run_dir / "plots" / name)
        assert w >= 400 and h >= 200 and (run_dir / "plots" / name).stat().st_size > 5000, (name, w, h)


def test_absent_keys_skip_their_panels_and_out_dir_is_honoured(tmp_path):
    """An SFT run logs no reward and no rate: no reward panel; throughput derived from n_tokens."""
    rows = [{"step": 0, "eval/accuracy": 0.0, "eval/n_eval": 16}]
    rows += [{"step": s, "sft_train/loss": 3.0 / s, "sft_train/n_tokens": 1000.0, "time/fetch": 0.01,
              "time/sft_train": 0.2, "time/step": 0.25, "epoch": 0} for s in range(1, 6)]
    run_dir = _write_run(tmp_path / "sft" / "trial0", rows)
    with open(run_dir / "stats.jsonl", "a") as f:
        f.write('{"step": 6, "sft_train/lo')  # a line cut short by a killed run is skipped
    (run_dir / "samples.jsonl").write_text("".join(json.dumps({"step": s, "ids": ["a", "b"]}) + "\n"
                                                   for s in range(1, 6)))
    out = tmp_path / "elsewhere"
    (out).mkdir()
    (out / "reward.png").write_bytes(b"stale")  # a panel the run does not have is removed
    paths = plot_mod.plot_run(run_dir, out)
    assert sorted(p.name for p in paths) == ["heldout.png", "loss.png", "mfc_time.png", "throughput.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)
    assert not (run_dir / "plots").exists()
    for p in paths:
        _png_size(p)

    panels = {p.name: p for p in run_panels(plot_mod.read_jsonl(run_dir / "stats.jsonl", skip_bad=True),
                                            {s: 2.0 for s in range(1, 6)})}
    tput = {a.ylabel: a.series[0] for a in panels["throughput"].axes}
    assert tput["tokens/s"].values == pytest.approx([4000.0] * 5)  # n_tokens / time/step
    assert tput["samples/s"].values == pytest.approx([8.0] * 5)  # samples.jsonl ids / time/step
    assert [s.label for s in panels["heldout"].axes[0].series] == ["eval/accuracy"]  # counts are not scores


def test_panels_take_the_keys_real_runs_log():
    panels = {p.name: p for p in run_panels(_ppo_rows(n=4, async_run=False))}
    assert [s.label for s in panels["reward"].axes[0].series] == ["actor_train/reward"]  # not reward_inf's times
    assert [s.label for s in panels["heldout"].axes[0].series] == ["eval/accuracy", "eval/sampled_accuracy"]
    assert panels["heldout"].axes[0].series[0].steps == [0, 4]
    mfc = [s.label for s in panels["mfc_time"].axes[0].series]
    assert mfc == ["fetch", "actor_gen", "reward_inf", "actor_train", "step", "recover_point"]
    (steps_axis,) = panels["throughput"].axes  # no rate and no samples.jsonl: steps/s from time/step
    assert steps_axis.ylabel == "steps/s" and steps_axis.series[0].values == pytest.approx([1 / 0.95] * 4)


def test_run_dir_without_stats_is_a_one_line_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "realflow.apps.plot", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no stats.jsonl in {tmp_path}"), res.stderr


def test_plotting_at_the_end_of_a_run_only_warns(tmp_path, monkeypatch, capsys):
    run_dir = _write_run(tmp_path / "run", _ppo_rows(n=3))
    assert plot_mod.plot_after_run(tmp_path / "empty") == []  # nothing logged: nothing said
    assert capsys.readouterr().err == ""

    def broken(*_a, **_k):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plot_mod, "_draw_panel", broken)
    assert plot_mod.plot_after_run(run_dir) == []
    assert "warning: could not draw the run's plots: RuntimeError: no fonts" in capsys.readouterr().err


def test_mismatch_panel_draws_the_gap_and_its_histogram():
    rows = []
    for step in range(1, 4):
        r = {"step": step, "actor_train/mismatch/abs_mean": 1e-3 * step, "actor_train/mismatch/abs_max": 0.1,
             "actor_train/mismatch/v0_abs_mean": 2e-7, "actor_train/mismatch/frac_over_0.1": 0.01,
             "actor_train/mismatch/frac_over_1": 0.0}
        r.update({f"actor_train/mismatch/hist_{i}": (0.5 if i in (0, 3) else 0.0) for i in range(9)})
        rows.append(r)
    (panel,) = [p for p in run_panels(rows) if p.name == "mismatch"]
    gap, frac, hist = panel.axes
    assert gap.log and {s.label for s in gap.series} == {"actor_train/mismatch/abs_mean", "actor_train/mismatch/abs_max",
                                                         "actor_train/mismatch/v0_abs_mean"}
    assert [s.label for s in frac.series] == ["actor_train/mismatch/frac_over_0.1", "actor_train/mismatch/frac_over_1"]
    # one curve per non-empty |delta| decade, in bin order
    assert [s.label for s in hist.series] == ["|delta| in [0, 1e-06)", "|delta| in [0.0001, 0.001)"]
