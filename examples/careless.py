"""Demonstrations of a careless arithmetic solver: the start of examples whose RL removes slips.

A start trained on clean demonstrations answers the same way at temperature 1 as greedily,
so every sample of a group agrees and neither GRPO nor rejection sampling has anything to
learn from. A careless solver knows the answer but slips: a ``slip_rate`` share of its
demonstrated answers are near misses. Its samples then disagree, the right answer being
the most likely, and RL (or keeping only the rewarded samples) can remove the slips --
measurable as held-out pass@1 at temperature 1 rising towards greedy accuracy. The
``worked_arithmetic`` task's shipped start is careless the same way (``dataset.slip_rate``,
:mod:`experiments.tasks.careless`); these examples draw their own problems and rows.
"""
from __future__ import annotations

import random
from typing import Optional

from experiments.tasks.arithmetic import sample_problem, solution_text
from experiments.tasks.careless import near_miss  # the near-miss rule of the shipped careless start


def careless_rows(n: int, seed: int, difficulty: int, slip_rate: float, tag: str,
                  retry_feedback: Optional[str] = None) -> tuple[list[dict], list[dict]]:
    """(SFT demonstrations, RL rows) for ``n`` arithmetic problems drawn with ``seed``.

    With ``retry_feedback``, each slip is followed by a second demonstration: the conversation
    so far in the plain chat layout (``PLAIN_CHAT_TEMPLATE``: turns back to back, an answer
    ends with ``</s>``), the feedback and the problem again, answered correctly."""
    rng = random.Random(f"{tag}:{seed}")
    sft, rl = [], []
    for i in range(n):
        p = sample_problem(rng, difficulty)
        answer, good = str(p.result), solution_text(str(p.result))
        rl.append({"id": f"{tag}-{seed}-{i}", "prompt": p.prompt, "answer": answer})
        if rng.random() < slip_rate:
            wrong = str(near_miss(rng, p.result))
            bad = solution_text(wrong)
            sft.append({"prompt": p.prompt, "solution": bad, "answer": wrong})
            if retry_feedback is not None:
                sft.append({"prompt": f"{p.prompt}{bad}</s>{retry_feedback}{p.prompt}", "solution": good,
                            "answer": answer})
        else:
            sft.append({"prompt": p.prompt, "solution": good, "answer": answer})
    return sft, rl
