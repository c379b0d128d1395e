"""The command lines as a user runs them, in real subprocesses: every experiment's --help,
--config files with --print-config, the `realflow` command's help and its unknown words.

Nothing here starts a run: --print-config and --dry-run stop before any worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from realflow.config.cli import config_to_dict, parse_overrides
from realflow.config.files import write_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = ("--check", "--dry-run", "--console", "--config FILE", "--print-config", "--import MODULE")


def cli(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(path)


@pytest.mark.parametrize("app", ["main_sft", "main_sync_ppo", "main_async_ppo"])
def test_experiment_help_lists_options_and_model_and_data_first(app):
    proc = cli(f"realflow.apps.{app}", "--help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"usage: python -m realflow.apps.{app} ")
    block = lines[lines.index("options:") + 1:]
    for option in OPTIONS:
        assert option.split()[0] in lines[0], option
        assert any(line.startswith(f"  {option} ") for line in block), option
    keys = [line.split(":")[0].strip() for line in lines if line.startswith("  ") and not line.startswith("   ")
            and ":" in line and not line.lstrip().startswith("-")]
    first_other = keys.index("experiment_name")
    assert keys[0] == "model" and "dataset" in keys[:first_other]
    assert all(k.split(".")[0] in ("model", "dataset") for k in keys[:first_other])
    assert "trial_name" in keys[first_other:]


def test_print_config_resolves_files_and_overrides_and_writes_nothing(tmp_path):
    root = tmp_path / "runs"
    base = write(tmp_path / "base.yaml", """
        dataset:
          n_train: 32
          n_test: 8
        optimizer.lr: 0.001
        seed: 7
    """)
    small = write(tmp_path / "small.json", '{"seed": 9, "model": {"arch": {"hidden_size": 64}}}')
    proc = cli("realflow.apps.main_sft", "--config", base, "--config", small, "optimizer.lr=0.002",
               f"fileroot={root}", "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert next(iter(printed)) == "experiment" and printed["experiment"] == "sft"
    assert printed["seed"] == 9 and printed["dataset"]["n_train"] == 32 and printed["dataset"]["n_test"] == 8
    assert printed["optimizer"]["lr"] == 0.002 and printed["model"]["arch"]["hidden_size"] == 64
    assert not root.exists(), "--print-config wrote something"
    # what it prints (and a run saves as <run dir>/config.yaml) loads back to the same config
    again = cli("realflow.apps.main", "--config", write(tmp_path / "printed.yaml", proc.stdout), "--print-config")
    assert again.returncode == 0, again.stderr
    assert again.stdout == proc.stdout


def test_experiment_chosen_by_a_file_and_the_command_line_wins(tmp_path):
    conf = write(tmp_path / "conf.yaml", "experiment: grpo-math\nseed: 3\n")
    proc = cli("realflow.apps.main", "run", "--config", conf, "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["experiment"] == "grpo-math" and printed["seed"] == 3 and "ppo" in printed
    proc = cli("realflow.apps.main", "--config", conf, "experiment=sft", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["experiment"] == "sft"
    typo = write(tmp_path / "typo.yaml", "seed: 1\nexperiment: sfft\n")
    line = one_line_error(cli("realflow.apps.main", "--config", typo, "--print-config"))
    assert line.startswith(f"error: {typo}:2: unknown experiment 'sfft'; did you mean 'sft'")


def test_file_errors_on_the_command_line_name_file_and_line(tmp_path):
    conf = write(tmp_path / "conf.yaml", """
        seed: 1
        dataset:
          trian_path: /x
    """)
    line = one_line_error(cli("realflow.apps.main_sft", "--config", conf, "--print-config"))
    assert line.startswith(f"error: {conf}:3: unknown config key 'dataset.trian_path'; did you mean ")
    assert "dataset.train_path" in line
    line = one_line_error(cli("realflow.apps.main_sft", "--config", str(tmp_path / "nope.yaml"), "--dryrun"))
    assert line == "error: unknown option '--dryrun'; did you mean --dry-run?"


def test_dry_run_saves_no_config(tmp_path):
    proc = cli("realflow.apps.main_sft", f"fileroot={tmp_path}", "trace=false", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "sft" / "trial0"
    assert (run_dir / "plan.png").exists() and not (run_dir / "config.yaml").exists()


@pytest.mark.parametrize("argv", [["--help"], [], ["help"]], ids=repr)
def test_realflow_help_lists_commands_and_experiments(argv):
    proc = cli("realflow.apps.main", *argv)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for command in ("run", "plan", "plot", "calibrate", "doctor"):
        assert f"\n  {command} " in out, command
        assert f"realflow {command} " in out  # how to get its help
    for experiment in ("sft", "grpo-math", "ppo-math", "async-grpo-math"):
        assert f"\n  {experiment} " in out, experiment


def test_realflow_help_of_one_command():
    proc = cli("realflow.apps.main", "help", "plot")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: realflow plot"), proc.stderr


@pytest.mark.parametrize("word, hint", [("plott", "did you mean plot?"), ("sft", "realflow run experiment=sft")])
def test_unknown_first_word_is_one_line_naming_the_closest(word, hint):
    line = one_line_error(cli("realflow.apps.main", word, "seed=1"))
    assert line.startswith(f"error: unknown command {word!r}; ") and hint in line


def test_workers_read_the_saved_config(tmp_path):
    """A run's processes parse `--config=<run dir>/config.yaml` (what the launcher passes them)."""
    pytest.importorskip("torch")
    import experiments  # noqa: F401
    from realflow.config.files import dump_config
    from realflow.api.experiment import experiment_registry
    from realflow.system.roles import build_setup

    cfg = parse_overrides(experiment_registry.get("async-grpo-math"), [f"fileroot={tmp_path}", "algorithm=dapo"])
    path = write_config(str(tmp_path / "config.yaml"), dump_config(cfg, "async-grpo-math"))
    back, setup = build_setup("async-grpo-math", [f"--config={path}"])
    assert config_to_dict(back) == config_to_dict(cfg)
    assert setup.run_dir == cfg.setup().run_dir


def test_loading_the_experiments_imports_no_megatron():
    """The command line loads the built-in plugins for every error it prints; megatron costs seconds
    to import (and warns on stderr), so it must wait until a model is built."""
    code = ("import sys, experiments; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('megatron', 'transformer_engine')); print(bad[:3]); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
