"""Data rows: the shapes users bring, parsed into one typed row each, with the culprit named.

Why this module exists: bad data must fail at the edge, with the file and line of the
culprit (``train.jsonl:17: field 'prompt' is empty``), never as a shape error deep inside a
worker. Every row is parsed by a named *format* (a registry, so users add their own with
``@DATASET_FORMATS.register``) into a small typed record before any tokenizer sees it.

What a row may look like (the built-in formats accept all of them):

* plain fields: a prompt in ``prompt``/``question``/``problem`` and a reference answer in
  ``answer``/``ground_truth``/``reward_model.ground_truth`` (verl), or read off a
  ``solution`` with GSM8K's ``#### 19`` or ``\\boxed{19}``;
* a conversational prompt: the prompt field is a list of ``{role, content}`` (TRL, verl);
* ``messages``: a whole conversation; for RL the prompt is everything before the last
  assistant turn (whose final answer is the reference when no answer field is given),
  for SFT the assistant turns are the targets;
* other field names through a :class:`FieldMap` (``dataset.prompt_key``,
  ``dataset.answer_key``, ``dataset.response_key``, ``dataset.image_key``; dotted paths reach
  nested fields);
* images: an ``images`` (or ``image``) field and ``<image>`` placeholders or ``{"type": "image"}``
  content parts in the prompt (:mod:`realflow.data.images`); every format gets them, read and
  checked by the loader.

Built-in formats: ``prompt_answer`` (RL), ``sft``, and the strict ``gsm8k``
(``question``/``answer``) and ``boxed`` (``problem``/``solution``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from realflow.api.data_formats import DATASET_FORMATS, Messages, PromptAnswerRow, RowInvalid, SFTRow
from realflow.api.images import ImageProcessing
from realflow.data.images import IMAGE_PART_TYPES, IMAGE_PLACEHOLDER, place_images, take_row_images
from realflow.data.readers import DataRowError, read_records

__all__ = [
    "DataRowError", "RowInvalid", "PromptAnswerRow", "SFTRow", "DATASET_FORMATS", "FieldMap", "load_rows",
    "load_rows_report", "extract_boxed", "extract_final_answer", "PROMPT_KEYS", "ANSWER_KEYS", "RESPONSE_KEYS",
]

PROMPT_KEYS = ("prompt", "question", "problem")
ANSWER_KEYS = ("answer", "ground_truth", "reward_model.ground_truth")
RESPONSE_KEYS = ("response", "solution", "completion")
ROLES = ("system", "user", "assistant", "tool")

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
class FieldMap:
    """Which fields of a row hold the prompt, the reference answer and the SFT response
    (``None`` = the defaults). A dotted name reaches into nested objects
    (``reward_model.ground_truth``). The mapped fields are copied to the canonical names
    (``prompt``, ``answer``, ``response``) before the format parses the row. ``image_key``
    names the field of the row's images (``None`` = ``images`` or ``image``); the loader takes
    it (:func:`realflow.data.images.take_row_images`), the format never sees it."""
    prompt_key: Optional[str] = None
    answer_key: Optional[str] = None
    response_key: Optional[str] = None
    image_key: Optional[str] = None

    def apply(self, raw: dict) -> dict:
        if not (self.prompt_key or self.answer_key or self.response_key):
            return raw
        out = dict(raw)
        for key, canonical, aliases in ((self.prompt_key, "prompt", PROMPT_KEYS + ("messages",)),
                                        (self.answer_key, "answer", ANSWER_KEYS),
                                        (self.response_key, "response", RESPONSE_KEYS)):
            if not key:
                continue
            found, value = lookup(raw, key)
            if not found:
                raise RowInvalid(f"missing field {key!r} (dataset.{canonical}_key; the row has "
                                 f"{', '.join(repr(k) for k in list(raw)[:8])})")
            for alias in aliases:  # the mapped field alone decides
                out.pop(alias.split(".")[0], None)
            out[canonical] = value
        return out


def lookup(raw: dict, key: str) -> tuple[bool, Any]:
    """(found, value) of ``key`` in ``raw``; a dotted key reaches into nested objects."""
    if key in raw:
        return True, raw[key]
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _text(raw: dict, keys: Sequence[str], required: bool = True) -> tuple[str | None, str | None]:
    """The first present key of ``keys``: (value, key). Must be a non-empty string."""
    for key in keys:
        found, val = lookup(raw, key)
        if found:
            if not isinstance(val, str):
                raise RowInvalid(f"field {key!r} must be a string, got {type(val).__name__}")
            if not val.strip():
                raise RowInvalid(f"field {key!r} is empty")
            return val, key
    if required:
        raise RowInvalid(f"missing field {' or '.join(repr(k) for k in keys)}")
    return None, None


def check_messages(value: Any, key: str) -> Messages:
    """``value`` as a list of ``{role, content}`` messages (content parts joined), or RowInvalid
    naming the field and the message."""
    if not isinstance(value, (list, tuple)) or not value:
        raise RowInvalid(f"field {key!r} must be a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowInvalid(f"field {key!r}[{i}] must be an object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowInvalid(f"field {key!r}[{i}]: role {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image"}]
            content = "".join(IMAGE_PLACEHOLDER if p.get("type") in IMAGE_PART_TYPES else p.get("text", "")
                              for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise RowInvalid(f"field {key!r}[{i}]: content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _prompt(raw: dict, keys: Sequence[str] = PROMPT_KEYS) -> tuple[Union[str, Messages], str]:
    """(prompt text or messages, field). A list-valued prompt is a conversational prompt."""
    for key in keys:
        found, val = lookup(raw, key)
        if found and isinstance(val, (list, tuple)):
            return check_messages(val, key), key
        if found:
            return _text(raw, (key,))[0], key  # type: ignore[return-value]
    raise RowInvalid(f"missing field {' or '.join(repr(k) for k in keys)} (or 'messages'; dataset.prompt_key "
                     "names another field)")


def _answer_value(val: Any, key: str) -> str:
    if isinstance(val, bool) or not isinstance(val, (str, int, float)):
        raise RowInvalid(f"field {key!r} must be a string or number, got {type(val).__name__}")
    text = str(val).strip()
    if not text:
        raise RowInvalid(f"field {key!r} is empty")
    final, _ = extract_final_answer(text)
    return final if final is not None else text


def _split_messages(raw: dict) -> tuple[Messages, Optional[str]]:
    """A ``messages`` row: (prompt messages, last assistant reply or None)."""
    msgs = check_messages(raw["messages"], "messages")
    if msgs[-1]["role"] == "assistant":
        if len(msgs) == 1:
            raise RowInvalid("field 'messages' holds only an assistant turn: there is no prompt")
        return msgs[:-1], msgs[-1]["content"]
    return msgs, None


def _meta(raw: dict, used: set[str]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in used}


@DATASET_FORMATS.register("prompt_answer")
def parse_prompt_answer(raw: dict) -> PromptAnswerRow:
    """A prompt (text, a conversational prompt, or ``messages``) plus a final answer: ``answer``
    (a string, possibly GSM8K ``... #### 42`` or containing ``\\boxed{42}``, or a number),
    ``ground_truth`` or verl's ``reward_model.ground_truth``, else read off ``solution``/
    ``response`` or the last assistant turn of ``messages``."""
    reply = None
    if "messages" in raw and not any(k in raw for k in PROMPT_KEYS):
        (prompt, reply), pkey = _split_messages(raw), "messages"
    else:
        prompt, pkey = _prompt(raw)
    used = {"id", pkey}
    for key in ANSWER_KEYS:
        found, val = lookup(raw, key)
        if found:
            used.add(key.split(".")[0])
            return PromptAnswerRow(id="", prompt=prompt, answer=_answer_value(val, key), meta=_meta(raw, used))
    sol, skey = _text(raw, RESPONSE_KEYS, required=False)
    if sol is None and reply:
        sol, skey = reply, "messages"
    if sol is None:
        raise RowInvalid("missing field 'answer' (or 'ground_truth', 'reward_model.ground_truth', a 'solution' "
                         "with \\boxed{...} or '#### ...'; dataset.answer_key names another field)")
    answer, _ = extract_final_answer(sol)
    if answer is None and (skey == "messages" or not any(c.isspace() for c in sol.strip())):
        answer = sol.strip()  # a last reply, or a bare value ("72", "\\frac{1}{2}") as TRL's data sets give
    if answer is None:
        raise RowInvalid(f"no final answer in field {skey!r} (expected \\boxed{{...}} or '#### ...')")
    return PromptAnswerRow(id="", prompt=prompt, answer=answer, meta=_meta(raw, used))


@DATASET_FORMATS.register("sft")
def parse_sft(raw: dict) -> SFTRow:
    """A prompt (text or messages) plus the target in ``response``/``solution``/``completion``
    (text, or TRL's list of assistant messages), or a whole ``messages`` conversation."""
    if "messages" in raw and not any(k in raw for k in PROMPT_KEYS):
        msgs = check_messages(raw["messages"], "messages")
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        if not replies:
            raise RowInvalid("field 'messages' has no assistant turn to train on")
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        if first == 0:
            raise RowInvalid("field 'messages' starts with an assistant turn: there is no prompt")
        return SFTRow(id="", prompt=msgs[:first], response=replies[-1], answer=_answer_of(raw, replies[-1]),
                      meta=_meta(raw, {"id", "messages", "answer"}), messages=msgs)
    prompt, pkey = _prompt(raw)
    messages = None
    for key in RESPONSE_KEYS:
        found, val = lookup(raw, key)
        if found and isinstance(val, (list, tuple)):  # TRL's conversational prompt-completion
            completion = check_messages(val, key)
            if not any(m["role"] == "assistant" for m in completion):
                raise RowInvalid(f"field {key!r} has no assistant turn to train on")
            head = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages, response, rkey = head + completion, completion[-1]["content"], key
            break
    else:
        response, rkey = _text(raw, RESPONSE_KEYS)
    return SFTRow(id="", prompt=prompt, response=response, answer=_answer_of(raw, response),
                  meta=_meta(raw, {"id", pkey, rkey, "answer"}), messages=messages)


def _answer_of(raw: dict, response: str) -> str | None:
    answer = raw.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise RowInvalid(f"field 'answer' must be a string or number, got {type(answer).__name__}")
    answer = str(answer).strip() if answer is not None else extract_final_answer(response)[0]
    return answer or None


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
    prompt, pkey = _text(raw, ("question",) + tuple(k for k in PROMPT_KEYS if k != "question"))
    sol, skey = _text(raw, ("answer",))
    answer = _final_after_hashes(sol, skey)
    meta = _meta(raw, {"id", pkey, skey})
    meta["solution"] = sol
    return PromptAnswerRow(id="", prompt=prompt, answer=answer, meta=meta)


@DATASET_FORMATS.register("boxed")
def parse_boxed(raw: dict) -> PromptAnswerRow:
    """MATH-style: ``problem`` and a ``solution`` whose last ``\\boxed{...}`` (nested braces
    allowed) is the reference; an explicit ``answer`` field, when present, wins."""
    prompt, pkey = _text(raw, ("problem",) + tuple(k for k in PROMPT_KEYS if k != "problem"))
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


# ----------------------------------------------------------------------------- loading

def load_rows(path: str | os.PathLike, fmt: str = "prompt_answer", fields: FieldMap | None = None,
              images: ImageProcessing | None = None) -> list:
    """Parse every row of a data file with format ``fmt``; the first bad row raises.

    Ids come from an ``id`` field (string or integer) or default to ``<file stem>-<line or
    row>``; duplicates are an error at the second occurrence. A row's images are read and
    checked within ``images``' limits (a missing, corrupt or too large image is a bad row).
    """
    rows, _ = load_rows_report(path, fmt, skip_bad_rows=False, fields=fields, images=images)
    return rows


def load_rows_report(path: str | os.PathLike, fmt: str = "prompt_answer", skip_bad_rows: bool = True,
                     fields: FieldMap | None = None,
                     images: ImageProcessing | None = None) -> tuple[list, list[DataRowError]]:
    """Like :func:`load_rows`, but with ``skip_bad_rows`` a bad row (bad JSON, a field
    missing, a duplicate id, ...) is returned as a :class:`DataRowError` (``path:line:
    reason``) instead of raised. A missing file, or a file without one good row, raises."""
    parser = DATASET_FORMATS.get(fmt)
    fields = fields or FieldMap()
    limits = images or ImageProcessing()
    base_dir = os.path.dirname(os.path.abspath(str(path).rstrip("/")))
    stem = os.path.splitext(os.path.basename(str(path).rstrip("/")))[0]
    rows, seen, bad = [], {}, []
    for n, raw, unit in read_records(path, bad if skip_bad_rows else None):
        try:
            rid = raw.get("id", f"{stem}-{n}")
            if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
                raise DataRowError(path, n, f"field 'id' must be a non-empty string or integer, got {rid!r}", unit)
            rid = str(rid)
            if rid in seen:
                raise DataRowError(path, n, f"duplicate id {rid!r} (first at {unit} {seen[rid]})", unit)
            try:
                raw, row_images = take_row_images(raw, fields.image_key, base_dir, limits)
                raw = fields.apply(raw)
                row = parser(raw)
                if row_images or _has_image_parts(raw):
                    row = _with_images(row, row_images, raw)
            except KeyError as e:  # a user parser indexing raw[...] directly
                raise DataRowError(path, n, f"missing field {e.args[0]!r}" if e.args else "KeyError", unit) from None
            except (ValueError, TypeError) as e:
                raise DataRowError(path, n, str(e) or type(e).__name__, unit) from None
        except DataRowError as e:
            if not skip_bad_rows:
                raise
            bad.append(e)
            continue
        seen[rid] = n
        rows.append(dataclasses.replace(row, id=rid))
    if not rows:
        why = f" ({len(bad)} bad rows; first: {bad[0]})" if bad else ""
        raise DataRowError(path, 0, ("data file has no valid rows" if bad else "data file has no rows") + why)
    return rows, bad


def _has_image_parts(raw: dict) -> bool:
    """Whether a row's conversation has image content parts (placeholders, with or without images)."""
    return any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
               for v in raw.values() if isinstance(v, (list, tuple))
               for m in v if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"])


def _with_images(row: Any, images: tuple[bytes, ...], raw: dict) -> Any:
    """``row`` carrying ``images``, its placeholders checked (or put before the text when it has none)."""
    name = next((k for k in PROMPT_KEYS + ("messages",) if k in raw), "prompt")
    if isinstance(row, SFTRow) and row.messages is not None:
        msgs = place_images(row.messages, len(images), "messages" if "messages" in raw else name)
        first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
        prompt = msgs[:first] if isinstance(row.prompt, list) else row.prompt
        return dataclasses.replace(row, messages=msgs, prompt=prompt, images=images)
    if not isinstance(row, (PromptAnswerRow, SFTRow)):
        raise RowInvalid(f"the row has images but format {type(row).__name__} rows cannot carry them")
    return dataclasses.replace(row, prompt=place_images(row.prompt, len(images), name), images=images)
