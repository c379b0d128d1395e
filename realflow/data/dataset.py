"""Tokenized, shardable data sets (and the names of the data layer, re-exported).

Rows are read by :mod:`realflow.data.readers` (jsonl, json, parquet, saved
``datasets``) and parsed by the formats of :mod:`realflow.data.rows` (plain fields,
conversational prompts, ``messages``, field mappings); prompts become token ids through
:mod:`realflow.data.chat_render`, the one rendering the whole run shares. This module
turns rows into samples, counts what the length limits drop (:class:`FilterReport`) and
shards them.

Sharding and shuffling are pure functions of (seed, epoch, rank, world): all
data-parallel workers agree on who owns which sample without talking, and a
resumed run sees the same order as one that never stopped.
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol, Sequence, TypeVar

from realflow.api.images import ImageInputs, ImageProcessing
from realflow.data.chat_render import ChatTemplateError, PromptFormat, conversation_ids, prompt_messages, render_prompts, template_of
from realflow.data.image_render import render_image_conversation, render_image_prompt
from realflow.data.readers import DataRowError, _jsonl
from realflow.data.rows import (DATASET_FORMATS, FieldMap, PromptAnswerRow, RowInvalid, SFTRow,
                                    extract_boxed, extract_final_answer, load_rows, load_rows_report)

logger = logging.getLogger(__name__)

__all__ = [
    "DataRowError", "PromptAnswerRow", "SFTRow", "DATASET_FORMATS", "FieldMap", "RowInvalid", "read_jsonl",
    "load_rows", "load_rows_report", "PromptFormat", "render_prompts",
    "extract_boxed", "extract_final_answer", "FilterReport", "PromptSample", "SFTSample",
    "PromptAnswerDataset", "SFTDataset",
]


def read_jsonl(path: str | os.PathLike, bad: list | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line of a jsonl file. A bad line raises
    DataRowError, or, when a ``bad`` list is given, is appended to it and skipped."""
    if not os.path.isfile(path):
        raise DataRowError(path, 0, "no such data file")
    yield from _jsonl(path, bad)


# ----------------------------------------------------------------------------- tokenized sets

class Tokenizer(Protocol):
    """What we need from a (Hugging Face) tokenizer."""
    eos_token_id: int | None

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Any: ...


@dataclass
class FilterReport:
    """How many rows were kept and why the others were dropped (reason -> count)."""
    total: int
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    longest_prompt: int = 0  # tokens, over every row read (kept or not)
    longest_seq: int = 0  # SFT: prompt + response tokens

    def __str__(self) -> str:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"
        return f"kept {self.kept}/{self.total} rows (dropped {self.total - self.kept}: {why})"


@dataclass(frozen=True)
class PromptSample:
    """A tokenized RL prompt. With images, ``prompt_ids`` hold each image's ``<|image_pad|>``
    repeated to its feature count, ``images`` the processor's pixels and grids, and
    ``image_bytes`` the encoded images as the row gave them (what an HTTP generation request,
    SGLang's ``image_data``, sends)."""
    id: str
    prompt_ids: list[int]
    answer: str
    meta: dict[str, Any]
    images: Optional[ImageInputs] = None
    image_bytes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class SFTSample:
    """A tokenized SFT pair: ``input_ids`` = prompt + response (+ eos);
    ``prompt_mask[i]`` is 1 on prompt tokens (no loss), 0 on response tokens. Images: as
    :class:`PromptSample`'s (their expanded ``<|image_pad|>`` tokens are prompt tokens)."""
    id: str
    input_ids: list[int]
    prompt_mask: list[int]
    answer: str | None
    meta: dict[str, Any]
    images: Optional[ImageInputs] = None
    image_bytes: tuple[bytes, ...] = ()

    @property
    def prompt_len(self) -> int:
        return sum(self.prompt_mask)


S = TypeVar("S", PromptSample, SFTSample)


class _ShardedDataset(Sequence[S]):
    """Samples in file order plus deterministic sharding and per-epoch shuffling."""

    def __init__(self, samples: list[S], report: FilterReport, seed: int = 0) -> None:
        self.samples, self.report, self.seed = samples, report, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.samples[i]

    @property
    def ids(self) -> list[str]:
        return [s.id for s in self.samples]

    def shard(self, rank: int, world: int, even: bool = False):
        """Rank ``rank``'s share: every ``world``-th sample starting at ``rank``.

        Shards are disjoint and together cover every sample once; sizes differ by
        at most one. ``even=True`` drops the last ``len % world`` samples first so
        every rank gets the same count (lockstep data-parallel training needs that).
        """
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise ValueError(f"shard: need 0 <= rank < world, got rank={rank} world={world}")
        n = len(self.samples) - (len(self.samples) % world if even else 0)
        if n < world:
            raise ValueError(f"shard: {len(self.samples)} samples cannot feed {world} ranks")
        return type(self)(self.samples[rank:n:world], self.report, self.seed)

    def epoch_order(self, epoch: int) -> list[int]:
        """A permutation of ``range(len(self))`` fixed by (seed, epoch, len)."""
        order = list(range(len(self.samples)))
        random.Random(f"realflow-data:{self.seed}:{epoch}").shuffle(order)
        return order

    def iter_batches(self, batch_size: int, epoch: int, shuffle: bool = True,
                     drop_last: bool = False, start: int = 0) -> Iterator[list[S]]:
        """Batches of one epoch; ``start`` skips that many batches (resume)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = self.epoch_order(epoch) if shuffle else list(range(len(self.samples)))
        stop = len(order) - (len(order) % batch_size if drop_last else 0)
        for b, i in enumerate(range(0, stop, batch_size)):
            if b >= start:
                yield [self.samples[j] for j in order[i:i + batch_size]]


def _count(report: FilterReport, reason: str) -> None:
    report.dropped[reason] = report.dropped.get(reason, 0) + 1


class PromptAnswerDataset(_ShardedDataset[PromptSample]):
    """RL prompts with reference answers, tokenized; prompts longer than
    ``max_prompt_len`` tokens are dropped and counted in ``report`` (as are the
    ``n_bad_rows`` rows the loader skipped, under ``bad_row``)."""

    @classmethod
    def from_rows(cls, rows: Sequence[PromptAnswerRow], tokenizer: Tokenizer,
                  max_prompt_len: int, seed: int = 0, prompt_format: PromptFormat | None = None,
                  n_bad_rows: int = 0, images: ImageProcessing | None = None) -> "PromptAnswerDataset":
        processing = images or ImageProcessing()
        text_rows = [r for r in rows if not r.images]
        text_ids = iter(_render_rows(tokenizer, text_rows, prompt_format))
        ids, pixels = [], []
        for r in rows:
            if r.images:
                p, inputs = render_image_prompt(tokenizer, r, prompt_format or PromptFormat(), processing)
            else:
                p, inputs = next(text_ids), None
            ids.append(p)
            pixels.append(inputs)
        report = FilterReport(total=len(rows) + n_bad_rows, kept=0)
        if n_bad_rows:
            report.dropped["bad_row"] = n_bad_rows
        samples = []
        for r, p, inputs in zip(rows, ids, pixels):
            report.longest_prompt = max(report.longest_prompt, len(p))
            if len(p) > max_prompt_len:
                _count(report, "prompt_too_long")
                continue
            samples.append(PromptSample(r.id, p, r.answer, r.meta, inputs, tuple(r.images)))
        report.kept = len(samples)
        return cls(samples, report, seed)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
             fmt: str = "prompt_answer", seed: int = 0, prompt_format: PromptFormat | None = None,
             skip_bad_rows: bool = False, fields: FieldMap | None = None,
             images: ImageProcessing | None = None) -> "PromptAnswerDataset":
        """Read, validate and tokenize ``path``; with ``skip_bad_rows`` bad rows are logged
        (``path:line: reason``) and counted instead of raised. ``images``: the image
        processor's budget and limits (rows with images only)."""
        rows, bad = load_rows_report(path, fmt, skip_bad_rows, fields, images)
        _log_bad_rows(bad)
        return cls.from_rows(rows, tokenizer, max_prompt_len, seed, prompt_format, len(bad), images)


class SFTDataset(_ShardedDataset[SFTSample]):
    """SFT samples. With a chat template (or a conversational row) the whole conversation is
    rendered by :func:`~realflow.data.chat_render.conversation_ids` and only assistant tokens
    carry loss; otherwise a text prompt (with the tokenizer's special tokens, e.g. BOS, under
    its :class:`PromptFormat`) is followed by response + EOS. Rows whose prompt (the tokens
    before the first target token) exceeds ``max_prompt_len`` or whose whole sequence exceeds
    ``max_seq_len`` are dropped and counted in ``report``."""

    @classmethod
    def from_rows(cls, rows: Sequence[SFTRow], tokenizer: Tokenizer, max_prompt_len: int,
                  max_seq_len: int | None = None, seed: int = 0,
                  prompt_format: PromptFormat | None = None, n_bad_rows: int = 0,
                  images: ImageProcessing | None = None) -> "SFTDataset":
        fmt = prompt_format or PromptFormat()
        report = FilterReport(total=len(rows) + n_bad_rows, kept=0)
        if n_bad_rows:
            report.dropped["bad_row"] = n_bad_rows
        samples = []
        for r, (ids, mask, inputs) in zip(rows, _sft_token_ids(rows, tokenizer, fmt, images or ImageProcessing())):
            n_prompt = mask.index(0) if 0 in mask else len(mask)
            report.longest_prompt = max(report.longest_prompt, n_prompt)
            report.longest_seq = max(report.longest_seq, len(ids))
            reason = ("prompt_too_long" if n_prompt > max_prompt_len else
                      "sequence_too_long" if max_seq_len is not None and len(ids) > max_seq_len
                      else None)
            if reason:
                _count(report, reason)
                continue
            samples.append(SFTSample(r.id, ids, mask, r.answer, r.meta, inputs, tuple(r.images)))
        report.kept = len(samples)
        return cls(samples, report, seed)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
             max_seq_len: int | None = None, fmt: str = "sft", seed: int = 0,
             prompt_format: PromptFormat | None = None, skip_bad_rows: bool = False,
             fields: FieldMap | None = None, images: ImageProcessing | None = None) -> "SFTDataset":
        rows, bad = load_rows_report(path, fmt, skip_bad_rows, fields, images)
        _log_bad_rows(bad)
        return cls.from_rows(rows, tokenizer, max_prompt_len, max_seq_len, seed, prompt_format, len(bad), images)


def _sft_token_ids(rows: Sequence[SFTRow], tokenizer: Tokenizer, fmt: PromptFormat,
                   processing: ImageProcessing) -> Iterator[tuple[list[int], list[int], Optional[ImageInputs]]]:
    """(ids, no-loss mask, images) per row: a conversation when a template applies, else text + EOS."""
    chat = template_of(tokenizer, fmt) is not None
    plain = [r for r in rows if not chat and r.messages is None and isinstance(r.prompt, str) and not r.images]
    eos = tokenizer.eos_token_id
    if plain and eos is None:
        raise ValueError("SFTDataset: the tokenizer has no eos_token_id")
    prompts = iter(_render_rows(tokenizer, plain, fmt))
    responses = iter(render_responses(tokenizer, [r.response for r in plain]))
    for r in rows:
        if r.images:
            yield render_image_conversation(tokenizer, r, fmt, processing)
            continue
        if chat or r.messages is not None or not isinstance(r.prompt, str):
            msgs = r.messages
            if msgs is None:
                msgs = prompt_messages(r.prompt, fmt) + [{"role": "assistant", "content": r.response}]
            try:
                yield (*conversation_ids(tokenizer, msgs, fmt), None)
            except ChatTemplateError as e:
                raise ChatTemplateError(f"row {r.id!r}: {e}") from None
            continue
        p, a = next(prompts), next(responses)
        if not a or a[-1] != eos:
            a = a + [eos]
        yield p + a, [1] * len(p) + [0] * len(a), None


def _render_rows(tokenizer: Tokenizer, rows: Sequence[Any], fmt: PromptFormat | None) -> list[list[int]]:
    """Every row's prompt ids; a prompt that cannot be rendered names its row."""
    try:
        return render_prompts(tokenizer, [r.prompt for r in rows], fmt)
    except ChatTemplateError as e:
        for r in rows:
            try:
                render_prompts(tokenizer, [r.prompt], fmt)
            except ChatTemplateError:
                raise ChatTemplateError(f"row {r.id!r}: {e}") from None
        raise


def render_responses(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Response texts as ids, without special tokens (the prompt carries them)."""
    if not texts:
        return []
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


_MAX_LOGGED_BAD_ROWS = 20


def _log_bad_rows(bad: list[DataRowError]) -> None:
    """One warning per skipped row (``path:line: reason``), up to a cap, then a count."""
    for e in bad[:_MAX_LOGGED_BAD_ROWS]:
        logger.warning("skipped bad row %s", e)
    if len(bad) > _MAX_LOGGED_BAD_ROWS:
        logger.warning("... and %d more bad rows skipped", len(bad) - _MAX_LOGGED_BAD_ROWS)
