"""The generated tasks the default experiments can train on, by name (``dataset.task=...``).

Why a table: SFT, sync and async RL all generate their data, train the SFT start
and pick a response-length cap for the same few tasks; one entry per task keeps
those choices together instead of spread over three configs.

* ``arithmetic`` (:mod:`experiments.tasks.arithmetic`): one operation, answers of
  ~7 tokens; the SFT default since the first session.
* ``worked_arithmetic`` (:mod:`experiments.tasks.worked_arithmetic`): chains of
  additions and subtractions written out step by step; response lengths have a
  long tail -- the task where asynchronous RL matters (the async default). Its start
  is *careless* (``dataset.slip_rate=0.3``, :mod:`experiments.tasks.careless`): 30% of
  its demonstrations end in a near-miss answer after correct working, so its samples
  disagree and RL has slips to remove (a clean start samples 80% right from the outset
  and its reward curve stays flat). Its trial name differs from the clean start's
  (``worked_arithmetic``), so a cached clean start is never taken for it.
* ``code_expr`` (:mod:`experiments.tasks.code_expr`): one-line Python programs from a
  short spec, checked by running them on test cases in the sandbox (``code-tests``
  reward); the code RL default (``async-grpo-code``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class TaskSpec:
    """A generated task: its data, the SFT run that makes its start, its answer length."""

    name: str
    data_prefix: str  # generated data lives under fileroot/data/<prefix>-d<difficulty>-s<seed>
    difficulty: int  # default of dataset.difficulty: max operand digits
    ensure_dataset: Callable[[str, int, int, int, int], Any]  # (dir, n_train, n_test, seed, difficulty)
    sft_args: tuple[str, ...]  # main_sft overrides that train this task's start checkpoint
    response_tokens: int  # a max_new_tokens that lets (almost) every correct answer finish
    sft_trial: str  # trial name of that SFT run under fileroot/sft/
    reward: str = "arithmetic"  # the registered reward that checks a response against a row's answer
    eval_reward: str = ""  # held-out score: "" = final-answer exact match, else a registered reward
    # (tokenizer dir, train files) -> writes the task's tokenizer; None: a word-level one fitted on the data
    ensure_tokenizer: Optional[Callable[[str, list[str]], Any]] = None


def _arith(out_dir: str, n_train: int, n_test: int, seed: int, difficulty: int) -> Any:
    from experiments.tasks.arithmetic import ensure_dataset

    return ensure_dataset(out_dir, n_train, n_test, seed, difficulty)


def _worked(out_dir: str, n_train: int, n_test: int, seed: int, difficulty: int) -> Any:
    from experiments.tasks.worked_arithmetic import ensure_dataset

    return ensure_dataset(out_dir, n_train, n_test, seed, digits=difficulty)


def _code(out_dir: str, n_train: int, n_test: int, seed: int, difficulty: int) -> Any:
    from experiments.tasks.code_expr import ensure_dataset

    return ensure_dataset(out_dir, n_train, n_test, seed, difficulty)


def _shapes(out_dir: str, n_train: int, n_test: int, seed: int, difficulty: int) -> Any:
    from experiments.tasks.shapes_count import ensure_dataset

    return ensure_dataset(out_dir, n_train, n_test, seed, difficulty)


def _shapes_tokenizer(out_dir: str, _train_files: list[str]) -> Any:
    from experiments.tasks.shapes_count import ensure_tokenizer

    return ensure_tokenizer(out_dir)


TASKS: dict[str, TaskSpec] = {
    "arithmetic": TaskSpec("arithmetic", "arith", 2, _arith, (), 16, "trial0"),
    "worked_arithmetic": TaskSpec(
        "worked_arithmetic", "worked", 2, _worked,
        ("dataset.task=worked_arithmetic", "max_train_steps=600", "eval_max_new_tokens=96", "dataset.slip_rate=0.3"),
        96, "worked_arithmetic_careless"),
    "code_expr": TaskSpec(
        "code_expr", "code", 2, _code,
        ("dataset.task=code_expr", "max_train_steps=400", "dataset.n_test=100"),
        16, "code_expr", reward="code-tests", eval_reward="code-tests"),
    # vision-language (experiments/tasks/shapes_count.py): count the shapes in an 84x84 image; the
    # start is a tiny Qwen2.5-VL trained from scratch on careless demonstrations (experiments/vlm.py).
    # Fewer distinct images (8k) or fewer steps (250, cosine) left it at chance: it learns to read its
    # image tokens in one jump, after ~150 steps on 16k images
    "shapes_count": TaskSpec(
        "shapes_count", "shapes", 6, _shapes,
        ("dataset.task=shapes_count", "model.arch.vision=true", "dataset.n_train=16000", "dataset.n_test=200",
         "max_train_steps=500", "total_train_epochs=4", "dataset.slip_rate=0.3"),
        8, "shapes_count_careless", ensure_tokenizer=_shapes_tokenizer),
}


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; an unknown name is an error naming the closest ones."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=3, cutoff=0.4)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"dataset.task={name!r}: unknown task{hint}; known: {', '.join(TASKS)}")
    return TASKS[name]


__all__ = ["TaskSpec", "TASKS", "get_task"]
