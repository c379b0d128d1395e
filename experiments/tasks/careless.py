"""A careless copy of a task's SFT data: the start whose samples disagree, so RL has something to learn.

A start trained on clean demonstrations of ``worked_arithmetic`` answers the same way at
temperature 1 as greedily (held-out pass@1 ~0.80, its greedy accuracy), so most GRPO groups
are all right or all wrong and the reward curve stays flat. A *careless* start is trained on
the same rows, but a ``slip_rate`` share of them end in a near-miss final answer after correct
working (``#### <near miss>``). Sampled at temperature 1 it slips about that often where its
greedy answer is right: its samples disagree, the right answer being the most likely, and RL
removes the slips -- held-out pass@1 rises towards greedy accuracy (0.55 -> ~0.80 in 100
asynchronous GRPO steps, docs/algorithms.md).

``dataset.slip_rate`` of the SFT experiment (``experiments/sft.py``) writes and trains on this
copy; the ``worked_arithmetic`` task's shipped start uses 0.3 (``experiments/tasks/registry.py``).
"""
from __future__ import annotations

import hashlib
import json
import os
import random

# Bump when the rows a (clean file, slip_rate) pair produces change, so cached copies are rebuilt.
CARELESS_VERSION = 1


def near_miss(rng: random.Random, result: int) -> int:
    """A plausible wrong answer: off by one or two in the last digit, or by ten."""
    wrong = result + rng.choice((-10, -2, -1, 1, 2, 10))
    return wrong if wrong >= 0 and wrong != result else result + 1


def careless_path(clean_train: str, slip_rate: float) -> str:
    """Where the careless copy of ``clean_train`` at ``slip_rate`` lives: beside it, named by the rate
    (``train.jsonl`` -> ``train-careless0.3.jsonl``)."""
    stem, ext = os.path.splitext(clean_train)
    return f"{stem}-careless{slip_rate:g}{ext or '.jsonl'}"


def careless_rows(rows: list[dict], slip_rate: float) -> list[dict]:
    """``rows`` with a ``slip_rate`` share (drawn with a seed fixed by the rate) ending in
    ``#### <near miss>`` in place of the final answer; the working before it, the prompt and the
    row's ``answer`` (what the reward checks) are unchanged. The seed is the one the benchmark's
    careless start drew with, so the numbers in docs/algorithms.md are those of this copy."""
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"slip_rate={slip_rate} must be in [0, 1)")
    rng = random.Random(f"bench-careless:{slip_rate}")
    out = []
    for row in rows:
        if rng.random() < slip_rate:
            working, _ = row["solution"].rsplit("#### ", 1)
            row = {**row, "solution": f"{working}#### {near_miss(rng, int(row['answer']))}"}
        out.append(row)
    return out


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def ensure_careless_copy(clean_train: str, slip_rate: float) -> str:
    """Write the careless copy of ``clean_train`` (:func:`careless_path`) unless one made from the
    same file (by hash), rate and version is already there; returns its path. Idempotent and safe
    to call from every worker: the content is a pure function of the clean file and the rate, and
    the copy and its manifest are replaced atomically."""
    out = careless_path(clean_train, slip_rate)
    man_p = f"{os.path.splitext(out)[0]}.manifest.json"
    params = {"version": CARELESS_VERSION, "slip_rate": float(slip_rate), "source_sha256": _sha256(clean_train)}
    if os.path.exists(out) and os.path.exists(man_p):
        try:
            with open(man_p) as f:
                man = json.load(f)
        except (OSError, json.JSONDecodeError):
            man = {}
        if man.get("params") == params and man.get("sha256") == _sha256(out):
            return out
    with open(clean_train) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in careless_rows(rows, slip_rate))
    os.replace(tmp, out)  # atomic: a reader never sees half a file
    tmp = f"{man_p}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"params": params, "sha256": _sha256(out)}, f, indent=1, sort_keys=True)
    os.replace(tmp, man_p)
    return out


__all__ = ["near_miss", "careless_path", "careless_rows", "ensure_careless_copy", "CARELESS_VERSION"]
