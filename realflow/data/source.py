"""Data sets as streams of :class:`SequenceBatch` samples, by the spec's format.

The runtime only sees sample ids, keys and tensors. This module maps a
:class:`~realflow.api.experiment.DatasetSpec` (a registered row format plus a path)
to the keys its samples carry and to the tokenized samples of one worker's shard:

* SFT formats (``sft``): ``packed_input_ids`` (prompt + response + eos) and
  ``prompt_mask`` (1 on prompt tokens), metadata ``answer``.
* prompt formats (``prompt_answer`` -- auto-detects plain, GSM8K and boxed rows --,
  ``gsm8k``, ``boxed``): ``packed_prompts`` (prompt tokens), metadata ``answer``.

Images (:mod:`realflow.data.images`): a sample of a row with images also carries
``pixel_values`` (``[patches, 1176]`` float32, one sequence: all the row's patches) and
``image_grid_thw`` (``[images, 3]`` int64, one sequence), the keys of
:mod:`realflow.api.images`. Either every sample of a data set carries them (a row without
images: zero-length sequences) or none does: they are there when the data set has a row with
images, or when ``image_inputs`` says the model takes images (a VL experiment sets it, so that
its graph's image keys exist for a text-only data set too); a text-only data set on a
text-only model changes nothing.

A user format registered in ``DATASET_FORMATS`` is classified by the return
annotation of its parser (``-> PromptAnswerRow`` or ``-> SFTRow``).

A user format whose samples are neither (preference pairs, several sequences per row,
extra tensors) registers a *data source* under the same name: ``@register_data_source(
name, keys=...)`` on ``to_sample(row, tokenizer, args) -> SequenceBatch | None`` (one
sample per parsed row; None drops the row, counted as ``filtered``). The parser in
``DATASET_FORMATS`` still reads and checks every row (``--check``, file:line errors);
the data source decides the keys the graph sees and how a row becomes tensors.

``spec.args`` (all optional): ``max_prompt_len`` (default 1024), ``max_seq_len``
(SFT), ``seed``, ``chat_template`` (auto | none | tokenizer, or a bool),
``system_prompt``, ``prompt_template``, ``add_generation_prompt`` (see
:class:`~realflow.data.chat_render.PromptFormat`), ``prompt_key``/``answer_key``/
``response_key``/``image_key`` (see :class:`~realflow.data.rows.FieldMap`), ``skip_bad_rows``
(bool: log and count bad rows instead of failing), ``min_pixels``/``max_pixels`` (the image
processor's budget; absent: the model's ``preprocessor_config.json``, else
:class:`~realflow.api.images.ImageProcessing`'s) and ``image_inputs`` (bool, see above).
Unknown args are errors.
"""
from __future__ import annotations

import logging
import typing
from typing import Any

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.data_formats import DATA_SOURCES, DataSource, register_data_source
from realflow.api.experiment import DatasetSpec
from realflow.api.images import IMAGE_KEYS, IMAGE_GRID, IMAGE_PIXELS, ImageInputs, ImageProcessing
from realflow.api.registry import did_you_mean
from realflow.data.dataset import (DATASET_FORMATS, FieldMap, PromptAnswerDataset, PromptAnswerRow, PromptFormat,
                                  SFTDataset, SFTRow, load_rows_report)

__all__ = ["dataset_keys", "load_dataset_shard", "DATASET_ARGS", "DataSource", "DATA_SOURCES",
           "register_data_source", "prompt_format_of", "field_map_of", "load_tokenized", "image_processing_of",
           "image_fields", "IMAGE_KEYS"]

logger = logging.getLogger(__name__)

_SFT_KEYS = ("packed_input_ids", "prompt_mask")
_PROMPT_KEYS = ("packed_prompts",)
_METADATA_KEYS = ("answer",)
_BUILTIN_KIND = {"sft": "sft", "prompt_answer": "prompt", "gsm8k": "prompt", "boxed": "prompt"}
FORMAT_ARGS = ("chat_template", "chat_template_text", "system_prompt", "prompt_template", "add_generation_prompt")
FIELD_ARGS = ("prompt_key", "answer_key", "response_key", "image_key")
IMAGE_ARGS = ("min_pixels", "max_pixels", "image_inputs")
# filter_overlong is read by the launcher's length check (realflow.system.preflight), not here
DATASET_ARGS = (("max_prompt_len", "max_seq_len", "seed", "skip_bad_rows", "filter_overlong") + FORMAT_ARGS
                + FIELD_ARGS + IMAGE_ARGS)


_COMMON_ARGS = ("seed", "skip_bad_rows", "filter_overlong") + FIELD_ARGS + IMAGE_ARGS


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
    if spec.format in DATA_SOURCES:
        return DATA_SOURCES.get(spec.format).keys
    kind = _kind(spec.format)
    if kind is None:
        known = sorted(set(_BUILTIN_KIND) | set(DATASET_FORMATS.names()))
        raise ValueError(
            f"data set format '{spec.format}' has no sample keys defined"
            + did_you_mean(spec.format, known)
            + f" (known: {known}; a user format's parser must be annotated "
            "'-> PromptAnswerRow' or '-> SFTRow', or a data source registered with "
            "realflow.data.source.register_data_source)"
        )
    images = IMAGE_KEYS if spec.args.get("image_inputs") else ()
    return (_SFT_KEYS if kind == "sft" else _PROMPT_KEYS) + images + _METADATA_KEYS


def _parse_args(spec: DatasetSpec, known: tuple[str, ...] = DATASET_ARGS) -> dict:
    args = dict(spec.args)
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(
            f"data set {spec.path!r}: unknown args {unknown}" + did_you_mean(unknown[0], known)
            + f" (known: {list(known)})"
        )
    return args


def _load_source_shard(spec: DatasetSpec, source: DataSource, tokenizer, rank: int,
                       world: int) -> list[SequenceBatch]:
    """A data source's samples of shard ``rank``: rows parsed (and checked) by the format's
    parser, turned into samples by ``source.to_sample``, every ``world``-th from ``rank``."""
    args = _parse_args(spec, _COMMON_ARGS + source.args)
    args.pop("seed", None)
    args.pop("filter_overlong", None)
    skip_bad = bool(args.pop("skip_bad_rows", False))
    fields = field_map_of(args)
    images = image_processing_of(args, tokenizer)
    for k in FIELD_ARGS + IMAGE_ARGS:
        args.pop(k, None)
    rows, bad = load_rows_report(spec.path, spec.format, skip_bad_rows=skip_bad, fields=fields, images=images)
    samples = [b for b in (source.to_sample(r, tokenizer, args) for r in rows) if b is not None]
    for b in samples:
        missing = sorted(set(source.keys) - set(b.data) - set(b.metadata))
        if missing or len(b) != 1:
            raise ValueError(f"data source {spec.format!r}: to_sample must return one sample with keys "
                             f"{list(source.keys)}; got {len(b)} sample(s) missing {missing}")
    if rank == 0:
        logger.info("data set %s (%s): kept %d/%d rows (bad: %d, filtered: %d)", spec.path, spec.format,
                    len(samples), len(rows) + len(bad), len(bad), len(rows) - len(samples))
    if len(samples) < world:
        raise ValueError(f"data set {spec.path!r}: {len(samples)} samples left after filtering cannot feed "
                         f"{world} data-parallel ranks")
    return samples[rank::world]


def prompt_format_of(args: dict[str, Any]) -> PromptFormat:
    """The :class:`PromptFormat` a data set's args declare (the same for every process)."""
    return PromptFormat(chat_template=args.get("chat_template", "auto"),
                        system_prompt=args.get("system_prompt") or None,
                        prompt_template=args.get("prompt_template") or None,
                        add_generation_prompt=bool(args.get("add_generation_prompt", True)),
                        template_text=args.get("chat_template_text") or None)


def field_map_of(args: dict[str, Any]) -> FieldMap:
    """The :class:`FieldMap` a data set's args declare."""
    return FieldMap(*(args.get(k) or None for k in FIELD_ARGS))


def image_processing_of(args: dict[str, Any], tokenizer: Any = None) -> ImageProcessing:
    """The image processor's budget a data set's args declare (``min_pixels``/``max_pixels``), over
    the model's ``preprocessor_config.json`` next to the tokenizer when it has one."""
    import os

    where = getattr(tokenizer, "name_or_path", None)
    return ImageProcessing.from_pretrained_dir(where if where and os.path.isdir(where) else None,
                                               min_pixels=args.get("min_pixels") or None,
                                               max_pixels=args.get("max_pixels") or None)


def image_fields(images: "ImageInputs | None", patch_dim: int) -> tuple[dict, dict]:
    """(seqlens, data) of the two image keys of one sample (``images`` None: no image, empty)."""
    images = images if images is not None else ImageInputs.empty(patch_dim)
    return ({IMAGE_PIXELS: [[int(images.pixel_values.shape[0])]], IMAGE_GRID: [[images.num_images]]},
            {IMAGE_PIXELS: images.pixel_values, IMAGE_GRID: images.grid_thw})


def load_tokenized(spec: DatasetSpec, tokenizer) -> "PromptAnswerDataset | SFTDataset":
    """Read, check and tokenize the whole of a built-in-format data set (no sharding):
    what the workers, the rollout workers and ``--check`` all do with it."""
    kind = _kind(spec.format)
    args = _parse_args(spec)
    max_prompt_len = int(args.get("max_prompt_len", 1024))
    common = dict(seed=int(args.get("seed", 0)), prompt_format=prompt_format_of(args),
                  skip_bad_rows=bool(args.get("skip_bad_rows", False)), fields=field_map_of(args),
                  images=image_processing_of(args, tokenizer))
    if kind == "sft":
        return SFTDataset.load(spec.path, tokenizer, max_prompt_len, args.get("max_seq_len"), fmt=spec.format,
                               **common)
    return PromptAnswerDataset.load(spec.path, tokenizer, max_prompt_len, fmt=spec.format, **common)


def load_dataset_shard(spec: DatasetSpec, tokenizer, rank: int, world: int) -> list[SequenceBatch]:
    """Tokenize ``spec`` and return shard ``rank`` of ``world`` as one-sample batches.

    The filter report (kept / too long / bad rows) is logged once, by rank 0.
    """
    dataset_keys(spec)  # an unknown format fails here, with the known ones
    if spec.format in DATA_SOURCES:
        return _load_source_shard(spec, DATA_SOURCES.get(spec.format), tokenizer, rank, world)
    kind = _kind(spec.format)
    ds = load_tokenized(spec, tokenizer)
    if rank == 0:
        logger.info("data set %s (%s): %s", spec.path, spec.format, ds.report)
    if len(ds) == 0:
        raise ValueError(f"data set {spec.path!r}: no rows left after filtering: {ds.report}")
    shard = ds.shard(rank, world)
    with_images = bool(spec.args.get("image_inputs")) or any(s.images is not None for s in ds.samples)
    p = image_processing_of(spec.args, tokenizer)
    patch_dim = 3 * p.temporal_patch_size * p.patch_size ** 2
    return [_sample_batch(s, kind, with_images, patch_dim) for s in shard]


def _sample_batch(s: Any, kind: str | None, with_images: bool, patch_dim: int) -> SequenceBatch:
    """One sample as a one-sample batch (with the image keys when the data set has images)."""
    if kind == "sft":
        seqlens = {"packed_input_ids": [[len(s.input_ids)]], "prompt_mask": [[len(s.input_ids)]]}
        data = {"packed_input_ids": torch.tensor(s.input_ids, dtype=torch.long),
                "prompt_mask": torch.tensor(s.prompt_mask, dtype=torch.bool)}
    else:
        seqlens = {"packed_prompts": [[len(s.prompt_ids)]]}
        data = {"packed_prompts": torch.tensor(s.prompt_ids, dtype=torch.long)}
    if with_images:
        more_lens, more_data = image_fields(s.images, patch_dim)
        seqlens.update(more_lens)
        data.update(more_data)
    return SequenceBatch(ids=[s.id], seqlens=seqlens, data=data, metadata={"answer": [s.answer]})
