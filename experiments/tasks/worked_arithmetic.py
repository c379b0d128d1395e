"""Seeded worked multi-step arithmetic: a verifiable task with long-tailed solution lengths.

Why this task: asynchronous RL pays off when response lengths vary. With
synchronous generation every batch waits for its longest response, so a few
long samples idle the trainer and most generation slots; the plain arithmetic
task (``experiments/tasks/arithmetic.py``) has answers of nearly one length, so
it cannot show that effect or test that the system copes with it (stragglers,
staleness, mixed lengths in a batch). Here the number of steps ``k`` of a
problem is drawn from a truncated power law, ``P(k) ~ k**-alpha`` on
``1..max_steps``: most problems take one or two steps, a few take many, and the
worked solution writes one short line per step, so response lengths in tokens
have a long tail while the median stays short enough for CPU training. At the
defaults (``max_steps=12, alpha=1.5, digits=2``; 47% of problems take one step,
18% two, 13% six or more) the solutions, in tokens of the task's own tokenizer
(``experiments/tasks/tokenizer.py``), have p50 13, p90 43, p99 74, max ~90
(p99/p50 ~5.7, mean 19), and prompt + solution + BOS/EOS almost always fits the
default tiny model's 128 positions (SFT's ``max_seq_len`` drops the rare rest).

Why it leaves room for RL: each step is the same easy operation, but a chain is
right only if every step is, so a tiny model after SFT gets the short problems
mostly right and the long ones rarely -- and the reward is exact. Every step is
learnable by a small model: a line restates the operation it applies (copied
from the prompt, an induction-head pattern) and writes the running result with
its digits least-significant first (the order carries are computed in, as in
the ``reverse`` style of the plain task), so each token depends only on tokens
nearby. Subtraction never goes below zero, as in school arithmetic.

Rows are GSM8K-shaped, plus ``steps`` for per-length accuracy::

    {"id": "test-000017", "prompt": "12+7-5=", "answer": "14",
     "solution": "+7=91\\n-5=41\\n#### 14", "steps": 2}

``solution`` is the SFT target and ends with ``#### <answer>``, so the
``arithmetic`` reward (``mfc/reward.py``) checks responses unchanged.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

from experiments.tasks.arithmetic import ArithmeticDataset, _number, write_splits_once

# Bump when the text a seed produces changes, so cached files are rebuilt.
GENERATOR_VERSION = 1
MAX_STEPS = 12
DIGITS = 2
ALPHA = 1.5


@dataclass(frozen=True)
class WorkedProblem:
    """``terms[0] ops[0] terms[1] ops[1] terms[2] ...``, evaluated left to right."""
    terms: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def steps(self) -> int:
        return len(self.ops)

    def running(self) -> list[int]:
        """The result after each step."""
        out, acc = [], self.terms[0]
        for op, t in zip(self.ops, self.terms[1:]):
            acc = acc + t if op == "+" else acc - t
            out.append(acc)
        return out

    @property
    def result(self) -> int:
        return self.running()[-1]

    @property
    def prompt(self) -> str:
        return str(self.terms[0]) + "".join(f"{op}{t}" for op, t in zip(self.ops, self.terms[1:])) + "="

    def solution(self, style: str = "op") -> str:
        """One line per step -- the operation, then the running result with its digits
        reversed -- then the GSM8K final line: ``12+7-5=`` -> ``+7=91\\n-5=41\\n#### 14``."""
        run = self.running()
        accs = [self.terms[0]] + run[:-1]
        R = lambda x: str(x)[::-1]
        if style == "op":
            lines = [f"{op}{t}={R(r)}" for op, t, r in zip(self.ops, self.terms[1:], run)]
        elif style == "full":
            lines = [f"{R(a)}{op}{R(t)}={R(r)}" for a, op, t, r in zip(accs, self.ops, self.terms[1:], run)]
        elif style == "fullfwd":
            lines = [f"{a}{op}{t}={r}" for a, op, t, r in zip(accs, self.ops, self.terms[1:], run)]
        elif style == "rest":
            lines = [R(r) + "".join(f"{op}{t}" for op, t in zip(self.ops[i + 1:], self.terms[i + 2:]))
                     for i, r in enumerate(run)]
        else:
            raise ValueError(f"unknown style {style!r}")
        return "\n".join(lines + [f"#### {self.result}"])


def step_weights(max_steps: int, alpha: float) -> list[float]:
    """Unnormalized ``P(k) ~ k**-alpha`` for k = 1..max_steps."""
    return [k ** -alpha for k in range(1, max_steps + 1)]


def sample_problem(rng: random.Random, max_steps: int = MAX_STEPS, digits: int = DIGITS,
                   alpha: float = ALPHA, _cum: list[float] | None = None) -> WorkedProblem:
    """One problem: ``k`` steps from the power law, every term 1..``digits`` digits long
    (length uniform, then the value), ``+`` or ``-`` with equal odds -- but ``+`` where
    ``-`` would go below zero."""
    cum = _cum if _cum is not None else _cumulative(step_weights(max_steps, alpha))
    k = rng.choices(range(1, max_steps + 1), cum_weights=cum)[0]
    acc = _number(rng, rng.randint(1, digits))
    terms, ops = [acc], []
    for _ in range(k):
        t = _number(rng, rng.randint(1, digits))
        op = "-" if rng.random() < 0.5 and t <= acc else "+"
        acc = acc + t if op == "+" else acc - t
        terms.append(t)
        ops.append(op)
    return WorkedProblem(tuple(terms), tuple(ops))


def _cumulative(weights: list[float]) -> list[float]:
    out, s = [], 0.0
    for w in weights:
        s += w
        out.append(s)
    return out


def _draw_rows(rng: random.Random, n: int, prefix: str, max_steps: int, digits: int, alpha: float,
               exclude: set[str], unique: bool, style: str = "op") -> list[dict]:
    """``n`` rows drawn i.i.d., skipping prompts in ``exclude`` (and, if ``unique``,
    repeats). Train rows may repeat: one-step problems are few and common, and
    dropping repeats would skew the train mix of lengths away from the test split's."""
    cum = _cumulative(step_weights(max_steps, alpha))
    rows: list[dict] = []
    seen = set(exclude)
    misses = 0
    while len(rows) < n:
        p = sample_problem(rng, max_steps, digits, alpha, cum)
        if p.prompt in seen:
            misses += 1
            if misses > 100 * n + 10_000:
                raise ValueError(
                    f"worked_arithmetic: cannot draw {n} {prefix} problems at max_steps={max_steps} "
                    f"digits={digits} alpha={alpha} (too few distinct prompts); lower n_test or "
                    "raise digits/max_steps")
            continue
        if unique:
            seen.add(p.prompt)
        rows.append({"id": f"{prefix}-{len(rows):06d}", "prompt": p.prompt, "answer": str(p.result),
                     "solution": p.solution(style), "steps": p.steps})
    return rows


def _check_args(n_train: int, n_test: int, max_steps: int, digits: int, alpha: float) -> None:
    for name, v in (("n_train", n_train), ("n_test", n_test), ("max_steps", max_steps), ("digits", digits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"worked_arithmetic: {name} must be an integer >= 1, got {v!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < float("inf"):
        raise ValueError(f"worked_arithmetic: alpha must be a finite number >= 0, got {alpha!r}")


def generate_splits(n_train: int, n_test: int, seed: int, max_steps: int = MAX_STEPS,
                    digits: int = DIGITS, alpha: float = ALPHA, style: str = "op") -> tuple[list[dict], list[dict]]:
    """Train and held-out test rows, disjoint by prompt, fully determined by the arguments.

    ``max_steps`` caps the chain (the tail's length), ``alpha`` sets how fast long
    chains get rare (0 = all lengths equally common), ``digits`` is the longest term.
    Test prompts are distinct and drawn first, so growing ``n_train`` never changes
    the test split; train rows never use a test prompt.
    """
    _check_args(n_train, n_test, max_steps, digits, alpha)
    test = _draw_rows(random.Random(f"worked-arith-test:{seed}"), n_test, "test", max_steps, digits,
                      alpha, set(), unique=True, style=style)
    train = _draw_rows(random.Random(f"worked-arith-train:{seed}"), n_train, "train", max_steps, digits,
                       alpha, {r["prompt"] for r in test}, unique=False, style=style)
    return train, test


def ensure_dataset(out_dir: str | os.PathLike, n_train: int, n_test: int, seed: int,
                   max_steps: int = MAX_STEPS, digits: int = DIGITS,
                   alpha: float = ALPHA, style: str = "op") -> ArithmeticDataset:
    """Write ``train.jsonl`` / ``test.jsonl`` under ``out_dir`` unless the recorded
    manifest says identical files are already there (same parameters, same hashes).

    Idempotent and safe to call from every worker: files are replaced atomically
    and the content is a pure function of the arguments.
    """
    _check_args(n_train, n_test, max_steps, digits, alpha)
    params = {"generator": "worked_arithmetic", "version": GENERATOR_VERSION, "n_train": n_train,
              "n_test": n_test, "seed": seed, "max_steps": max_steps, "digits": digits,
              "alpha": float(alpha), "style": style}
    return write_splits_once(out_dir, params,
                             lambda: generate_splits(n_train, n_test, seed, max_steps, digits, alpha, style))


__all__ = ["WorkedProblem", "sample_problem", "step_weights", "generate_splits", "ensure_dataset",
           "GENERATOR_VERSION", "MAX_STEPS", "DIGITS", "ALPHA"]
