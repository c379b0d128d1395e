"""Samples and weights for the mismatch doctor: ``<run dir>/mismatch/step_<N>/``.

Why: a gap between the generator's and the trainer's log-probs is found in the step stats
(``mismatch/*``), but its cause (precision, batch shapes, the attention path, a stale or corrupt
weight copy) is only found by replaying both sides on the same tokens and the same weights.
``mismatch_dump_every=N`` makes every N-th train step of the actor write, before it updates:

* ``samples.json``: the first ``mismatch_dump_samples`` samples of the batch (token ids, prompt
  length, the behaviour log-probs of the response tokens, their weight versions, the trainer's
  log-probs when the batch has them) and the settings both sides ran with;
* ``weights/``: the trainer's weights as an HF checkpoint: the version that generated the
  batch in a synchronous run, the proximal version in an asynchronous one.

The file format (``FORMAT``) is read by :func:`load_dump` and nothing else; the doctor
(``realflow doctor mismatch RUN_DIR``) and tests that inject faults build on it.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.keys import INPUT_IDS, LOGPROBS, PROMPT_MASK, PROX_LOGPROBS, VERSIONS

__all__ = ["FORMAT", "MISMATCH_DIR", "DumpSample", "MismatchDump", "dump_dir", "dump_samples", "write_dump",
           "load_dump", "dump_steps"]

FORMAT = "realflow-mismatch-dump/1"
MISMATCH_DIR = "mismatch"
SAMPLES_FILE = "samples.json"
WEIGHTS_DIR = "weights"


@dataclass
class DumpSample:
    """One response: ``input_ids`` = prompt + response; the per-token lists cover the response."""

    id: str
    input_ids: list[int]
    prompt_len: int
    behaviour_logprobs: list[float]  # the generator's log-prob of each response token
    versions: list[int]  # the weight version that generated each response token
    trainer_logprobs: Optional[list[float]] = None  # the run's trainer-side log-probs, when the batch had them


@dataclass
class MismatchDump:
    step: int
    model: str  # the role whose weights are in weights/
    weights_version: int  # the version of the weights in weights/
    settings: dict[str, Any]  # precision of both sides, temperature, micro-batch tokens, layout, engine, ...
    samples: list[DumpSample]
    path: str = ""  # the step directory (set by load_dump)
    format: str = FORMAT

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, WEIGHTS_DIR)

    @property
    def gen_weights_path(self) -> Optional[str]:
        """The generator's own weight copy, when one was saved beside the trainer's (``gen_weights/``)."""
        p = os.path.join(self.path, "gen_weights")
        return p if os.path.isdir(p) else None


def dump_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, MISMATCH_DIR, f"step_{step}")


def dump_steps(run_dir: str) -> list[int]:
    """The steps of ``run_dir`` that have a complete dump (samples and weights), ascending."""
    root = os.path.join(run_dir, MISMATCH_DIR)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = re.fullmatch(r"step_(\d+)", name)
        if m and os.path.isfile(os.path.join(root, name, SAMPLES_FILE)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def dump_samples(batch: SequenceBatch, n: int, version: Optional[int] = None) -> list[DumpSample]:
    """``n`` responses of ``batch``: those generated wholly by ``version`` (the trainer's, whose
    weights the dump saves) first, so that the doctor compares both sides on the same weights;
    then in batch order. ``version`` also labels the tokens of a batch without per-token
    versions (a synchronous run's)."""
    every = _responses(batch, version)
    if version is not None:
        every.sort(key=lambda s: sum(v != version for v in s.versions))  # (stable: batch order otherwise)
    return every[:n]


def _responses(batch: SequenceBatch, version: Optional[int]) -> list[DumpSample]:
    out: list[DumpSample] = []
    for i, sid in enumerate(batch.ids):
        ids_l = batch.sequences(INPUT_IDS, i)
        masks = batch.sequences(PROMPT_MASK, i)
        lps = batch.sequences(LOGPROBS, i)
        vers = batch.sequences(VERSIONS, i) if VERSIONS in batch.data else None
        prox = batch.sequences(PROX_LOGPROBS, i) if PROX_LOGPROBS in batch.data else None
        for j, ids in enumerate(ids_l):
            p = int(masks[j].to(torch.int64).sum())
            L = len(ids)
            # logprob of token t (t >= p) sits at position t - 1 (see mfc.rl_batch)
            resp = slice(p - 1, L - 1)
            if vers is not None:
                v = [int(x) for x in vers[j].reshape(-1)[p - 1:L - 1].tolist()]
            else:
                v = [] if version is None else [int(version)] * (L - p)
            out.append(DumpSample(
                id=f"{sid}/{j}", input_ids=[int(x) for x in ids.tolist()], prompt_len=p,
                behaviour_logprobs=[float(x) for x in lps[j].float()[resp].tolist()], versions=v,
                trainer_logprobs=[float(x) for x in prox[j].float()[resp].tolist()] if prox is not None else None))
    return out


def write_dump(run_dir: str, dump: MismatchDump) -> str:
    """Write ``samples.json`` of ``dump`` (the caller saves ``weights/``); returns the step directory."""
    d = dump_dir(run_dir, dump.step)
    os.makedirs(d, exist_ok=True)
    rec = asdict(dump)
    rec.pop("path")
    tmp = os.path.join(d, SAMPLES_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, os.path.join(d, SAMPLES_FILE))
    return d


def load_dump(run_dir: str, step: Optional[int] = None) -> MismatchDump:
    """The dump of ``step`` (None: the last one). One-line errors say how to make a dump."""
    steps = dump_steps(run_dir)
    if not steps:
        raise FileNotFoundError(
            f"{run_dir}: no mismatch samples saved (no {MISMATCH_DIR}/step_*/{SAMPLES_FILE}); rerun with "
            f"mismatch_dump_every=N (e.g. 1 for a short run) to save samples and weights every N steps")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"{run_dir}: no mismatch samples for step {step} (saved: "
                                f"{', '.join(map(str, steps))})")
    d = dump_dir(run_dir, step)
    with open(os.path.join(d, SAMPLES_FILE)) as f:
        rec = json.load(f)
    if rec.get("format") != FORMAT:
        raise ValueError(f"{d}/{SAMPLES_FILE}: format {rec.get('format')!r}, expected {FORMAT!r}")
    samples = [DumpSample(**s) for s in rec.pop("samples")]
    dump = MismatchDump(samples=samples, path=d, **{k: v for k, v in rec.items() if k != "path"})
    if not os.path.isfile(os.path.join(dump.weights_path, "config.json")):
        raise FileNotFoundError(f"{d}: the samples are there but not the weights ({WEIGHTS_DIR}/config.json); "
                                f"the run stopped while writing them")
    return dump
