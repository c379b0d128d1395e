"""A reward that teaches nothing, for the dynamic-sampling test (loaded with ``--import constant_reward``).

``constant`` gives every response the same score, so every group's rewards are all equal and
dynamic sampling can never fill a batch: the run must stop with the error that says so.
"""
from __future__ import annotations

from realflow.api.reward import register_reward


@register_reward("constant")
def constant_reward(sample, value: float = 0.0) -> float:
    return float(value)
