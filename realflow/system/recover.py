"""Recover points: everything a run needs to continue as if it had never stopped.

A point lives in ``<run_dir>/recover/step<NNNNNNNN>/`` and holds one file per model worker
(``worker_<i>.pt``: its model and optimizer shards, RNG states, data position, interface
counters; written and hashed by that worker) and ``meta.json`` (the master's counters, the
run's fingerprint, and the size and BLAKE2b digest of every worker file).

Atomic: a point is assembled in a hidden temporary directory, ``meta.json`` is written last
(temp name, fsync, rename), and only then is the directory renamed to its final name, so a
crash at any moment leaves either a complete point or no point under a final name. A point
that is damaged later (a truncated file, a missing file, unreadable meta) is detected when
points are listed and skipped for the previous one, with a warning naming the file.

A point only resumes the run it came from: the fingerprint (experiment, trial, models,
data, allocation, worker count, batch size, seed) must match, else the error names the
fields that differ and how to start fresh instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

from realflow.base.logging import get_logger
from realflow.base.output_paths import ensure_inside, output_root

logger = get_logger("recover")

_POINT_RE = re.compile(r"^step(\d{8})$")
META = "meta.json"
FORMAT = 1


class RecoverError(RuntimeError):
    """A recover point cannot be used for this run; the message says why and what to do."""


@dataclass
class RecoverPoint:
    path: str
    step: int
    meta: dict[str, Any]

    def worker_file(self, index: int) -> str:
        return os.path.join(self.path, worker_file_name(index))


def worker_file_name(index: int) -> str:
    return f"worker_{int(index)}.pt"


def file_digest(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def fingerprint(setup: Any) -> dict[str, Any]:
    """What must not change between a point and the run that resumes from it."""
    models = {}
    for role, m in sorted(setup.models.items()):
        models[role] = {"path": os.path.abspath(m.path) if m.path else "", "backend": m.backend,
                        "config": _config_digest(m.path), "trained": m.optimizer is not None}
    return {
        "experiment": setup.experiment_name, "trial": setup.trial_name, "allocation": setup.allocation,
        "n_workers": setup.n_workers, "seed": setup.seed, "models": models,
        "dataset": {"format": setup.dataset.format, "path": os.path.abspath(setup.dataset.path)
                    if setup.dataset.path else ""},
        "batch_size": sorted({m.n_seqs for m in setup.mfcs}),
        "mfcs": sorted(m.name for m in setup.mfcs),
        "async": setup.rollout is not None,
    }


def _config_digest(path: str) -> str:
    cfg = os.path.join(path, "config.json") if path else ""
    try:
        with open(cfg, "rb") as f:
            return hashlib.blake2b(f.read(), digest_size=8).hexdigest()
    except OSError:
        return ""


def _diff(saved: Any, now: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for k in sorted(set(saved) | set(now)):
            out += _diff(saved.get(k), now.get(k), f"{prefix}{k}.")
        return out
    return [] if saved == now else [f"{prefix.rstrip('.')} ({saved!r} in the point, {now!r} now)"]


class RecoverPoints:
    """The recover points of one run: listing, validation, writing and pruning."""

    def __init__(self, setup: Any) -> None:
        self.setup = setup
        self.spec = setup.recover
        self.root = os.path.join(setup.run_dir, "recover")
        self._last_time = time.monotonic()

    # ---- when -------------------------------------------------------------------------------
    def due(self, step: int, total: int) -> bool:
        """Write a point after ``step``? (Never after the last one: the final checkpoint follows.)"""
        if not self.spec.writes or step >= total:
            return False
        if self.spec.freq_steps and step % self.spec.freq_steps == 0:
            return True
        return bool(self.spec.freq_seconds) and time.monotonic() - self._last_time >= self.spec.freq_seconds

    # ---- reading ----------------------------------------------------------------------------
    def points(self) -> list[RecoverPoint]:
        """Valid points, newest first; damaged ones are skipped with a warning naming the problem."""
        try:
            names = sorted((n for n in os.listdir(self.root) if _POINT_RE.match(n)), reverse=True)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            path = os.path.join(self.root, name)
            problem, meta = self._check(path)
            if problem:
                logger.warning(f"recover point {path} is damaged and is skipped: {problem}")
                continue
            out.append(RecoverPoint(path, int(meta["step"]), meta))
        return out

    def latest(self) -> Optional[RecoverPoint]:
        pts = self.points()
        return pts[0] if pts else None

    def _check(self, path: str) -> tuple[str, dict]:
        try:
            with open(os.path.join(path, META)) as f:
                meta = json.load(f)
        except FileNotFoundError:
            return f"{META} is missing", {}
        except (OSError, ValueError) as e:
            return f"{META} is unreadable ({e})", {}
        if meta.get("format") != FORMAT or "files" not in meta or "step" not in meta:
            return f"{META} is not a realflow recover point of format {FORMAT}", {}
        for name, rec in meta["files"].items():
            p = os.path.join(path, name)
            try:
                size = os.path.getsize(p)
            except OSError:
                return f"{name} is missing", {}
            if size != rec["size"]:
                return f"{name} has {size} bytes, {rec['size']} were written (truncated?)", {}
        return "", meta

    def resume_point(self) -> Optional[RecoverPoint]:
        """The point this run resumes from (None: start fresh); RecoverError if it belongs elsewhere."""
        if self.spec.mode == "off":
            return None
        point = self.latest()
        if point is None:
            return None
        diffs = _diff(point.meta.get("fingerprint", {}), fingerprint(self.setup))
        if diffs:
            raise RecoverError(
                f"recover point {point.path} was written by a different run: {'; '.join(diffs[:4])}"
                + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")
                + ". Use another trial_name (or fileroot) for a new run, or recover_mode=off to ignore "
                  "and overwrite the points")
        return point

    @staticmethod
    def verify_file(point: RecoverPoint, index: int) -> str:
        """This worker's file of ``point``, after checking its digest (RecoverError if it differs)."""
        name = worker_file_name(index)
        rec = point.meta["files"].get(name)
        path = point.worker_file(index)
        if rec is None:
            raise RecoverError(f"recover point {point.path} has no {name}")
        got = file_digest(path)
        if got != rec["digest"]:
            raise RecoverError(f"recover point {point.path}: {name} is damaged (digest {got[:16]}..., "
                               f"{rec['digest'][:16]}... was written)")
        return path

    # ---- writing ----------------------------------------------------------------------------
    def begin(self, step: int) -> str:
        """A fresh hidden directory where workers write their files for the point of ``step``."""
        ensure_inside(self.root, output_root(self.setup.run_dir), "recover point directory")
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-step{step:08d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        return tmp

    def commit(self, tmp: str, step: int, master_state: dict[str, Any], files: dict[str, dict]) -> str:
        """Write ``meta.json`` last, rename the directory to its final name, prune old points."""
        meta = {"format": FORMAT, "step": int(step), "time": time.time(), "fingerprint": fingerprint(self.setup),
                "master": master_state, "files": files}
        meta_tmp = os.path.join(tmp, META + ".tmp")
        with open(meta_tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, os.path.join(tmp, META))
        final = os.path.join(self.root, f"step{step:08d}")
        if os.path.exists(final):  # a relaunched run passing the same step again
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._last_time = time.monotonic()
        self._prune()
        return final

    def abort(self, tmp: str) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _prune(self) -> None:
        names = sorted((n for n in os.listdir(self.root) if _POINT_RE.match(n)), reverse=True)
        for name in names[self.spec.keep:]:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        for name in os.listdir(self.root):  # leftovers of attempts that died while writing
            if name.startswith(".tmp-") and not name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def clear(self) -> None:
        """Forget every point (the run finished: a new launch with this trial starts fresh)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
