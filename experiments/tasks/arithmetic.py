"""Seeded multi-digit arithmetic: a verifiable task small enough for CPU.

Why this task: the default SFT -> PPO pipeline must show a large, honest
accuracy gain in minutes on two CPU cores with a model trained from scratch.
Integer arithmetic has an exact answer (so rewards are verifiable), its
difficulty is one knob (operand length), and a mixture of operand lengths
makes a tiny model get the easy problems right and the long ones only
sometimes, which leaves room for RL after SFT.

Rows have the shape real math sets use (GSM8K style), plus two fields for
per-category accuracy (``op``, ``digits``)::

    {"id": "test-000017", "prompt": "347+285=", "answer": "632",
     "solution": "236 #### 632", "op": "+", "digits": 3}

``solution`` is the SFT target; it always ends with ``#### <answer>`` so the
same answer extraction works for data sets, SFT outputs and RL samples.
``experiments/tasks/feasibility.py`` measures how fast a tiny model learns it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

# Bump when the text a seed produces changes, so cached files are rebuilt.
GENERATOR_VERSION = 2
OPS = "+-*"


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def result(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        return self.a * self.b

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="


STYLES = ("direct", "reverse")


def solution_text(answer: str, style: str = "reverse") -> str:
    """SFT target, short because every token costs CPU.

    ``reverse`` (default): first the answer's digits least-significant first -- the
    order in which carries are computed, so each digit depends only on digits
    already written -- then the final line: ``236 #### 632``. A tiny model learns
    this many times faster than the bare answer.
    ``direct``: only the GSM8K-style final line, ``#### 632``.
    """
    if style == "direct":
        return f"#### {answer}"
    if style == "reverse":
        sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
        return f"{digits[::-1]}{sign} #### {answer}"
    raise ValueError(f"arithmetic: unknown style {style!r} (known: {', '.join(STYLES)})")


def _number(rng: random.Random, n_digits: int) -> int:
    return rng.randint(0 if n_digits == 1 else 10 ** (n_digits - 1), 10**n_digits - 1)


def sample_problem(rng: random.Random, difficulty: int, ops: str = OPS) -> Problem:
    """One problem; ``difficulty`` is the maximum operand length in digits.

    The length is drawn uniformly from 1..difficulty (short and long problems
    equally common, unlike a uniform draw over the range) and both operands of
    + and - get that length. Multiplication uses a one-digit second operand:
    long multiplication without a scratchpad is beyond a model this small.
    """
    op = ops[rng.randrange(len(ops))]
    n = rng.randint(1, difficulty)
    a = _number(rng, n)
    b = rng.randint(0, 9) if op == "*" else _number(rng, n)
    if op == "-" and b > a:  # results stay non-negative, as in school arithmetic
        a, b = b, a
    return Problem(a, op, b)


def _problem_space(difficulty: int, ops: str) -> int:
    """How many distinct prompts ``sample_problem`` can produce."""
    total = 0
    for n in range(1, difficulty + 1):
        k = 10 if n == 1 else 9 * 10 ** (n - 1)  # numbers with n digits
        total += sum({"+": k * k, "-": k * (k + 1) // 2, "*": k * 10}[op] for op in set(ops))
    return total


def draw_unseen(draw: Callable[[], Any], n: int, exclude: set[str], unique: bool,
                too_few: Callable[[], str]) -> Iterator[Any]:
    """``n`` problems from ``draw()`` whose ``prompt`` is not in ``exclude`` (nor, if ``unique``,
    drawn before); ``too_few()`` is the error once misses show the space is nearly exhausted.
    Lazy, so a caller may draw more from the same RNG between problems (shared by the tasks)."""
    seen = set(exclude)
    misses = taken = 0
    while taken < n:
        p = draw()
        if p.prompt in seen:
            misses += 1
            if misses > 100 * n + 10_000:
                raise ValueError(too_few())
            continue
        if unique:
            seen.add(p.prompt)
        taken += 1
        yield p


def _draw_rows(rng: random.Random, n: int, prefix: str, difficulty: int, ops: str, style: str,
               exclude: set[str], unique: bool) -> list[dict]:
    """``n`` rows drawn i.i.d., skipping prompts in ``exclude`` (and, if ``unique``,
    repeats). Train rows may repeat -- short problems are few, and dropping the
    repeats would skew the mix of lengths away from the test split's."""
    rows: list[dict] = []
    too_few = (lambda: f"arithmetic: cannot draw {n} {prefix} problems at difficulty={difficulty} "
               f"ops={ops!r} ({_problem_space(difficulty, ops)} distinct problems exist); "
               "lower n_test or raise difficulty")
    for p in draw_unseen(lambda: sample_problem(rng, difficulty, ops), n, exclude, unique, too_few):
        answer = str(p.result)
        rows.append({"id": f"{prefix}-{len(rows):06d}", "prompt": p.prompt, "answer": answer,
                     "solution": solution_text(answer, style), "op": p.op, "digits": len(str(p.a))})
    return rows


def generate_splits(n_train: int, n_test: int, seed: int, difficulty: int,
                    ops: str = OPS, style: str = "reverse") -> tuple[list[dict], list[dict]]:
    """Train and held-out test rows, disjoint by prompt, fully determined by the arguments.

    Test prompts are distinct and drawn first, so growing ``n_train`` never
    changes the test split; train rows never use a test prompt.
    """
    if difficulty < 1:
        raise ValueError(f"arithmetic: difficulty must be >= 1, got {difficulty}")
    if n_train < 1 or n_test < 1:
        raise ValueError(f"arithmetic: n_train and n_test must be >= 1, got {n_train}, {n_test}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"arithmetic: ops must be a non-empty subset of {OPS!r}, got {ops!r}")
    solution_text("0", style)  # rejects an unknown style before any work
    test = _draw_rows(random.Random(f"arith-test:{seed}"), n_test, "test", difficulty, ops, style,
                      set(), unique=True)
    train = _draw_rows(random.Random(f"arith-train:{seed}"), n_train, "train", difficulty, ops,
                       style, {r["prompt"] for r in test}, unique=False)
    return train, test


@dataclass(frozen=True)
class ArithmeticDataset:
    """Where ``ensure_dataset`` put the files."""
    train: str
    test: str
    manifest: str


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def ensure_dataset(out_dir: str | os.PathLike, n_train: int, n_test: int, seed: int,
                   difficulty: int, ops: str = OPS, style: str = "reverse") -> ArithmeticDataset:
    """Write ``train.jsonl`` / ``test.jsonl`` under ``out_dir`` unless the recorded
    manifest says identical files are already there (same parameters, same hashes).

    Idempotent and safe to call from every worker: files are replaced atomically
    and the content is a pure function of the arguments.
    """
    params = {"generator": "arithmetic", "version": GENERATOR_VERSION, "n_train": n_train,
              "n_test": n_test, "seed": seed, "difficulty": difficulty, "ops": ops, "style": style}
    return write_splits_once(out_dir, params, lambda: generate_splits(n_train, n_test, seed, difficulty, ops, style))


def write_splits_once(out_dir: str | os.PathLike, params: dict, make) -> ArithmeticDataset:
    """Write ``make()``'s (train, test) rows under ``out_dir`` unless its manifest records the
    same ``params`` and the files still have the recorded hashes (shared by the generated tasks)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_p, test_p, man_p = out / "train.jsonl", out / "test.jsonl", out / "manifest.json"
    paths = ArithmeticDataset(str(train_p), str(test_p), str(man_p))
    if man_p.exists() and train_p.exists() and test_p.exists():
        try:
            man = json.loads(man_p.read_text())
        except json.JSONDecodeError:
            man = {}
        if (man.get("params") == params and man.get("sha256", {}).get("train") == _sha256(train_p)
                and man.get("sha256", {}).get("test") == _sha256(test_p)):
            return paths
    train, test = make()
    _write_jsonl(train_p, train)
    _write_jsonl(test_p, test)
    manifest = {"params": params, "sha256": {"train": _sha256(train_p), "test": _sha256(test_p)}}
    tmp = man_p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, man_p)
    return paths


__all__ = ["Problem", "sample_problem", "solution_text", "generate_splits", "ensure_dataset",
           "ArithmeticDataset", "GENERATOR_VERSION", "OPS", "STYLES"]
