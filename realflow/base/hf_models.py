"""Where a user's model lives, and whether realflow can build it.

A model is named the way Hugging Face users name one: a local checkpoint directory or a
hub id ``org/name``.  Training jobs run on machines that often have no network (and must
never download weights behind the user's back), so a hub id is resolved OFFLINE through
the local Hugging Face cache, with huggingface_hub's own lookup (``snapshot_download(...,
local_files_only=True)``), so ``refs/<branch>`` and commit hashes mean exactly what they
mean to transformers.  Every failure is one line that names the culprit and what to do.

The architecture gate (:func:`check_architecture`) runs before any process is started, so
an unsupported model fails at submit time instead of inside a worker; the deeper per-field
checks (activation, RoPE type, biases) stay in :func:`parallel.model_config.hf_arch`.
This module imports no torch, so the launcher stays light.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ModelPathError",
    "UnsupportedArchitectureError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "hub_cache_dir",
    "is_hub_id",
    "resolve_model_path",
    "check_architecture",
    "model_context_length",
    "describe_supported",
    "language_fields",
]

# HF ``architectures`` entry -> its ``model_type``.  Mirrors what parallel/ builds:
# parallel.model_config.SUPPORTED_MODEL_TYPES (the causal LMs, mapped by
# parallel.hf_io.param_table) and parallel.critic.CRITIC_CLASSES (critics and reward
# models: the trunk plus a 1-label ``score`` head, saved as *ForTokenClassification).
# tests/test_base_hf_models.py fails if the two drift apart.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2ForTokenClassification": "qwen2",
    "Qwen3ForTokenClassification": "qwen3",
    "LlamaForTokenClassification": "llama",
}
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset(SUPPORTED_ARCHITECTURES.values())

# (family as users know it, causal-LM architecture), in the order --help shows them.
_FAMILY_NAMES: tuple[tuple[str, str], ...] = (
    ("Qwen2/Qwen2.5", "Qwen2ForCausalLM"),
    ("Qwen3", "Qwen3ForCausalLM"),
    ("Llama 3.x", "LlamaForCausalLM"),
    ("Qwen3-MoE", "Qwen3MoeForCausalLM"),
    ("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration"),
    ("Qwen2-VL", "Qwen2VLForConditionalGeneration"),
)
_PATH_PREFIXES = ("/", ".", "~")


class ModelPathError(ValueError):
    """A model reference that names neither a local directory nor a cached hub model."""


class UnsupportedArchitectureError(ValueError):
    """A checkpoint whose architecture realflow cannot build."""


def hub_cache_dir() -> str:
    """The hub cache huggingface_hub would use, read from the environment NOW.

    ``huggingface_hub.constants.HF_HUB_CACHE`` is frozen when huggingface_hub is first
    imported; a launcher that sets ``HF_HUB_CACHE``/``HF_HOME`` later (or a test) would be
    ignored.  Same precedence as huggingface_hub: HF_HUB_CACHE, legacy
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub.
    """
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"), "huggingface")
    home = os.path.expandvars(os.path.expanduser(home))
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(hub))


def is_hub_id(ref: str) -> bool:
    """``org/name`` with exactly one slash, not path-shaped, and legal on the Hub.

    Single-segment ids (``gpt2``) are not accepted: they are indistinguishable from a
    relative directory name, and the Hub has moved those models under an org.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not ref or ref.startswith(_PATH_PREFIXES) or ref.count("/") != 1:
        return False
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def resolve_model_path(ref: str, revision: str = "main", what: str = "model.path") -> str:
    """The absolute directory holding the model ``ref`` names, without touching the network.

    Rule: an existing directory always wins (a relative path is taken from the current
    directory); otherwise ``ref`` must be a hub id ``org/name`` (see :func:`is_hub_id`),
    looked up in :func:`hub_cache_dir` at ``revision`` (a branch or tag in ``refs/``, or a
    40-hex commit).  ``revision`` applies to hub ids only.  A local directory need not hold
    a ``config.json`` yet (an output directory filled by a later step); a hub snapshot must.
    ``what`` is the config field being resolved, so errors name it.
    """
    if not ref or not str(ref).strip():
        raise ModelPathError(f"{what}: empty; give a model directory or a hub id of the form org/name")
    ref = str(ref)
    local = os.path.abspath(os.path.expanduser(ref))
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise ModelPathError(f"{what}: {local} is a file; give the checkpoint's directory")
    if not is_hub_id(ref):
        raise ModelPathError(f"{what}: no directory {local} (and not a hub id of the form org/name)")
    return _resolve_hub_snapshot(ref, revision or "main", what, local)


def _resolve_hub_snapshot(repo_id: str, revision: str, what: str, local: str) -> str:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (huggingface_hub's lookup)."""
    from huggingface_hub import errors, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    # huggingface_hub >= 2 refuses a snapshot its recorded file list says is partial
    incomplete: Any = getattr(errors, "IncompleteSnapshotError", ())

    cache = hub_cache_dir()
    rev_flag = "" if revision == "main" else f" --revision {revision}"
    fetch = f"`hf download {repo_id}{rev_flag}` (older huggingface_hub: `huggingface-cli download`)"
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except incomplete as e:
        raise ModelPathError(
            f"{what}: the cached snapshot {e.snapshot_path} of hub model {repo_id} (revision {revision}) is "
            f"incomplete (an interrupted download?); complete it with {fetch} on a machine with network"
        ) from None
    except LocalEntryNotFoundError:
        raise ModelPathError(
            f"{what}: no directory {local}, and hub model {repo_id} (revision {revision}) is not in the "
            f"Hugging Face cache {cache}; fetch it with {fetch} on a machine with network, or set HF_HUB_CACHE "
            f"(or HF_HOME) to the cache that holds it"
        ) from None
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise ModelPathError(
            f"{what}: hub snapshot {snapshot} of {repo_id} (revision {revision}) has no config.json; "
            f"not a transformers model, or only partly downloaded: fetch it in full with {fetch}"
        )
    return os.path.abspath(snapshot)


def check_architecture(config: Mapping[str, Any], where: str) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless realflow can build this config.

    ``config`` is a parsed ``config.json``; ``where`` names it in the message (its path).
    Every ``architectures`` entry must be supported and agree with ``model_type``, which
    is what realflow actually builds from; without ``architectures``, ``model_type`` decides.
    """
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    model_type = config.get("model_type")
    for arch in archs:
        if arch not in SUPPORTED_ARCHITECTURES:
            typ = f" (model_type {model_type!r})" if model_type else ""
            raise UnsupportedArchitectureError(
                f"{where}: architecture {arch} is not supported{typ}; realflow builds {supported}")
        if model_type is not None and SUPPORTED_ARCHITECTURES[arch] != model_type:
            raise UnsupportedArchitectureError(
                f"{where}: architecture {arch} needs model_type {SUPPORTED_ARCHITECTURES[arch]!r} but config.json "
                f"says {model_type!r}; fix config.json")
    if model_type is None and not archs:
        raise UnsupportedArchitectureError(
            f"{where}: config.json has neither architectures nor model_type; realflow builds {supported}")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{where}: model_type {model_type!r} is not supported; realflow builds {supported}")


def language_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json dict with its language model's fields at the top level.

    Vision-language checkpoints written by transformers 5 nest the language model's fields
    (hidden_size, num_hidden_layers, vocab_size, ...) in ``text_config``; every reader of plain
    config dicts (preflight, layouts, the planner) wants them where text-only models keep them.
    Top-level fields win; ``text_config`` and ``vision_config`` stay as they are.
    """
    out = dict(config)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        for k, v in text.items():
            out.setdefault(k, v)
    return out


def model_context_length(config: Mapping[str, Any]) -> int | None:
    """The longest sequence the config claims to handle, for defaulting length limits.

    ``max_position_embeddings``, stretched by RoPE scaling when the config describes it:
    types that extend a shorter original window (linear, dynamic, yarn) report
    ``factor * original_max_position_embeddings``; llama3-style configs already store the
    extended length in ``max_position_embeddings``, so the larger of the two wins.  None
    when the config has no usable length.
    """
    config = language_fields(config)
    base = config.get("max_position_embeddings")
    if isinstance(base, bool) or not isinstance(base, int) or base <= 0:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        return base
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor")
    if rope_type == "default" or not isinstance(factor, (int, float)) or factor <= 1:
        return base
    original = rope.get("original_max_position_embeddings") or base
    return max(base, int(original * factor))


def describe_supported() -> str:
    """One line for ``--help`` and the README: the families users can bring."""
    families = ", ".join(f"{name} ({arch})" for name, arch in _FAMILY_NAMES)
    return f"{families}; critics/reward models as the matching *ForTokenClassification"


def resolve_checked_model(ref: str, revision: str = "main", what: str = "model.path") -> str:
    """:func:`resolve_model_path`, then :func:`check_architecture` on its ``config.json`` when it has
    one: a model realflow cannot build is refused where the config is read, before any layout or
    worker is planned for it."""
    import json

    path = resolve_model_path(ref, revision, what)
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        try:
            with open(cfg) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return path  # unreadable: the preflight's checkpoint check names it
        if isinstance(config, dict):
            check_architecture(config, f"{what}: {cfg}")
    return path
