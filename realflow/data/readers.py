"""Reading the files users bring: jsonl, json, parquet and saved Hugging Face ``datasets``.

Why one module: every reader must hand the row parsers the same thing -- a plain dict
per row plus *where* it came from -- so that a bad row is reported the same way
whatever the file type (``train.jsonl:17: ...``, ``train.parquet: row 17: ...``). The
parsers in :mod:`realflow.data.dataset` never see a file.

* ``.jsonl`` / ``.ndjson``: one JSON object per line (blank lines skipped);
* ``.json``: a JSON array of objects, or JSON lines (what ``datasets``' ``to_json``
  writes under that extension) -- told apart by the first character;
* ``.parquet``: read with pyarrow, batch by batch (a row's number is 1-based);
* a directory saved by ``datasets.Dataset.save_to_disk`` (``state.json`` + ``*.arrow``),
  read with pyarrow's IPC stream reader, or a directory of ``*.parquet`` shards (a hub
  data set snapshot). A ``DatasetDict`` directory names its splits in the error.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

__all__ = ["DataRowError", "read_records", "record_kind", "SUPPORTED_DATA_FILES"]

SUPPORTED_DATA_FILES = ".jsonl, .json, .parquet, or a directory saved by datasets' save_to_disk"


class DataRowError(ValueError):
    """A bad data row. ``str(err)`` is one line: ``path:line: reason`` (text files) or
    ``path: row N: reason`` (parquet and arrow, whose rows have no lines)."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str, unit: str = "line") -> None:
        self.path, self.line, self.reason, self.unit = str(path), line, reason, unit
        where = f"{self.path}:{line}" if unit == "line" else f"{self.path}: {unit} {line}"
        super().__init__(f"{where}: {reason}" if line else f"{self.path}: {reason}")


def record_kind(path: str | os.PathLike) -> str:
    """``jsonl`` | ``json`` | ``parquet`` | ``arrow_dir`` | ``parquet_dir``; raises DataRowError."""
    p = str(path)
    if os.path.isdir(p):
        names = os.listdir(p)
        if "dataset_dict.json" in names:
            with open(os.path.join(p, "dataset_dict.json")) as f:
                splits = json.load(f).get("splits", [])
            hint = f"{p.rstrip('/')}/{splits[0]}" if splits else f"{p.rstrip('/')}/<split>"
            raise DataRowError(p, 0, f"a saved DatasetDict with splits {', '.join(splits) or '(none)'}: "
                                     f"point at one split, e.g. {hint}")
        if any(n.endswith(".arrow") for n in names):
            return "arrow_dir"
        if _parquet_shards(p):
            return "parquet_dir"
        raise DataRowError(p, 0, f"directory holds no data set ({SUPPORTED_DATA_FILES})")
    if not os.path.isfile(p):
        raise DataRowError(p, 0, "no such data file")
    ext = os.path.splitext(p)[1].lower()
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    if ext == ".json":
        return "json" if _first_char(p) == "[" else "jsonl"
    if ext in (".parquet", ".pq"):
        return "parquet"
    raise DataRowError(p, 0, f"unknown data file type {ext or '(no extension)'!r}; use {SUPPORTED_DATA_FILES}")


def read_records(path: str | os.PathLike, bad: list | None = None) -> Iterator[tuple[int, dict, str]]:
    """(row number, row, unit) for every row of ``path``: unit ``line`` for text files (the
    number is the line), ``row`` for parquet/arrow (1-based). A row that is not an object
    raises DataRowError, or with a ``bad`` list is appended to it and skipped."""
    kind = record_kind(path)
    if kind == "jsonl":
        for n, obj in _jsonl(path, bad):
            yield n, obj, "line"
    elif kind == "json":
        for n, obj in _json_array(path, bad):
            yield n, obj, "line"
    else:
        for n, obj in _arrow_rows(path, kind):
            yield n, obj, "row"


# ----------------------------------------------------------------------------- text files

def _first_char(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("ascii", "replace")


def _jsonl(path: str | os.PathLike, bad: list | None) -> Iterator[tuple[int, dict]]:
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


def _json_array(path: str | os.PathLike, bad: list | None) -> Iterator[tuple[int, dict]]:
    """Elements of a top-level JSON array, each with the line it starts on. The file is
    decoded element by element, so an error names the line of the element that is wrong."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataRowError(path, 0, f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}") from None
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line_at = _LineCounter(text)
    expect_item = True
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            raise DataRowError(path, line_at(pos), "invalid JSON: the array is not closed with ']'")
        if text[pos] == "]":
            return
        if not expect_item:
            if text[pos] != ",":
                raise DataRowError(path, line_at(pos), f"invalid JSON: expected ',' or ']' between rows, "
                                                       f"got {text[pos]!r}")
            pos = _skip_ws(text, pos + 1)
        line = line_at(pos)
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataRowError(path, e.lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
        expect_item = False
        if not isinstance(obj, dict):
            err = DataRowError(path, line, f"row must be a JSON object, got {type(obj).__name__}")
            if bad is None:
                raise err
            bad.append(err)
            continue
        yield line, obj


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class _LineCounter:
    """Line number (1-based) of a character offset, for offsets that only grow."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.line = text, 0, 1

    def __call__(self, pos: int) -> int:
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


# ----------------------------------------------------------------------------- columnar files

def _parquet_shards(directory: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(directory):
        out += [os.path.join(root, f) for f in files if f.endswith(".parquet")]
    return sorted(out)


def _arrow_rows(path: str | os.PathLike, kind: str) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataRowError(path, 0, "reading parquet/arrow needs pyarrow (pip install pyarrow)") from None
    n = 0
    for batch in _arrow_batches(str(path), kind):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _arrow_batches(path: str, kind: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=4096)
        elif kind == "parquet_dir":
            for shard in _parquet_shards(path):
                yield from pq.ParquetFile(shard).iter_batches(batch_size=4096)
        else:  # datasets' save_to_disk: Arrow IPC streams, in the order state.json lists them
            for shard in _arrow_shards(path):
                with pa.memory_map(shard) as source:
                    yield from pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as e:
        raise DataRowError(path, 0, f"unreadable {kind.replace('_dir', ' directory')}: "
                                    f"{str(e).splitlines()[0]}") from None


def _arrow_shards(directory: str) -> list[str]:
    state = os.path.join(directory, "state.json")
    if os.path.isfile(state):
        with open(state) as f:
            files = [d["filename"] for d in json.load(f).get("_data_files", [])]
        if files:
            return [os.path.join(directory, name) for name in files]
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".arrow"))
