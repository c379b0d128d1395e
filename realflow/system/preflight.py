"""Checks run in the launcher before any worker starts.

Bad input must fail at the edge with one line that names the culprit, not as a
traceback in one of several worker logs minutes later. So the launcher reads every
data row (a bad row is reported as ``file:line: reason``) and opens every checkpoint's
config and tensor headers before it starts a single process.
"""
from __future__ import annotations

import json
import os
import re

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
            config = json.load(f)
    except OSError as e:
        raise PreflightError(f"{what}: cannot read {cfg}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PreflightError(f"{what}: {cfg}:{e.lineno}: invalid JSON ({e.msg})") from None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise PreflightError(f"{what}: no *.safetensors weights in {path}")
    from safetensors import safe_open

    shapes: dict[str, tuple[list[int], str]] = {}
    for name in files:
        full = os.path.join(path, name)
        try:
            with safe_open(full, framework="pt") as f:
                for key in f.keys():
                    shapes[key] = (list(f.get_slice(key).get_shape()), full)
        except Exception as e:  # safetensors raises its own error types
            raise PreflightError(f"{what}: unreadable weights file {full}: {str(e).splitlines()[0]}") from None
    if isinstance(config, dict):
        _check_shapes(config, shapes, cfg, what)


def _check_shapes(config: dict, shapes: dict[str, tuple[list[int], str]], cfg_path: str, what: str) -> None:
    """The tensors' shapes must be the ones config.json describes (HF llama-family names): a
    config edited out of step with its weights fails here, not while every worker loads."""
    def expect(suffix: str, want: list, fields: str) -> None:
        for key, (shape, file) in shapes.items():
            if key.endswith(suffix) and shape != want:
                raise PreflightError(f"{what}: {file}: tensor {key} has shape {shape}, but {cfg_path} says "
                                     f"{fields} -> {want}")

    try:
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        layers, ffn = int(config["num_hidden_layers"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise PreflightError(f"{what}: {cfg_path}: field {e} missing or not an integer") from None
    expect("embed_tokens.weight", [vocab, hidden], f"vocab_size={vocab}, hidden_size={hidden}")
    expect("mlp.up_proj.weight", [ffn, hidden], f"intermediate_size={ffn}, hidden_size={hidden}")
    found = {int(m.group(1)) for m in (_LAYER.search(k) for k in shapes) if m}
    if found and found != set(range(layers)):
        raise PreflightError(f"{what}: the weights hold layers {min(found)}..{max(found)} ({len(found)} layers), "
                             f"but {cfg_path} says num_hidden_layers={layers}")


_LAYER = re.compile(r"\blayers\.(\d+)\.")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_tokenizer(path: str, what: str) -> None:
    """``path`` must be a directory holding a Hugging Face tokenizer."""
    if not os.path.isdir(path):
        raise PreflightError(f"{what}: tokenizer directory {path} does not exist")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise PreflightError(f"{what}: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)})")


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
        if spec.tokenizer_path and spec.tokenizer_path != spec.path:
            check_tokenizer(spec.tokenizer_path, f"model '{role}'")
    check_dataset(setup.dataset, "training data")
    if setup.eval is not None:
        check_dataset(setup.eval.dataset, "evaluation data")
