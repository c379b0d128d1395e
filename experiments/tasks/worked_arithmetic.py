"""Seeded worked multi-step arithmetic: a verifiable task with long-tailed solution lengths.

Why this task: asynchronous RL pays off when response lengths vary. With
synchronous generation every batch waits for its longest response, so a few
long samples idle the trainer and most generation slots; the plain arithmetic
task (``experiments/tasks/arithmetic.py``) has answers of nearly one length, so
it cannot show that effect or test that the system copes with it (stragglers,
staleness, mixed lengths in a batch). Here the number of steps ``k`` of a
problem is drawn from a truncated power law, ``P(k) ~ k**-alpha`` on
``1..max_steps``, and the worked solution writes one line per step, so response
lengths in tokens have a long tail while the median stays short.

Format (``aligned``, generator version 2): each line restates the running value,
the operation and the term, then the new running value -- every number least
significant digit first, zero-padded to a fixed width::

    {"id": "test-000017", "prompt": "123-45+7=", "answer": "85",
     "solution": "3210-54=8700\\n8700+70=5800\\n#### 85", "steps": 2}

Every line then has one layout, so each output digit sits at a fixed distance
from the digits it is computed from (the restated value is a copy of the line
above, a fixed distance back); only the operation and term must be found in the
prompt. Version 1 wrote ``+7=91`` lines (``compact``: unpadded, value not
restated): a tiny model could not align digits of varying length and stayed
below 10% held-out. The first term has one digit more than the others
(``digits + 1``), which gives enough distinct short problems for a disjoint test
split. Subtraction never goes below zero, as in school arithmetic.

Defaults (``max_steps=6, digits=2, alpha=1.7``): 60% of problems take one step,
2.9% six. Held-out solutions, in tokens of the task's own tokenizer
(``experiments/tasks/tokenizer.py``), have p50 16, p90 55, p99 81, max 82 (p99/p50
5.1, mean 27); prompt + solution + BOS/EOS is at most ~112 tokens, within the
default tiny model's 128 positions. Measured with ``experiments/tasks/feasibility.py
--task worked --n-test 500 --steps 550 --micro 4`` (default tiny Qwen2, 0.57M
parameters, batch 128, AdamW lr 2e-3, warmup 50, cosine; one CPU thread, 192 s of
training, 2.6M tokens): 68% greedy exact match on 500 held-out prompts -- by steps
k=1 83%, 2 71%, 3 51%, 4 25%, 5 3%, 6 0% -- so short problems are mostly right and
long ones rarely: room for RL, with an exact reward. Learning is a sharp
transition (step 330: 10%, 440: 34%, 550: 68%), so a shorter schedule can land far
lower; at ``max_steps=9, digits=1`` the same model went 7% -> 74% -> 97% at steps
200/400/600 (too easy) but stayed at 9% with a 350-step schedule.

``solution`` is the SFT target and ends with ``#### <answer>``, so the
``arithmetic`` reward (``mfc/reward.py``) checks responses unchanged.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

from experiments.tasks.arithmetic import ArithmeticDataset, _number, write_splits_once

# Bump when the text a seed produces changes, so cached files are rebuilt.
GENERATOR_VERSION = 2
MAX_STEPS = 6
DIGITS = 2
ALPHA = 1.7
STYLE = "aligned"


STYLES = ("aligned", "compact")


def widths(max_steps: int, digits: int) -> tuple[int, int]:
    """Digits written for a running result and for a term in ``aligned`` lines: enough
    for the largest value a chain can reach (first term + ``max_steps`` largest terms)."""
    return len(str(10 ** (digits + 1) - 1 + max_steps * (10 ** digits - 1))), digits


@dataclass(frozen=True)
class WorkedProblem:
    """``terms[0] ops[0] terms[1] ops[1] terms[2] ...``, evaluated left to right.
    ``width`` / ``term_width``: zero-padded digits of results / terms in ``aligned`` lines."""
    terms: tuple[int, ...]
    ops: tuple[str, ...]
    width: int = 3
    term_width: int = 1

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

    def solution(self, style: str = "aligned") -> str:
        """One line per step, then the GSM8K final line ``#### <result>``.

        ``aligned`` (default): the running value before the step, the operation, the term,
        ``=``, the running value after it -- every number least-significant digit first and
        zero-padded to a fixed width, so every line has the same layout and each digit sits
        at a fixed distance from the digits it is computed from:
        ``12+7-5=`` -> ``210+7=910\\n910-5=410\\n#### 14`` (width 3, term width 1).
        ``compact`` (generator version 1): the operation, then the unpadded reversed result:
        ``+7=91\\n-5=41\\n#### 14`` -- far harder for a tiny model (see module doc).
        """
        run = self.running()
        if style == "aligned":
            def pad(x: int, w: int) -> str:
                return str(x)[::-1].ljust(w, "0")
            accs = [self.terms[0]] + run[:-1]
            lines = [f"{pad(a, self.width)}{op}{pad(t, self.term_width)}={pad(r, self.width)}"
                     for a, op, t, r in zip(accs, self.ops, self.terms[1:], run)]
        elif style == "compact":
            lines = [f"{op}{t}={str(r)[::-1]}" for op, t, r in zip(self.ops, self.terms[1:], run)]
        else:
            raise ValueError(f"worked_arithmetic: unknown style {style!r} (known: {', '.join(STYLES)})")
        return "\n".join(lines + [f"#### {self.result}"])


def step_weights(max_steps: int, alpha: float) -> list[float]:
    """Unnormalized ``P(k) ~ k**-alpha`` for k = 1..max_steps."""
    return [k ** -alpha for k in range(1, max_steps + 1)]


def sample_problem(rng: random.Random, max_steps: int = MAX_STEPS, digits: int = DIGITS,
                   alpha: float = ALPHA, _cum: list[float] | None = None) -> WorkedProblem:
    """One problem: ``k`` steps from the power law, a first term of 0..``digits + 1`` digits
    (uniform value; it gives many distinct short problems), every later term 1..``digits``
    digits long (length uniform, then the value), ``+`` or ``-`` with equal odds -- but
    ``+`` where ``-`` would go below zero."""
    cum = _cum if _cum is not None else _cumulative(step_weights(max_steps, alpha))
    k = rng.choices(range(1, max_steps + 1), cum_weights=cum)[0]
    acc = rng.randint(0, 10 ** (digits + 1) - 1)
    terms, ops = [acc], []
    for _ in range(k):
        t = _number(rng, rng.randint(1, digits))
        op = "-" if rng.random() < 0.5 and t <= acc else "+"
        acc = acc + t if op == "+" else acc - t
        terms.append(t)
        ops.append(op)
    return WorkedProblem(tuple(terms), tuple(ops), *widths(max_steps, digits))


def _cumulative(weights: list[float]) -> list[float]:
    out, s = [], 0.0
    for w in weights:
        s += w
        out.append(s)
    return out


def _draw_rows(rng: random.Random, n: int, prefix: str, max_steps: int, digits: int, alpha: float,
               exclude: set[str], unique: bool, style: str) -> list[dict]:
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


def _check_args(n_train: int, n_test: int, max_steps: int, digits: int, alpha: float, style: str) -> None:
    for name, v in (("n_train", n_train), ("n_test", n_test), ("max_steps", max_steps), ("digits", digits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"worked_arithmetic: {name} must be an integer >= 1, got {v!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < float("inf"):
        raise ValueError(f"worked_arithmetic: alpha must be a finite number >= 0, got {alpha!r}")
    if style not in STYLES:
        raise ValueError(f"worked_arithmetic: unknown style {style!r} (known: {', '.join(STYLES)})")


def generate_splits(n_train: int, n_test: int, seed: int, max_steps: int = MAX_STEPS,
                    digits: int = DIGITS, alpha: float = ALPHA, style: str = STYLE) -> tuple[list[dict], list[dict]]:
    """Train and held-out test rows, disjoint by prompt, fully determined by the arguments.

    ``max_steps`` caps the chain (the tail's length), ``alpha`` sets how fast long
    chains get rare (0 = all lengths equally common), ``digits`` is the longest term.
    Test prompts are distinct and drawn first, so growing ``n_train`` never changes
    the test split; train rows never use a test prompt.
    """
    _check_args(n_train, n_test, max_steps, digits, alpha, style)
    test = _draw_rows(random.Random(f"worked-arith-test:{seed}"), n_test, "test", max_steps, digits,
                      alpha, set(), unique=True, style=style)
    train = _draw_rows(random.Random(f"worked-arith-train:{seed}"), n_train, "train", max_steps, digits,
                       alpha, {r["prompt"] for r in test}, unique=False, style=style)
    return train, test


def ensure_dataset(out_dir: str | os.PathLike, n_train: int, n_test: int, seed: int,
                   max_steps: int = MAX_STEPS, digits: int = DIGITS,
                   alpha: float = ALPHA, style: str = STYLE) -> ArithmeticDataset:
    """Write ``train.jsonl`` / ``test.jsonl`` under ``out_dir`` unless the recorded
    manifest says identical files are already there (same parameters, same hashes).

    Idempotent and safe to call from every worker: files are replaced atomically
    and the content is a pure function of the arguments.
    """
    _check_args(n_train, n_test, max_steps, digits, alpha, style)
    params = {"generator": "worked_arithmetic", "version": GENERATOR_VERSION, "n_train": n_train,
              "n_test": n_test, "seed": seed, "max_steps": max_steps, "digits": digits,
              "alpha": float(alpha), "style": style}
    return write_splits_once(out_dir, params,
                             lambda: generate_splits(n_train, n_test, seed, max_steps, digits, alpha, style))


__all__ = ["WorkedProblem", "sample_problem", "step_weights", "widths", "generate_splits", "ensure_dataset",
           "GENERATOR_VERSION", "MAX_STEPS", "DIGITS", "ALPHA", "STYLE", "STYLES"]
