"""Built-in rule-based reward functions (the registry itself is :mod:`realflow.api.reward`).

Importing this module registers ``math``, ``arithmetic``, ``arithmetic_consistency``,
``format`` and ``math_with_format``; the names of the registry API are re-exported so
``from mfc.reward import compute_rewards`` keeps working. :func:`held_out_scores` is how
the SFT and actor interfaces score held-out responses.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mfc.math_reward import arithmetic_reward, has_answer_format, verify_answer
from realflow.api.reward import (REWARD_FUNCTIONS, RewardBatchResult, RewardConfig, RewardFn, RewardInput,
                                 compute_rewards, register_reward)

__all__ = ["RewardInput", "RewardFn", "REWARD_FUNCTIONS", "register_reward", "RewardConfig",
           "RewardBatchResult", "compute_rewards", "held_out_scores"]


@register_reward("math")
def math_answer_reward(sample: RewardInput, allow_last_number: bool = True, use_math_verify: bool = True,
                       correct: float = 1.0, wrong: float = 0.0) -> float:
    """``correct`` if the response's final answer equals the reference (exact, numeric,
    math-verify, sympy; see :func:`mfc.math_reward.verify_answer`), else ``wrong``."""
    r = verify_answer(sample.response, sample.answer or "", allow_last_number, use_math_verify)
    return correct if r.reward > 0 else wrong


@register_reward("arithmetic")
def arithmetic_task_reward(sample: RewardInput, strict_format: bool = False,
                           correct: float = 1.0, wrong: float = 0.0) -> float:
    """Our arithmetic task's exact check (``#### <integer>``; see :func:`arithmetic_reward`)."""
    return correct if arithmetic_reward(sample.response, sample.answer or "", strict_format).reward > 0 else wrong


@register_reward("arithmetic_consistency")
def arithmetic_consistency_reward(sample: RewardInput, consistent: float = 1.0, other: float = 0.0) -> float:
    """``consistent`` when a reversed-digit solution agrees with itself (``"621 #### 126"``:
    the digits before ``####`` are the final answer reversed), whether or not it is correct.

    A dense, answer-free signal for our arithmetic task: it rewards the copying skill the
    solution format needs, so it is learnable even by a weak model (used to test that RL
    raises a reward quickly).
    """
    head, sep, tail = sample.response.partition("####")
    a, b = head.strip(), tail.strip()
    ok = bool(sep) and a.isdigit() and b.lstrip("-").isdigit() and a == b.lstrip("-")[::-1]
    return consistent if ok else other


@register_reward("format")
def format_reward(sample: RewardInput, style: str = "any", present: float = 1.0, absent: float = 0.0) -> float:
    """``present`` if the response states an answer in ``style`` (any / gsm8k / boxed)."""
    return present if has_answer_format(sample.response, style) else absent


@register_reward("math_with_format")
def math_with_format_reward(sample: RewardInput, style: str = "any", format_bonus: float = 0.1,
                            allow_last_number: bool = False, use_math_verify: bool = True) -> float:
    """Correctness (1/0) plus ``format_bonus`` when the answer format is present; no last-number
    fallback by default, so an answer only counts when it is stated in the format."""
    ok = verify_answer(sample.response, sample.answer or "", allow_last_number, use_math_verify).reward
    return ok + (format_bonus if has_answer_format(sample.response, style) else 0.0)



def held_out_scores(responses: Sequence[str], answers: Sequence[Any], reward: str = "",
                    reward_args: Optional[dict[str, Any]] = None) -> list[float]:
    """The held-out score of each response against its row's reference.

    Why a reward name: held-out accuracy used to be the final-answer exact match of the
    math tasks, which scores every program of a code task 0. ``reward=""`` keeps that
    match (:func:`verify_answer`, no last-number fallback); any registered reward name
    scores with that reward and ``reward_args`` instead (``code-tests``: the fraction of
    test cases passed, in the sandbox), fault-isolated per response like training rewards.
    One response at a time: this runs inside a trainer process, where forking many sandboxes
    at once from a large process starved its heartbeat thread on a busy 2-core machine.
    """
    if not reward:
        return [verify_answer(r, a, allow_last_number=False).reward for r, a in zip(responses, answers)]
    cfg = RewardConfig(name=reward, args=dict(reward_args or {}))
    inputs = [RewardInput(id=f"eval/{i}", response=r, answer=None if a is None else str(a))
              for i, (r, a) in enumerate(zip(responses, answers))]
    return compute_rewards(inputs, cfg).rewards
