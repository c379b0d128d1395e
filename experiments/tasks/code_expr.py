"""Seeded one-line programs from a short spec: the code RL default's task, checked by tests.

Why this task: code RL needs a reward that runs the model's program (the ``code-tests``
reward, :mod:`mfc.code_reward`, in the bubblewrap sandbox), and the CPU default must show
a real gain in minutes with a model trained from scratch. So every program shares one
skeleton that a tiny model learns in a few hundred SFT steps,
``n=int(input());print(<a>*n<+b>)``, and the spec states the rest in one of two forms:

* ``formula`` (easy): ``f(n)=3n-12:`` -> ``n=int(input());print(3*n-12)`` -- a
  translation (implicit multiplication made explicit), mostly copying.
* ``examples`` (hard): ``f(0)=-12,f(1)=-9:`` -> the same program -- the slope is
  ``f(1)-f(0)``, a subtraction across signs, the intercept is ``f(0)``.

Why buggy demonstrations: like code scraped for SFT, ``bug_rate`` (default 30%) of the
*train* rows' ``solution`` carry one typical bug -- ``no_int`` (``n=input()``: a
TypeError), ``slope`` (a off by one) or ``sign`` (the intercept's sign flipped) -- every
one failing the row's tests. The SFT model imitates them: greedy decoding mostly writes
the majority (correct) program, but roughly a quarter of its samples at temperature 1 are
buggy, and only running the program tells which. That is the room RL has here, learned
within minutes on CPU (measured with ``async-grpo-code`` at kl_coef=0: these bugs fell
from ~22% to ~2% of samples in 60 steps). The subtraction of ``examples``, partly learned by SFT, was not
improved by 100 GRPO steps at lr 1e-4, and lr 5e-4 collapsed the policy within 10 steps.
Held-out rows are always correct; ``bug`` names a row's bug ("" if none).

Rows (``answer`` is what the reward checks: a JSON list of stdin / expected stdout
test cases, the expected outputs computed here from ``a*n+b``, never by running code)::

    {"id": "test-000017", "prompt": "f(0)=-12,f(1)=-9:", "solution": "n=int(input());print(3*n-12)",
     "answer": "[{\"input\": \"4\\n\", \"output\": \"0\\n\"}, ...]", "kind": "examples",
     "a": 3, "b": -12, "bug": ""}

``solution`` is the SFT target. Test inputs are ``N_TESTS`` distinct values of ``n`` in
``2..TEST_N_MAX`` (not the spec's 0 and 1), so a program must get both constants right
to pass; one with a wrong constant passes at most one test (two lines cross once), which
the reward counts as a fraction. ``difficulty`` is the most digits of ``|b|``; the slope
``a`` is 1..9. At difficulty 2 there are 9 x 199 functions, 3582 distinct prompts over
both kinds (so RL prompts largely repeat SFT's, as in the arithmetic tasks); at
difficulty 3 a 600-step SFT did not learn ``examples`` beyond chance.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from experiments.tasks.arithmetic import ArithmeticDataset, draw_unseen, write_splits_once

# Bump when the text a seed produces changes, so cached files are rebuilt.
GENERATOR_VERSION = 1
KINDS = ("formula", "examples")
BUGS = ("no_int", "slope", "sign")
BUG_RATE = 0.3
N_TESTS = 3
TEST_N_MAX = 30
SKELETON = "n=int(input());print("


@dataclass(frozen=True)
class CodeProblem:
    """``f(n) = a*n + b`` stated as ``kind``; ``tests``: the inputs ``n`` it is checked on."""
    a: int
    b: int
    kind: str
    tests: tuple[int, ...]

    def f(self, n: int) -> int:
        return self.a * n + self.b

    @property
    def prompt(self) -> str:
        if self.kind == "formula":
            return f"f(n)={self.a}n{self.b:+d}:"
        return f"f(0)={self.f(0)},f(1)={self.f(1)}:"

    @property
    def program(self) -> str:
        """The reference (SFT target): the skeleton, then ``a*n`` and the signed intercept."""
        return f"{SKELETON}{self.a}*n{self.b:+d})"

    def buggy_program(self, bug: str) -> str:
        """The program with ``bug`` (one of ``BUGS``); it fails every test (``sign`` needs b != 0)."""
        if bug == "no_int":
            return f"n=input();print({self.a}*n{self.b:+d})"
        if bug == "slope":
            return f"{SKELETON}{self.a + 1 if self.a < 9 else self.a - 1}*n{self.b:+d})"
        if bug == "sign" and self.b != 0:
            return f"{SKELETON}{self.a}*n{-self.b:+d})"
        raise ValueError(f"code_expr: no {bug!r} bug for {self}")

    @property
    def answer(self) -> str:
        """The ``code-tests`` reference: test cases with outputs computed from ``a*n+b``."""
        return json.dumps([{"input": f"{n}\n", "output": f"{self.f(n)}\n"} for n in self.tests])


def sample_problem(rng: random.Random, difficulty: int, kinds: tuple[str, ...] = KINDS) -> CodeProblem:
    """One problem: the kind uniform over ``kinds``, ``a`` in 1..9, ``|b|`` of 1..``difficulty``
    digits (length uniform, then the value, so short intercepts are common) and either sign,
    and ``N_TESTS`` distinct test inputs in 2..``TEST_N_MAX``."""
    kind = kinds[rng.randrange(len(kinds))]
    a = rng.randint(1, 9)
    n_digits = rng.randint(1, difficulty)
    b = rng.randint(0 if n_digits == 1 else 10 ** (n_digits - 1), 10 ** n_digits - 1)
    if rng.random() < 0.5:
        b = -b
    tests = tuple(rng.sample(range(2, TEST_N_MAX + 1), N_TESTS))
    return CodeProblem(a, b, kind, tests)


def _draw_rows(rng: random.Random, n: int, prefix: str, difficulty: int, kinds: tuple[str, ...],
               exclude: set[str], unique: bool, bug_rate: float = 0.0) -> list[dict]:
    """``n`` rows drawn i.i.d., skipping prompts in ``exclude`` (and, if ``unique``, repeats);
    train rows may repeat, as in the arithmetic task, so the mix of kinds stays the test split's.
    A ``bug_rate`` fraction of the rows get a buggy ``solution`` (bug uniform over those that apply)."""
    rows: list[dict] = []
    too_few = (lambda: f"code_expr: cannot draw {n} {prefix} problems at difficulty={difficulty} "
               "(too few distinct prompts); lower n_test or raise difficulty")
    for p in draw_unseen(lambda: sample_problem(rng, difficulty, kinds), n, exclude, unique, too_few):
        bug = ""
        if rng.random() < bug_rate:
            bugs = [b for b in BUGS if b != "sign" or p.b != 0]
            bug = bugs[rng.randrange(len(bugs))]
        rows.append({"id": f"{prefix}-{len(rows):06d}", "prompt": p.prompt, "answer": p.answer,
                     "solution": p.buggy_program(bug) if bug else p.program, "kind": p.kind,
                     "a": p.a, "b": p.b, "bug": bug})
    return rows


def _check_args(n_train: int, n_test: int, difficulty: int, kinds: tuple[str, ...], bug_rate: float) -> None:
    for name, v in (("n_train", n_train), ("n_test", n_test), ("difficulty", difficulty)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"code_expr: {name} must be an integer >= 1, got {v!r}")
    if isinstance(bug_rate, bool) or not isinstance(bug_rate, (int, float)) or not 0 <= bug_rate <= 1:
        raise ValueError(f"code_expr: bug_rate must be in [0, 1], got {bug_rate!r}")
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"code_expr: kinds must be a non-empty subset of {KINDS}, got {kinds!r}")


def generate_splits(n_train: int, n_test: int, seed: int, difficulty: int = 2, kinds: tuple[str, ...] = KINDS,
                    bug_rate: float = BUG_RATE) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows, disjoint by prompt, fully determined by the arguments (test
    prompts are distinct and drawn first, so growing ``n_train`` never changes the test split).
    ``bug_rate`` applies to train rows only."""
    kinds = tuple(kinds)
    _check_args(n_train, n_test, difficulty, kinds, bug_rate)
    test = _draw_rows(random.Random(f"code-expr-test:{seed}"), n_test, "test", difficulty, kinds,
                      set(), unique=True)
    train = _draw_rows(random.Random(f"code-expr-train:{seed}"), n_train, "train", difficulty, kinds,
                       {r["prompt"] for r in test}, unique=False, bug_rate=bug_rate)
    return train, test


def ensure_dataset(out_dir: str | os.PathLike, n_train: int, n_test: int, seed: int, difficulty: int = 2,
                   kinds: tuple[str, ...] = KINDS, bug_rate: float = BUG_RATE) -> ArithmeticDataset:
    """Write ``train.jsonl`` / ``test.jsonl`` under ``out_dir`` unless the recorded manifest
    says identical files are already there (same parameters and generator version, same hashes)."""
    kinds = tuple(kinds)
    _check_args(n_train, n_test, difficulty, kinds, bug_rate)
    params = {"generator": "code_expr", "version": GENERATOR_VERSION, "n_train": n_train, "n_test": n_test,
              "seed": seed, "difficulty": difficulty, "kinds": list(kinds), "n_tests": N_TESTS,
              "bug_rate": float(bug_rate)}
    return write_splits_once(out_dir, params,
                             lambda: generate_splits(n_train, n_test, seed, difficulty, kinds, bug_rate))


__all__ = ["CodeProblem", "sample_problem", "generate_splits", "ensure_dataset", "GENERATOR_VERSION",
           "KINDS", "BUGS", "BUG_RATE", "N_TESTS", "TEST_N_MAX", "SKELETON"]
