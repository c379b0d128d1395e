"""Checks run in the launcher before any worker starts.

Bad input must fail at the edge with one line that names the culprit, not as a
traceback in one of several worker logs minutes later. So the launcher reads every
data row (a bad row is reported as ``file:line: reason``), tokenizes it as the workers
will (rows over the length limits are refused, with the count and the limit to set,
unless the data set says ``filter_overlong``), refuses images for a text-only model (the first
row with images, by file and line), and opens every checkpoint's config
(its architecture must be one realflow builds) and tensor headers before it starts a
single process. ``pending`` paths (what the experiment's ``prepare()`` has yet to
create, under ``--check``) are skipped and listed.
"""
from __future__ import annotations

import json
import os
import re

from typing import Optional, Sequence

from realflow.data.dataset import DataRowError, load_rows_report
from realflow.api.experiment import DatasetSpec, ExperimentSetup
from realflow.base.hf_models import language_fields


class PreflightError(ValueError):
    """One line naming the file (and line) that is wrong."""


def check_checkpoint(path: str, what: str) -> None:
    """``path`` must be an HF checkpoint: a readable config.json and safetensors headers."""
    if not os.path.isdir(path):
        raise PreflightError(f"{what}: checkpoint directory {path} does not exist")
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as f:
            config = language_fields(json.load(f))
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
        from realflow.base.hf_models import UnsupportedArchitectureError, check_architecture

        try:
            check_architecture(config, f"{what}: {cfg}")
        except UnsupportedArchitectureError as e:
            raise PreflightError(str(e)) from None
        _check_shapes(config, shapes, cfg, what)


_VISION_PREFIXES = ("visual.", "model.visual.")  # a VL model's tower: its own shapes, not the LM's


def _check_shapes(config: dict, shapes: dict[str, tuple[list[int], str]], cfg_path: str, what: str) -> None:
    """The tensors' shapes must be the ones config.json describes (HF llama-family names): a
    config edited out of step with its weights fails here, not while every worker loads."""
    def expect(suffix: str, want: list, fields: str) -> None:
        for key, (shape, file) in shapes.items():
            if key.endswith(suffix) and shape != want and not key.startswith(_VISION_PREFIXES):
                raise PreflightError(f"{what}: {file}: tensor {key} has shape {shape}, but {cfg_path} says "
                                     f"{fields} -> {want}")

    try:
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        layers, ffn = int(config["num_hidden_layers"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise PreflightError(f"{what}: {cfg_path}: field {e} missing or not an integer") from None
    expect("embed_tokens.weight", [vocab, hidden], f"vocab_size={vocab}, hidden_size={hidden}")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts:
        _check_experts(config, shapes, cfg_path, what, experts, hidden, expect)
    else:
        expect("mlp.up_proj.weight", [ffn, hidden], f"intermediate_size={ffn}, hidden_size={hidden}")
    found = {int(m.group(1)) for m in (_LAYER.search(k) for k in shapes) if m}
    if found and found != set(range(layers)):
        raise PreflightError(f"{what}: the weights hold layers {min(found)}..{max(found)} ({len(found)} layers), "
                             f"but {cfg_path} says num_hidden_layers={layers}")


def _check_experts(config: dict, shapes: dict, cfg_path: str, what: str, experts: int, hidden: int,
                   expect) -> None:
    """A mixture-of-experts checkpoint holds ``num_experts`` experts per layer and a router of as
    many rows (HF's per-expert names, as ``save_pretrained`` writes them)."""
    held = {int(m.group(1)) for m in (_EXPERT.search(k) for k in shapes) if m}
    if held and held != set(range(experts)):
        raise PreflightError(f"{what}: the weights hold experts {min(held)}..{max(held)} ({len(held)} per layer), "
                             f"but {cfg_path} says num_experts={experts}")
    expect("mlp.gate.weight", [experts, hidden], f"num_experts={experts}, hidden_size={hidden}")
    ffn = int(config.get("moe_intermediate_size") or 0)
    expect("up_proj.weight", [ffn, hidden], f"moe_intermediate_size={ffn}, hidden_size={hidden}")


_LAYER = re.compile(r"\blayers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_tokenizer(path: str, what: str) -> None:
    """``path`` must be a directory holding a Hugging Face tokenizer."""
    if not os.path.isdir(path):
        raise PreflightError(f"{what}: tokenizer directory {path} does not exist")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise PreflightError(f"{what}: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)})")


def check_dataset(spec: DatasetSpec, what: str) -> int:
    """Parse every row of ``spec``; return the row count."""
    if not os.path.exists(spec.path):
        raise PreflightError(f"{what}: data file {spec.path} does not exist")
    from realflow.data.source import field_map_of

    fields = field_map_of(spec.args)
    try:
        rows, _bad = load_rows_report(spec.path, spec.format, skip_bad_rows=bool(spec.args.get("skip_bad_rows", False)),
                                      fields=fields)
        return len(rows)
    except DataRowError as e:
        raise PreflightError(f"{what}: {e}") from None


def check_lengths(spec: DatasetSpec, tokenizer_path: str, what: str) -> Optional[str]:
    """Tokenize ``spec`` as the workers will; rows over the length limits are an error naming the
    count, the key and the length to set (unless ``filter_overlong``). Returns the filter report."""
    from realflow.data.source import DATA_SOURCES, load_tokenized
    from realflow.base.tokenizer_loading import load_tokenizer

    if spec.format in DATA_SOURCES:  # a user data source decides its own filtering
        return None
    try:
        ds = load_tokenized(spec, load_tokenizer(tokenizer_path))
    except DataRowError as e:
        raise PreflightError(f"{what}: {e}") from None
    except ValueError as e:  # a chat template that cannot render, a conversation without one
        raise PreflightError(f"{what} {spec.path}: {e}") from None
    r = ds.report
    over = {"prompt_too_long": ("prompts", "max_prompt_len", r.longest_prompt),
            "sequence_too_long": ("rows", "max_seq_len", r.longest_seq)}
    for reason, (noun, key, longest) in over.items():
        n = r.dropped.get(reason, 0)
        if n and not spec.args.get("filter_overlong"):
            raise PreflightError(
                f"{what} {spec.path}: {n} of {r.total} {noun} are longer than dataset.{key}="
                f"{spec.args.get(key)} tokens (the longest: {longest}); set dataset.{key}={longest}, or "
                f"dataset.filter_overlong=true to drop them")
    if r.kept == 0:
        raise PreflightError(f"{what} {spec.path}: no rows left after the length limits: {r}")
    return str(r)


def check_images_model(spec: DatasetSpec, model_config: Optional[dict], what: str) -> None:
    """A data set with images needs a vision-language model: a row with images for a text-only
    model (``model_config``: its HF ``config.json``; None = unknown, not checked) is one line naming
    the file, the row and the field, before any worker starts."""
    from realflow.data.images import first_image_row, is_vision_language

    if not isinstance(model_config, dict) or is_vision_language(model_config):
        return
    try:
        hit = first_image_row(spec.path, spec.args.get("image_key") or None)
    except DataRowError as e:
        raise PreflightError(f"{what}: {e}") from None
    if hit is not None:
        n, unit, field = hit
        mtype = model_config.get("model_type", "?")
        raise PreflightError(f"{what}: " + str(DataRowError(
            spec.path, n, f"field {field!r}: row has images but model_type={mtype} is text-only: use a "
                          "vision-language model such as Qwen2.5-VL or drop the images", unit)))


def _data_model_config(setup: ExperimentSetup, pending: Sequence[str]) -> Optional[dict]:
    """The HF config of the model the data feed (the trained one, else the first): its
    ``config.json``, or the planned config of a checkpoint the run creates; None if unknown."""
    specs = sorted(setup.models.items())
    trained = [s for _, s in specs if s.optimizer is not None] or [s for _, s in specs]
    if not trained:
        return None
    spec = trained[0]
    if not _pending(spec.path, pending):
        try:
            with open(os.path.join(spec.path, "config.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    return dict(spec.expected_config) if spec.expected_config else None


def _data_tokenizer(setup: ExperimentSetup) -> Optional[str]:
    """The tokenizer the data sets are tokenized with: the trained model's (else the first's)."""
    specs = sorted(setup.models.items())
    trained = [s for _, s in specs if s.optimizer is not None] or [s for _, s in specs]
    return (trained[0].tokenizer_path or trained[0].path) if trained else None


def _pending(path: str, pending: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in map(os.path.abspath, pending))


_ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "tie_word_embeddings")


def check_rollout_model(setup: ExperimentSetup, policy_role: str = "actor") -> None:
    """The generation servers must run the trained policy's architecture: every weight update
    (a delta above all, which patches bytes in place) would fail on each server, after every
    worker started. Compared from the two ``config.json`` files, before anything starts."""
    r, policy = setup.rollout, setup.models.get(policy_role)
    if r is None or policy is None or not r.model_path or os.path.abspath(r.model_path) == os.path.abspath(policy.path):
        return
    configs = []
    for path in (r.model_path, policy.path):
        try:
            with open(os.path.join(path, "config.json")) as f:
                configs.append(language_fields(json.load(f)))
        except (OSError, ValueError):
            return  # a missing or unreadable checkpoint is check_checkpoint's to name
    diff = [f"{k}={configs[0].get(k)!r} vs {configs[1].get(k)!r}" for k in _ARCH_KEYS
            if configs[0].get(k) != configs[1].get(k)]
    if diff:
        raise PreflightError(f"rollout.model_path {r.model_path} is not the architecture of model '{policy_role}' "
                             f"({policy.path}): {', '.join(diff)}; weight updates to the servers cannot apply -- "
                             f"serve the policy's model")


def preflight(setup: ExperimentSetup, pending: Sequence[str] = ()) -> list[str]:
    """Every check before a worker starts; returns notes (what was skipped, the data filters)."""
    notes = []
    for role, spec in sorted(setup.models.items()):
        if getattr(spec, "backend", "") == "none":  # a rule reward: its path is only a tokenizer
            continue
        if _pending(spec.path, pending):
            notes.append(f"model '{role}': {spec.path} not checked (the run creates it first)")
            continue
        check_checkpoint(spec.path, f"model '{role}'")
        if spec.tokenizer_path and spec.tokenizer_path != spec.path and not _pending(spec.tokenizer_path, pending):
            check_tokenizer(spec.tokenizer_path, f"model '{role}'")
    check_rollout_model(setup)
    tok = _data_tokenizer(setup)
    data = [(setup.dataset, "training data")]
    if setup.eval is not None:
        data.append((setup.eval.dataset, "evaluation data"))
    for spec, what in data:
        if _pending(spec.path, pending):
            notes.append(f"{what}: {spec.path} not checked (the run generates it first)")
            continue
        check_dataset(spec, what)
        check_images_model(spec, _data_model_config(setup, pending), what)
        if tok is None or _pending(tok, pending):
            notes.append(f"{what}: lengths not checked (the tokenizer is made by the run)")
            continue
        report = check_lengths(spec, tok, what)
        if report:
            notes.append(f"{what}: {report}")
    return notes
