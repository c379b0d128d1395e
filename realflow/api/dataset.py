"""Data set formats, row validation and tokenized, shardable data sets.

Why this module exists: bad data must fail at the edge, with the file and
line of the culprit (``train.jsonl:17: field 'prompt' is empty``), never as a
shape error deep inside a worker. Every row is therefore parsed by a named
*format* (a registry, so users add their own with ``@DATASET_FORMATS.register``)
into a small typed record before any tokenizer or model sees it.

Built-in formats: ``sft`` (prompt + response), ``prompt_answer`` (prompt + final
answer; auto-detects plain, GSM8K ``#### 42`` and ``\\boxed{42}`` rows), and the
strict ``gsm8k`` (``question``/``answer``) and ``boxed`` (``problem``/``solution``).
A loader either raises on the first bad row or, with ``skip_bad_rows``, logs each
one and counts it in the :class:`FilterReport` next to the length filters.

Sharding and shuffling are pure functions of (seed, epoch, rank, world): all
data-parallel workers agree on who owns which sample without talking, and a
resumed run sees the same order as one that never stopped.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

from realflow.api.registry import Registry

logger = logging.getLogger(__name__)

__all__ = [
    "DataRowError", "PromptAnswerRow", "SFTRow", "DATASET_FORMATS", "read_jsonl", "load_rows",
    "load_rows_report", "PromptFormat", "render_prompts",
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


def _final_after_hashes(text: str, key: str) -> str:
    pos = text.rfind("#### ")
    ans = text[pos + 5:].strip().split("\n", 1)[0].strip() if pos >= 0 else ""
    if not ans:
        raise RowInvalid(f"field {key!r} has no final answer after '#### '")
    return ans


@DATASET_FORMATS.register("gsm8k")
def parse_gsm8k(raw: dict) -> PromptAnswerRow:
    """GSM8K: ``question`` and ``answer`` = worked solution ending in ``#### <final>``.
    The final answer is the reference; the worked solution is kept as ``meta['solution']``."""
    prompt, pkey = _text(raw, ("question",) + tuple(k for k in _PROMPT_KEYS if k != "question"))
    sol, skey = _text(raw, ("answer",))
    answer = _final_after_hashes(sol, skey)
    meta = _meta(raw, {"id", pkey, skey})
    meta["solution"] = sol
    return PromptAnswerRow(id="", prompt=prompt, answer=answer, meta=meta)


@DATASET_FORMATS.register("boxed")
def parse_boxed(raw: dict) -> PromptAnswerRow:
    """MATH-style: ``problem`` and a ``solution`` whose last ``\\boxed{...}`` (nested braces
    allowed) is the reference; an explicit ``answer`` field, when present, wins."""
    prompt, pkey = _text(raw, ("problem",) + tuple(k for k in _PROMPT_KEYS if k != "problem"))
    sol, skey = _text(raw, ("solution",), required="answer" not in raw)
    used = {"id", pkey, skey, "answer"}
    if "answer" in raw:
        ans = raw["answer"]
        if isinstance(ans, bool) or not isinstance(ans, (str, int, float)) or not str(ans).strip():
            raise RowInvalid(f"field 'answer' must be a non-empty string or number, got {ans!r:.40}")
        answer = extract_boxed(str(ans)) or str(ans).strip()
    else:
        answer = extract_boxed(sol or "")
        if not answer:
            raise RowInvalid(f"no \\boxed{{...}} answer in field {skey!r} (unbalanced or missing braces?)")
    meta = _meta(raw, used)
    if sol is not None:
        meta["solution"] = sol
    return PromptAnswerRow(id="", prompt=prompt, answer=answer, meta=meta)


def read_jsonl(path: str | os.PathLike, bad: list | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line. A bad line raises DataRowError,
    or, when a ``bad`` list is given, is appended to it and skipped."""
    if not os.path.isfile(path):
        raise DataRowError(path, 0, "no such data file")
    with open(path, "rb") as f:  # decoded per line, so that a bad byte names its line
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataRowError(path, lineno, f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column "
                                                     f"{e.start + 1}") from None
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise DataRowError(path, lineno, f"row must be a JSON object, got {type(obj).__name__}")
            except json.JSONDecodeError as e:
                err = DataRowError(path, lineno, f"invalid JSON: {e.msg} (column {e.colno})")
            except RecursionError:
                err = DataRowError(path, lineno, "invalid row: JSON nested too deeply")
            except DataRowError as e:
                err = e
            else:
                yield lineno, obj
                continue
            if bad is None:
                raise err
            bad.append(err)


def load_rows(path: str | os.PathLike, fmt: str = "prompt_answer") -> list:
    """Parse every row of a jsonl file with format ``fmt``; the first bad row raises.

    Ids come from an ``id`` field (string or integer) or default to
    ``<file stem>-<line>``; duplicates are an error at the second occurrence.
    """
    rows, _ = load_rows_report(path, fmt, skip_bad_rows=False)
    return rows


def load_rows_report(path: str | os.PathLike, fmt: str = "prompt_answer",
                     skip_bad_rows: bool = True) -> tuple[list, list[DataRowError]]:
    """Like :func:`load_rows`, but with ``skip_bad_rows`` a bad row (bad JSON, a field
    missing, a duplicate id, ...) is returned as a :class:`DataRowError` (``path:line:
    reason``) instead of raised. A missing file, or a file without one good row, raises."""
    parser = DATASET_FORMATS.get(fmt)
    stem = os.path.splitext(os.path.basename(path))[0]
    rows, seen, bad = [], {}, []
    for lineno, raw in read_jsonl(path, bad if skip_bad_rows else None):
        try:
            rid = raw.get("id", f"{stem}-{lineno}")
            if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
                raise DataRowError(path, lineno, f"field 'id' must be a non-empty string or integer, got {rid!r}")
            rid = str(rid)
            if rid in seen:
                raise DataRowError(path, lineno, f"duplicate id {rid!r} (first at line {seen[rid]})")
            try:
                row = parser(raw)
            except KeyError as e:  # a user parser indexing raw[...] directly
                raise DataRowError(path, lineno, f"missing field {e.args[0]!r}" if e.args else "KeyError") from None
            except (ValueError, TypeError) as e:
                raise DataRowError(path, lineno, str(e) or type(e).__name__) from None
        except DataRowError as e:
            if not skip_bad_rows:
                raise
            bad.append(e)
            continue
        seen[rid] = lineno
        rows.append(dataclasses.replace(row, id=rid))
    if not rows:
        why = f" ({len(bad)} bad rows; first: {bad[0]})" if bad else ""
        raise DataRowError(path, 0, ("data file has no valid rows" if bad else "data file has no rows") + why)
    return rows, bad


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


@dataclass
class PromptFormat:
    """How a row's prompt text becomes the model's prompt.

    ``prompt_template``: a ``str.format`` template with ``{prompt}`` (e.g. an instruction
    to end with ``#### <answer>``), applied first. ``chat_template``: wrap the prompt as
    a user message (after ``system_prompt`` if given) with the tokenizer's own chat
    template and the generation prompt; the template then owns special tokens such as
    BOS, so the tokenizer does not add them again.
    """

    chat_template: bool = False
    system_prompt: str | None = None
    prompt_template: str | None = None

    def __post_init__(self) -> None:
        t = self.prompt_template
        if t is not None:
            try:
                t.format(prompt="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"prompt_template {t!r} is not a valid template with only "
                                 f"{{prompt}}: {type(e).__name__}: {e}") from None
            if "{prompt}" not in t:
                raise ValueError(f"prompt_template {t!r} must contain '{{prompt}}'")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt needs chat_template=True")


def render_prompts(tokenizer: Any, prompts: Sequence[str], fmt: PromptFormat | None = None) -> list[list[int]]:
    """Token ids of each prompt under ``fmt`` (see :class:`PromptFormat`)."""
    fmt = fmt or PromptFormat()
    texts = [fmt.prompt_template.format(prompt=p) for p in prompts] if fmt.prompt_template else list(prompts)
    if not fmt.chat_template:
        return _encode(tokenizer, texts, special=True)
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"chat_template=True but tokenizer {name!r} has no chat template "
                         "(set chat_template=False, or use a tokenizer that ships one)")
    system = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
    rendered = [tokenizer.apply_chat_template(system + [{"role": "user", "content": t}],
                                              tokenize=False, add_generation_prompt=True) for t in texts]
    return _encode(tokenizer, rendered, special=False)


def _count(report: FilterReport, reason: str) -> None:
    report.dropped[reason] = report.dropped.get(reason, 0) + 1


class PromptAnswerDataset(_ShardedDataset[PromptSample]):
    """RL prompts with reference answers, tokenized; prompts longer than
    ``max_prompt_len`` tokens are dropped and counted in ``report`` (as are the
    ``n_bad_rows`` rows the loader skipped, under ``bad_row``)."""

    @classmethod
    def from_rows(cls, rows: Sequence[PromptAnswerRow], tokenizer: Tokenizer,
                  max_prompt_len: int, seed: int = 0, prompt_format: PromptFormat | None = None,
                  n_bad_rows: int = 0) -> "PromptAnswerDataset":
        ids = render_prompts(tokenizer, [r.prompt for r in rows], prompt_format)
        report = FilterReport(total=len(rows) + n_bad_rows, kept=0)
        if n_bad_rows:
            report.dropped["bad_row"] = n_bad_rows
        samples = []
        for r, p in zip(rows, ids):
            if len(p) > max_prompt_len:
                _count(report, "prompt_too_long")
                continue
            samples.append(PromptSample(r.id, p, r.answer, r.meta))
        report.kept = len(samples)
        return cls(samples, report, seed)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
             fmt: str = "prompt_answer", seed: int = 0, prompt_format: PromptFormat | None = None,
             skip_bad_rows: bool = False) -> "PromptAnswerDataset":
        """Read, validate and tokenize ``path``; with ``skip_bad_rows`` bad rows are logged
        (``path:line: reason``) and counted instead of raised."""
        rows, bad = load_rows_report(path, fmt, skip_bad_rows)
        _log_bad_rows(bad)
        return cls.from_rows(rows, tokenizer, max_prompt_len, seed, prompt_format, len(bad))


class SFTDataset(_ShardedDataset[SFTSample]):
    """SFT pairs, tokenized as prompt (with the tokenizer's special tokens, e.g. BOS, or
    under a :class:`PromptFormat`) followed by response + EOS. Rows whose prompt exceeds
    ``max_prompt_len`` or whose whole sequence exceeds ``max_seq_len`` are dropped and
    counted in ``report``."""

    @classmethod
    def from_rows(cls, rows: Sequence[SFTRow], tokenizer: Tokenizer, max_prompt_len: int,
                  max_seq_len: int | None = None, seed: int = 0,
                  prompt_format: PromptFormat | None = None, n_bad_rows: int = 0) -> "SFTDataset":
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("SFTDataset: the tokenizer has no eos_token_id")
        prompts = render_prompts(tokenizer, [r.prompt for r in rows], prompt_format)
        responses = _encode(tokenizer, [r.response for r in rows], special=False)
        report = FilterReport(total=len(rows) + n_bad_rows, kept=0)
        if n_bad_rows:
            report.dropped["bad_row"] = n_bad_rows
        samples = []
        for r, p, a in zip(rows, prompts, responses):
            if not a or a[-1] != eos:
                a = a + [eos]
            reason = ("prompt_too_long" if len(p) > max_prompt_len else
                      "sequence_too_long" if max_seq_len is not None and len(p) + len(a) > max_seq_len
                      else None)
            if reason:
                _count(report, reason)
                continue
            samples.append(SFTSample(r.id, p + a, [1] * len(p) + [0] * len(a), r.answer, r.meta))
        report.kept = len(samples)
        return cls(samples, report, seed)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
             max_seq_len: int | None = None, fmt: str = "sft", seed: int = 0,
             prompt_format: PromptFormat | None = None, skip_bad_rows: bool = False) -> "SFTDataset":
        rows, bad = load_rows_report(path, fmt, skip_bad_rows)
        _log_bad_rows(bad)
        return cls.from_rows(rows, tokenizer, max_prompt_len, max_seq_len, seed, prompt_format, len(bad))


_MAX_LOGGED_BAD_ROWS = 20


def _log_bad_rows(bad: list[DataRowError]) -> None:
    """One warning per skipped row (``path:line: reason``), up to a cap, then a count."""
    for e in bad[:_MAX_LOGGED_BAD_ROWS]:
        logger.warning("skipped bad row %s", e)
    if len(bad) > _MAX_LOGGED_BAD_ROWS:
        logger.warning("... and %d more bad rows skipped", len(bad) - _MAX_LOGGED_BAD_ROWS)
