"""Checks run in the launcher before any worker starts.

Bad input must fail at the edge with one line that names the culprit, not as a
traceback in one of several worker logs minutes later. So the launcher reads every
data row (a bad row is reported as ``file:line: reason``) and opens every checkpoint's
config and tensor headers before it starts a single process.
"""
from __future__ import annotations

import json
import os

from realflow.api.dataset import DataRowError, load_rows_report
from realflow.api.experiment import DatasetSpec, ExperimentSetup


class PreflightError(ValueError):
    """One line naming the file (and line) that is wrong."""


def check_checkpoint(path: str, what: str) -> None:
    """``path`` must be an HF checkpoint: a readable config.json and safetensors headers."""
    if not os.path.isdir(path):
        raise PreflightError(f"{what}: checkpoint directory {path} does not exist")
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as f:
            json.load(f)
    except OSError as e:
        raise PreflightError(f"{what}: cannot read {cfg}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PreflightError(f"{what}: {cfg}:{e.lineno}: invalid JSON ({e.msg})") from None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise PreflightError(f"{what}: no *.safetensors weights in {path}")
    from safetensors import safe_open

    for name in files:
        full = os.path.join(path, name)
        try:
            with safe_open(full, framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own error types
            raise PreflightError(f"{what}: unreadable weights file {full}: {str(e).splitlines()[0]}") from None


def check_dataset(spec: DatasetSpec, what: str) -> int:
    """Parse every row of ``spec``; return the row count."""
    if not os.path.isfile(spec.path):
        raise PreflightError(f"{what}: data file {spec.path} does not exist")
    try:
        rows, _bad = load_rows_report(spec.path, spec.format, skip_bad_rows=bool(spec.args.get("skip_bad_rows", False)))
        return len(rows)
    except DataRowError as e:
        raise PreflightError(f"{what}: {e}") from None


def preflight(setup: ExperimentSetup) -> None:
    for role, spec in sorted(setup.models.items()):
        check_checkpoint(spec.path, f"model '{role}'")
    check_dataset(setup.dataset, "training data")
    if setup.eval is not None:
        check_dataset(setup.eval.dataset, "evaluation data")
