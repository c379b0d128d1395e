"""Data sets as streams of :class:`SequenceBatch` samples, by the spec's format.

The runtime only sees sample ids, keys and tensors. This module maps a
:class:`~realflow.api.experiment.DatasetSpec` (a registered row format plus a path)
to the keys its samples carry and to the tokenized samples of one worker's shard:

* SFT formats (``sft``): ``packed_input_ids`` (prompt + response + eos) and
  ``prompt_mask`` (1 on prompt tokens), metadata ``answer``.
* prompt formats (``prompt_answer`` -- auto-detects plain, GSM8K and boxed rows --,
  ``gsm8k``, ``boxed``): ``packed_prompts`` (prompt tokens), metadata ``answer``.

A user format registered in ``DATASET_FORMATS`` is classified by the return
annotation of its parser (``-> PromptAnswerRow`` or ``-> SFTRow``).

``spec.args`` (all optional): ``max_prompt_len`` (default 1024), ``max_seq_len``
(SFT), ``seed``, ``chat_template`` (bool), ``system_prompt``, ``prompt_template``
(see :class:`~realflow.api.dataset.PromptFormat`) and ``skip_bad_rows`` (bool:
log and count bad rows instead of failing). Unknown args are errors.
"""
from __future__ import annotations

import logging
import typing

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.dataset import (DATASET_FORMATS, PromptAnswerDataset, PromptAnswerRow, PromptFormat,
                                  SFTDataset, SFTRow)
from realflow.api.experiment import DatasetSpec
from realflow.api.registry import did_you_mean

__all__ = ["dataset_keys", "load_dataset_shard", "DATASET_ARGS"]

logger = logging.getLogger(__name__)

_SFT_KEYS = ("packed_input_ids", "prompt_mask")
_PROMPT_KEYS = ("packed_prompts",)
_METADATA_KEYS = ("answer",)
_BUILTIN_KIND = {"sft": "sft", "prompt_answer": "prompt", "gsm8k": "prompt", "boxed": "prompt"}
DATASET_ARGS = ("max_prompt_len", "max_seq_len", "seed", "chat_template", "system_prompt",
                "prompt_template", "skip_bad_rows")


def _kind(fmt: str) -> str | None:
    """``"sft"``, ``"prompt"`` or None (a format whose row type is unknown)."""
    if fmt in _BUILTIN_KIND:
        return _BUILTIN_KIND[fmt]
    if fmt not in DATASET_FORMATS:
        return None
    try:
        ret = typing.get_type_hints(DATASET_FORMATS.get(fmt)).get("return")
    except Exception:  # noqa: BLE001 -- unresolvable annotations: treat as unknown
        return None
    return {PromptAnswerRow: "prompt", SFTRow: "sft"}.get(ret)


def dataset_keys(spec: DatasetSpec) -> tuple[str, ...]:
    """The keys every sample of ``spec`` carries (the graph's data set keys): tensor keys,
    plus the metadata key ``answer`` (the reference answer a rule-based reward reads)."""
    kind = _kind(spec.format)
    if kind is None:
        known = sorted(set(_BUILTIN_KIND) | set(DATASET_FORMATS.names()))
        raise ValueError(
            f"data set format '{spec.format}' has no sample keys defined"
            + did_you_mean(spec.format, known)
            + f" (known: {known}; a user format's parser must be annotated "
            "'-> PromptAnswerRow' or '-> SFTRow')"
        )
    return (_SFT_KEYS if kind == "sft" else _PROMPT_KEYS) + _METADATA_KEYS


def _parse_args(spec: DatasetSpec) -> dict:
    args = dict(spec.args)
    unknown = sorted(set(args) - set(DATASET_ARGS))
    if unknown:
        raise ValueError(
            f"data set {spec.path!r}: unknown args {unknown}" + did_you_mean(unknown[0], DATASET_ARGS)
            + f" (known: {list(DATASET_ARGS)})"
        )
    return args


def load_dataset_shard(spec: DatasetSpec, tokenizer, rank: int, world: int) -> list[SequenceBatch]:
    """Tokenize ``spec`` and return shard ``rank`` of ``world`` as one-sample batches.

    The filter report (kept / too long / bad rows) is logged once, by rank 0.
    """
    dataset_keys(spec)  # an unknown format fails here, with the known ones
    kind = _kind(spec.format)
    args = _parse_args(spec)
    max_prompt_len = int(args.pop("max_prompt_len", 1024))
    seed = int(args.pop("seed", 0))
    skip_bad = bool(args.pop("skip_bad_rows", False))
    pf = PromptFormat(chat_template=bool(args.pop("chat_template", False)),
                      system_prompt=args.pop("system_prompt", None),
                      prompt_template=args.pop("prompt_template", None))
    if kind == "sft":
        ds = SFTDataset.load(spec.path, tokenizer, max_prompt_len, args.pop("max_seq_len", None), fmt=spec.format,
                             seed=seed, prompt_format=pf, skip_bad_rows=skip_bad)
    else:
        ds = PromptAnswerDataset.load(spec.path, tokenizer, max_prompt_len, fmt=spec.format, seed=seed,
                                      prompt_format=pf, skip_bad_rows=skip_bad)
    if rank == 0:
        logger.info("data set %s (%s): %s", spec.path, spec.format, ds.report)
    if len(ds) == 0:
        raise ValueError(f"data set {spec.path!r}: no rows left after filtering: {ds.report}")
    shard = ds.shard(rank, world)
    if kind == "sft":
        return [
            SequenceBatch(
                ids=[s.id],
                seqlens={"packed_input_ids": [[len(s.input_ids)]], "prompt_mask": [[len(s.input_ids)]]},
                data={
                    "packed_input_ids": torch.tensor(s.input_ids, dtype=torch.long),
                    "prompt_mask": torch.tensor(s.prompt_mask, dtype=torch.bool),
                },
                metadata={"answer": [s.answer]},
            )
            for s in shard
        ]
    return [
        SequenceBatch(
            ids=[s.id],
            seqlens={"packed_prompts": [[len(s.prompt_ids)]]},
            data={"packed_prompts": torch.tensor(s.prompt_ids, dtype=torch.long)},
            metadata={"answer": [s.answer]},
        )
        for s in shard
    ]
