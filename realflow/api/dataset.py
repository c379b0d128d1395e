"""Data set formats, row validation and tokenized, shardable data sets.

Why this module exists: bad data must fail at the edge, with the file and
line of the culprit (``train.jsonl:17: field 'prompt' is empty``), never as a
shape error deep inside a worker. Every row is therefore parsed by a named
*format* (a registry, so users add their own with ``@DATASET_FORMATS.register``)
into a small typed record before any tokenizer or model sees it.

Sharding and shuffling are pure functions of (seed, epoch, rank, world): all
data-parallel workers agree on who owns which sample without talking, and a
resumed run sees the same order as one that never stopped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

from realflow.api.registry import Registry

__all__ = [
    "DataRowError", "PromptAnswerRow", "SFTRow", "DATASET_FORMATS", "read_jsonl", "load_rows",
    "extract_boxed", "extract_final_answer", "FilterReport", "PromptSample", "SFTSample",
    "PromptAnswerDataset", "SFTDataset",
]


class DataRowError(ValueError):
    """A bad data row. ``str(err)`` is one line: ``path:line: reason``."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{self.path}:{line}: {reason}")


# ----------------------------------------------------------------------------- answers

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_final_answer(text: str) -> tuple[str | None, str]:
    """The final answer a solution states: last ``\\boxed{}``, else the text after the
    last GSM8K ``####`` (to the end of that line). Returns (answer or None, method)."""
    boxed = extract_boxed(text)
    if boxed:
        return boxed, "boxed"
    pos = text.rfind("####")
    if pos >= 0:
        ans = text[pos + 4:].strip().split("\n", 1)[0].strip()
        if ans:
            return ans, "####"
    return None, "none"


# ----------------------------------------------------------------------------- rows

@dataclass(frozen=True)
class PromptAnswerRow:
    """A prompt to generate from and the reference final answer (RL data)."""
    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SFTRow:
    """A prompt and the target response (SFT data); ``answer`` if one can be read off."""
    id: str
    prompt: str
    response: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class RowInvalid(ValueError):
    """Raised by a format parser; the loader adds ``path:line``."""


# A format turns a raw JSON object into a typed row, raising RowInvalid (or
# ValueError/TypeError) with a short reason. ``id`` is filled in by the loader.
RowParser = Callable[[dict], "PromptAnswerRow | SFTRow"]
DATASET_FORMATS: Registry[RowParser] = Registry("data set format")

_PROMPT_KEYS = ("prompt", "question", "problem")
_RESPONSE_KEYS = ("response", "solution", "completion")


def _text(raw: dict, keys: Sequence[str], required: bool = True) -> tuple[str | None, str | None]:
    """The first present key of ``keys``: (value, key). Must be a non-empty string."""
    for key in keys:
        if key in raw:
            val = raw[key]
            if not isinstance(val, str):
                raise RowInvalid(f"field {key!r} must be a string, got {type(val).__name__}")
            if not val.strip():
                raise RowInvalid(f"field {key!r} is empty")
            return val, key
    if required:
        names = " or ".join(repr(k) for k in keys)
        raise RowInvalid(f"missing field {names}")
    return None, None


def _meta(raw: dict, used: set[str]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in used}


@DATASET_FORMATS.register("prompt_answer")
def parse_prompt_answer(raw: dict) -> PromptAnswerRow:
    """``prompt``/``question``/``problem`` plus a final answer: ``answer`` (a string,
    possibly GSM8K ``... #### 42`` or containing ``\\boxed{42}``, or a number), else
    read off ``solution``/``response``."""
    prompt, pkey = _text(raw, _PROMPT_KEYS)
    used = {"id", pkey}
    if "answer" in raw:
        ans = raw["answer"]
        used.add("answer")
        if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
            raise RowInvalid(f"field 'answer' must be a string or number, got {type(ans).__name__}")
        ans = str(ans).strip()
        if not ans:
            raise RowInvalid("field 'answer' is empty")
        final, _ = extract_final_answer(ans)
        answer = final if final is not None else ans
    else:
        sol, skey = _text(raw, _RESPONSE_KEYS, required=False)
        if sol is None:
            raise RowInvalid("missing field 'answer' (or a 'solution' with \\boxed{...} or '#### ...')")
        answer, _ = extract_final_answer(sol)
        if answer is None:
            raise RowInvalid(f"no final answer in field {skey!r} (expected \\boxed{{...}} or '#### ...')")
    return PromptAnswerRow(id="", prompt=prompt, answer=answer, meta=_meta(raw, used))


@DATASET_FORMATS.register("sft")
def parse_sft(raw: dict) -> SFTRow:
    """``prompt`` plus the target text in ``response``/``solution``/``completion``."""
    prompt, pkey = _text(raw, _PROMPT_KEYS)
    response, rkey = _text(raw, _RESPONSE_KEYS)
    answer = raw.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise RowInvalid(f"field 'answer' must be a string or number, got {type(answer).__name__}")
    answer = str(answer).strip() if answer is not None else extract_final_answer(response)[0]
    return SFTRow(id="", prompt=prompt, response=response, answer=answer or None,
                  meta=_meta(raw, {"id", pkey, rkey, "answer"}))


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line; bad lines raise DataRowError."""
    if not os.path.isfile(path):
        raise DataRowError(path, 0, "no such data file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataRowError(path, lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataRowError(path, lineno, f"row must be a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def load_rows(path: str | os.PathLike, fmt: str = "prompt_answer") -> list:
    """Parse every row of a jsonl file with format ``fmt``.

    Ids come from an ``id`` field (string or integer) or default to
    ``<file stem>-<line>``; duplicates are an error at the second occurrence.
    """
    parser = DATASET_FORMATS.get(fmt)
    stem = os.path.splitext(os.path.basename(path))[0]
    rows, seen = [], {}
    for lineno, raw in read_jsonl(path):
        rid = raw.get("id", f"{stem}-{lineno}")
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
            raise DataRowError(path, lineno, f"field 'id' must be a non-empty string or integer, got {rid!r}")
        rid = str(rid)
        if rid in seen:
            raise DataRowError(path, lineno, f"duplicate id {rid!r} (first at line {seen[rid]})")
        seen[rid] = lineno
        try:
            row = parser(raw)
        except KeyError as e:  # a user parser indexing raw[...] directly
            raise DataRowError(path, lineno, f"missing field {e.args[0]!r}" if e.args else "KeyError") from None
        except (ValueError, TypeError) as e:
            raise DataRowError(path, lineno, str(e) or type(e).__name__) from None
        rows.append(dataclasses.replace(row, id=rid))
    if not rows:
        raise DataRowError(path, 0, "data file has no rows")
    return rows


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

    def __str__(self) -> str:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"
        return f"kept {self.kept}/{self.total} rows (dropped {self.total - self.kept}: {why})"


@dataclass(frozen=True)
class PromptSample:
    """A tokenized RL prompt."""
    id: str
    prompt_ids: list[int]
    answer: str
    meta: dict[str, Any]


@dataclass(frozen=True)
class SFTSample:
    """A tokenized SFT pair: ``input_ids`` = prompt + response (+ eos);
    ``prompt_mask[i]`` is 1 on prompt tokens (no loss), 0 on response tokens."""
    id: str
    input_ids: list[int]
    prompt_mask: list[int]
    answer: str | None
    meta: dict[str, Any]

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


def _encode(tokenizer: Tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    return [list(x) for x in tokenizer(texts, add_special_tokens=special)["input_ids"]]


class PromptAnswerDataset(_ShardedDataset[PromptSample]):
    """RL prompts with reference answers, tokenized; prompts longer than
    ``max_prompt_len`` tokens are dropped and counted in ``report``."""

    @classmethod
    def from_rows(cls, rows: Sequence[PromptAnswerRow], tokenizer: Tokenizer,
                  max_prompt_len: int, seed: int = 0) -> "PromptAnswerDataset":
        ids = _encode(tokenizer, [r.prompt for r in rows], special=True)
        report = FilterReport(total=len(rows), kept=0)
        samples = []
        for r, p in zip(rows, ids):
            if len(p) > max_prompt_len:
                report.dropped["prompt_too_long"] = report.dropped.get("prompt_too_long", 0) + 1
                continue
            samples.append(PromptSample(r.id, p, r.answer, r.meta))
        report.kept = len(samples)
        return cls(samples, report, seed)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
             fmt: str = "prompt_answer", seed: int = 0) -> "PromptAnswerDataset":
        return cls.from_rows(load_rows(path, fmt), tokenizer, max_prompt_len, seed)


class SFTDataset(_ShardedDataset[SFTSample]):
    """SFT pairs, tokenized as prompt (with the tokenizer's special tokens, e.g. BOS)
    followed by response + EOS. Rows whose prompt exceeds ``max_prompt_len`` or whose
    whole sequence exceeds ``max_seq_len`` are dropped and counted in ``report``."""

    @classmethod
    def from_rows(cls, rows: Sequence[SFTRow], tokenizer: Tokenizer, max_prompt_len: int,
                  max_seq_len: int | None = None, seed: int = 0) -> "SFTDataset":
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("SFTDataset: the tokenizer has no eos_token_id")
        prompts = _encode(tokenizer, [r.prompt for r in rows], special=True)
        responses = _encode(tokenizer, [r.response for r in rows], special=False)
        report = FilterReport(total=len(rows), kept=0)
        samples = []
        for r, p, a in zip(rows, prompts, responses):
            if not a or a[-1] != eos:
                a = a + [eos]
            reason = ("prompt_too_long" if len(p) > max_prompt_len else
                      "sequence_too_long" if max_seq_len is not None and len(p) + len(a) > max_seq_len
                      else None)
            if reason:
                report.dropped[reason] = report.dropped.get(reason, 0) + 1
                continue
            samples.append(SFTSample(r.id, p + a, [1] * len(p) + [0] * len(a), r.answer, r.meta))
        report.kept = len(samples)
        return cls(samples, report, seed)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
             max_seq_len: int | None = None, fmt: str = "sft", seed: int = 0) -> "SFTDataset":
        return cls.from_rows(load_rows(path, fmt), tokenizer, max_prompt_len, max_seq_len, seed)
