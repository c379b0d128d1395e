"""Training statistics: reduction across workers and logging per step.

Each worker returns a flat ``{name: scalar}`` dict per MFC call; the master combines
them with ``reduce_stats`` (mean of losses, sum of token counts, max of memory, ...)
and hands the result to ``StatsLogger``, which always writes two things:

* TensorBoard event files under ``<run_dir>/tensorboard`` - for people;
* ``<run_dir>/stats.jsonl``, one JSON object per ``log`` call - for scripts and
  tests, without needing TensorBoard to read them back;

and, when ``wandb.mode`` is online or offline, the same rows to a Weights & Biases run
(:mod:`realflow.base.wandb_sink`).

Non-finite values are kept (NaN loss is exactly what one wants to see); the jsonl
file writes them as the JSON extensions ``NaN`` / ``Infinity`` that Python's json
reads back.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from realflow.base.wandb_sink import WandbConfig

REDUCE_OPS = ("mean", "sum", "min", "max")
_RESERVED = ("step", "time")


def _to_float(key: str, value: Any) -> float:
    """float(value) for python/numpy scalars and one-element tensors; else a clear error."""
    if isinstance(value, bool) or isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    if callable(item):
        n = numel() if callable(numel) else numel
        if n in (None, 1):
            return float(item())
    raise TypeError(f"stat '{key}' must be a scalar number, got {type(value).__name__}: {value!r:.80}")


def reduce_stats(
    per_worker: Sequence[Mapping[str, Any]],
    op: str | Mapping[str, str] = "mean",
    default: str = "mean",
) -> dict[str, float]:
    """Combine per-worker stat dicts into one.

    ``op`` is one op for every key, or ``{key: op}`` with ``default`` for other keys.
    Ops: mean, sum, min, max. A key missing on some workers is reduced over the
    workers that have it (e.g. only pipeline-last ranks report the loss).
    """
    ops = {} if isinstance(op, str) else dict(op)
    fallback = op if isinstance(op, str) else default
    for k, o in [*ops.items(), ("<default>", fallback)]:
        if o not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {o!r} for stat '{k}'; choose one of {REDUCE_OPS}")
    values: dict[str, list[float]] = {}
    for i, stats in enumerate(per_worker):
        for k, v in stats.items():
            try:
                values.setdefault(k, []).append(_to_float(k, v))
            except TypeError as e:
                raise TypeError(f"{e} (from worker {i})") from None
    out: dict[str, float] = {}
    for k, vs in values.items():
        o = ops.get(k, fallback)
        if o == "mean":
            out[k] = math.fsum(vs) / len(vs)
        elif o == "sum":
            out[k] = math.fsum(vs)
        elif o == "min":
            out[k] = min(vs)
        else:
            out[k] = max(vs)
    return out


def weighted_mean(values: Iterable[float], weights: Iterable[float]) -> float:
    """Mean weighted by e.g. token counts: per-token loss from per-worker means."""
    vs, ws = list(values), list(weights)
    if len(vs) != len(ws):
        raise ValueError(f"weighted_mean: {len(vs)} values but {len(ws)} weights")
    total = math.fsum(ws)
    if total <= 0:
        raise ValueError(f"weighted_mean: weights sum to {total}, need > 0")
    return math.fsum(v * w for v, w in zip(vs, ws)) / total


#: the bins of a "decade histogram" stat: ``<tag>/hist_<i>`` is the share of values in
#: [0, 1e-6), [1e-6, 1e-5), ..., [1, 10), [10, inf) for i = 0 .. len(DECADE_EDGES); TensorBoard shows
#: the bins of a step as one histogram ``<tag>/hist`` (e.g. the per-token mismatch, mfc.mismatch)
DECADE_EDGES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
_HIST_KEY = re.compile(r"(.*)/hist_(\d+)$")


def decade_label(i: int) -> str:
    """The value range of decade bin ``i``."""
    lo = 0.0 if i == 0 else DECADE_EDGES[i - 1]
    hi = DECADE_EDGES[i] if i < len(DECADE_EDGES) else math.inf
    return f"[{lo:g}, {hi:g})"


def decade_histograms(row: Mapping[str, float]) -> dict[str, list[float]]:
    """``{tag: bin shares}`` of the decade-histogram stats in ``row`` (complete ones only)."""
    found: dict[str, dict[int, float]] = {}
    for name, v in row.items():
        m = _HIST_KEY.match(name)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = v
    n = len(DECADE_EDGES) + 1
    return {tag: [bins[i] for i in range(n)] for tag, bins in found.items() if set(bins) == set(range(n))}


def _add_histograms(writer: Any, row: Mapping[str, float], step: int, wall: float) -> None:
    """Each decade histogram of ``row`` as a TensorBoard histogram (bins: the decades' upper edges)."""
    for tag, shares in decade_histograms(row).items():
        limits = [*DECADE_EDGES, 1e3]  # the last bin [10, inf) is drawn up to 1e3
        mids = [0.0, *DECADE_EDGES]
        total = sum(shares)
        if total <= 0:
            continue
        writer.add_histogram_raw(f"{tag}/hist", min=0.0, max=limits[max(i for i, c in enumerate(shares) if c > 0)],
                                 num=total, sum=sum(c * x for c, x in zip(shares, mids)),
                                 sum_squares=sum(c * x * x for c, x in zip(shares, mids)),
                                 bucket_limits=limits, bucket_counts=shares, global_step=step, walltime=wall)


class StatsLogger:
    """Per-step scalar stats to TensorBoard and a jsonl file under ``run_dir`` (and W&B, if asked)."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, jsonl: bool = True,
                 resume_step: int | None = None, wandb: Optional["WandbConfig"] = None, run_name: str = "",
                 config: Optional[Mapping[str, Any]] = None) -> None:
        """``resume_step``: the run continues after this step (a recover point), so rows of
        later steps, written by the attempt that failed, are dropped; None: a fresh run.
        ``wandb``: also log to W&B when its mode is not disabled, as run ``run_name`` (the
        default name) with ``config`` (the experiment's config) attached."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "stats.jsonl"
        self.tensorboard_dir = self.run_dir / "tensorboard"
        self._wandb = None
        if wandb is not None and wandb.enabled:  # first: a missing package fails before any file is opened
            from realflow.base.wandb_sink import WandbSink

            self._wandb = WandbSink(wandb, self.run_dir, run_name, config, resume=resume_step is not None)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge)
        self._jsonl = StepLog(self.jsonl_path, resume_step) if jsonl else None
        self._closed = False

    def log(self, step: int, stats: Mapping[str, Any], prefix: str | None = None) -> dict[str, float]:
        """Write ``stats`` for ``step``; keys get ``prefix/`` if given. Returns what was written."""
        if self._closed:
            raise RuntimeError(f"StatsLogger({self.run_dir}) is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        row: dict[str, float] = {}
        for k, v in stats.items():
            name = f"{prefix}/{k}" if prefix else str(k)
            if name in _RESERVED:
                raise ValueError(f"stat name '{name}' is reserved in stats.jsonl; rename it")
            row[name] = _to_float(name, v)
        if self._writer is not None:
            wall = time.time()
            for name, v in row.items():
                self._writer.add_scalar(name, v, global_step=step, walltime=wall)
            _add_histograms(self._writer, row, step, wall)
        if self._jsonl is not None:
            self._jsonl.write(step, row)
        if self._wandb is not None:
            self._wandb.log(step, row)
        return row

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink; ``failed`` marks the W&B run as failed."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.close(failed=failed)

    def __enter__(self) -> "StatsLogger":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)


class StepLog:
    """A jsonl file of per-step rows ``{"step": N, "time": ..., ...}``, line-buffered.

    ``resume_step``: the run continues after that step (a recover point), so rows of later
    steps, written by the attempt that failed, are dropped first; None: a fresh run.
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None) -> None:
        self.path = Path(path)
        if resume_step is not None:
            self._keep_rows_until(resume_step)
        self._f = open(self.path, "a" if resume_step is not None else "w", buffering=1)

    def _keep_rows_until(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the crash
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)

    def write(self, step: int, row: Mapping[str, Any]) -> None:
        self._f.write(json.dumps({"step": step, "time": time.time(), **row}) + "\n")

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | os.PathLike, skip_bad: bool = False) -> list[dict[str, Any]]:
    """Rows of a stats.jsonl file (tools, plots, tests).

    ``skip_bad``: drop lines that are not JSON objects (a line a killed run cut short)
    instead of raising, for tools that read a run while it runs or after it crashed."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                if skip_bad:
                    continue
                raise
            if isinstance(row, dict) or not skip_bad:
                rows.append(row)
    return rows
