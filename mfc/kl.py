"""KL estimators, KL coefficient controllers and KL-shaped token rewards.

Why three estimators: the KL between the policy and the reference is estimated
from samples of the policy, token by token, with ``log_ratio = logp - ref_logp``:

* ``k1 = log_ratio`` -- unbiased, high variance, can be negative per token;
* ``k2 = log_ratio**2 / 2`` -- biased, low variance, always >= 0;
* ``k3 = exp(-log_ratio) - 1 + log_ratio`` -- unbiased and always >= 0
  (Schulman, "Approximating KL divergence", 2020).

Controllers follow the classic PPO-for-LM recipe: a fixed coefficient, or an
adaptive one that moves the coefficient towards a target KL with a proportional
error clipped to +-20% and scaled by ``n_steps / horizon``.
Controllers are plain objects with ``state_dict`` so a recover point can save them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mfc.advantages import as_seqlens

__all__ = ["KL_ESTIMATORS", "kl_estimate", "KLControlConfig", "FixedKLController",
           "AdaptiveKLController", "make_kl_controller", "shape_rewards"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1",
                clamp: float | None = None, value_clamp: float | None = None) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate; see the module docstring.

    ``clamp`` (optional) bounds the log-ratio before the estimate, ``value_clamp`` the estimate
    itself to ``[-value_clamp, value_clamp]`` (verl bounds k3 at 10): guards against a single
    token with a huge ratio dominating the penalty.
    """
    out = _kl_estimate(logprobs, ref_logprobs, estimator, clamp)
    return out if value_clamp is None else out.clamp(-value_clamp, value_clamp)


def _kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
                 clamp: float | None) -> torch.Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"kl_estimate: logprobs shape {tuple(logprobs.shape)} != "
                         f"ref_logprobs shape {tuple(ref_logprobs.shape)}")
    log_ratio = logprobs.float() - ref_logprobs.float()
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r} (known: {', '.join(KL_ESTIMATORS)})")


@dataclass
class KLControlConfig:
    """KL penalty coefficient: ``kind='fixed'`` keeps ``coef``; ``kind='adaptive'`` starts at
    ``coef`` and steers the measured KL towards ``target`` over ``horizon`` samples."""

    kind: str = "fixed"
    coef: float = 0.0
    target: float = 6.0
    horizon: float = 10000.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise ValueError(f"KLControlConfig.kind must be 'fixed' or 'adaptive', got {self.kind!r}")
        if self.coef < 0:
            raise ValueError(f"KLControlConfig.coef must be >= 0, got {self.coef}")
        if self.kind == "adaptive" and (self.target <= 0 or self.horizon <= 0):
            raise ValueError(f"adaptive KL control needs target > 0 and horizon > 0, "
                             f"got target={self.target} horizon={self.horizon}")


class FixedKLController:
    """A constant coefficient; ``update`` is a no-op so callers need not special-case it."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """``value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        super().__init__(init_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Feed the KL measured on the last batch and its size (samples); returns the new value."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value


def make_kl_controller(cfg: KLControlConfig) -> FixedKLController:
    if cfg.kind == "adaptive":
        return AdaptiveKLController(cfg.coef, cfg.target, cfg.horizon)
    return FixedKLController(cfg.coef)


def shape_rewards(scores: torch.Tensor, seqlens: Sequence[int] | torch.Tensor,
                  kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                  mask: torch.Tensor | None = None, score_clip: float | None = None,
                  score_scale: float = 1.0, score_bias: float = 0.0) -> torch.Tensor:
    """Token rewards for PPO / REINFORCE++: ``-kl_coef * kl[t]`` on every (masked) token,
    plus the sequence's outcome score on its last token.

    ``scores``: one outcome reward per sequence, transformed as
    ``clip((score + bias) * scale, -score_clip, score_clip)``. ``kl``: per-token estimate
    from :func:`kl_estimate`. ``mask`` zeroes the KL term on masked-out tokens. An empty
    sequence has no token to carry its score; that is an error.
    """
    lens = as_seqlens(seqlens)
    n = int(lens.sum())
    if scores.shape != (len(lens),):
        raise ValueError(f"shape_rewards: need one score per sequence ({len(lens)}), got {tuple(scores.shape)}")
    if (lens == 0).any():
        raise ValueError(f"shape_rewards: sequence(s) {torch.nonzero(lens == 0).flatten().tolist()} "
                         "are empty, so their score has no token to go on")
    s = (scores.detach().float() + score_bias) * score_scale
    if score_clip is not None:
        s = s.clamp(-score_clip, score_clip)
    out = torch.zeros(n, dtype=torch.float32, device=scores.device)
    if kl is not None:
        if kl.shape != (n,):
            raise ValueError(f"shape_rewards: kl has shape {tuple(kl.shape)}, expected ({n},)")
        pen = -kl_coef * kl.detach().float()
        out += pen if mask is None else pen * mask.float()
    ends = (torch.cumsum(lens, 0) - 1).to(scores.device)
    out[ends] += s
    return out
