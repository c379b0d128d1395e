"""The reward registry and fault-isolated batch scoring (built-in rewards live in ``mfc.reward``).

Why a registry: the reward is the part of an RL recipe users change most; a
function registered with ``@register_reward("name")`` in any imported module is
selected by name from the config (``RewardConfig(name=...)``) without touching
realflow.

Why fault isolation: rewards run on raw model output and, for user functions, on
code we have never seen. One sample whose reward raises (or returns NaN, or a
non-number) must not fail the batch: :func:`compute_rewards` catches it, logs it
ONCE per (function, sample id) with the error, and gives the sample
``fallback_reward`` (``on_error="fallback"``) or marks it skipped
(``on_error="skip"``: the caller drops it from the update).

A reward function takes one :class:`RewardInput` plus the config's ``args`` as
keyword arguments and returns a float.
"""
from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from realflow.api.registry import Registry

__all__ = ["RewardInput", "RewardFn", "REWARD_FUNCTIONS", "register_reward", "RewardConfig",
           "RewardBatchResult", "compute_rewards"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardInput:
    """One response to score: ``answer`` is the data set's reference (None if it has none)."""
    id: str
    response: str
    answer: str | None = None
    prompt: str = ""
    truncated: bool = False     # cut by max_new_tokens (no EOS)
    meta: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[..., float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: ``@register_reward("my_reward") def f(sample: RewardInput, **args) -> float``."""
    return REWARD_FUNCTIONS.register(name)


@dataclass
class RewardConfig:
    """Which registered reward to use, its keyword ``args``, and what a failing sample gets."""

    name: str = "math"
    args: dict[str, Any] = field(default_factory=dict)
    fallback_reward: float = 0.0
    on_error: str = "fallback"

    def __post_init__(self) -> None:
        if self.on_error not in ("fallback", "skip"):
            raise ValueError(f"RewardConfig.on_error must be 'fallback' or 'skip', got {self.on_error!r}")
        REWARD_FUNCTIONS.get(self.name)  # unknown names fail here, with near misses


@dataclass
class RewardBatchResult:
    """``rewards[i]`` for ``samples[i]``; ``skipped[i]`` when it failed under ``on_error='skip'``
    (its reward then is ``fallback_reward`` so the list stays numeric); ``errors``: id -> error."""
    rewards: list[float]
    skipped: list[bool]
    errors: dict[str, str]

    @property
    def n_errors(self) -> int:
        return len(self.errors)


_REPORTED: set[tuple[str, str]] = set()
_MAX_REPORTED = 100_000


def _report_once(fn_name: str, sample_id: str, error: str) -> None:
    key = (fn_name, sample_id)
    if key in _REPORTED:
        return
    if len(_REPORTED) >= _MAX_REPORTED:
        _REPORTED.clear()
    _REPORTED.add(key)
    logger.warning("reward %r failed on sample %r: %s", fn_name, sample_id, error)


def compute_rewards(samples: Sequence[RewardInput], cfg: RewardConfig | None = None,
                    fn: RewardFn | None = None) -> RewardBatchResult:
    """Score every sample with ``cfg.name`` (or the given ``fn``); never raises for a sample."""
    cfg = cfg or RewardConfig()
    name = cfg.name if fn is None else getattr(fn, "__name__", "reward")
    fn = REWARD_FUNCTIONS.get(cfg.name) if fn is None else fn
    rewards, skipped, errors = [], [], {}
    for s in samples:
        try:
            value = fn(s, **cfg.args)
            if not isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
                raise TypeError(f"returned {type(value).__name__} {value!r:.60}, not a number")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned non-finite reward {value}")
        except Exception as e:  # noqa: BLE001 -- isolating arbitrary user code is the point
            err = f"{type(e).__name__}: {e}"[:300]
            errors[s.id] = err
            _report_once(name, s.id, err)
            rewards.append(float(cfg.fallback_reward))
            skipped.append(cfg.on_error == "skip")
            continue
        rewards.append(value)
        skipped.append(False)
    return RewardBatchResult(rewards, skipped, errors)
