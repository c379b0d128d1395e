"""Every knob of the PPO family, declared once: its default, its help text and its check.

Why one declaration: a knob that is a field here is the ``ppo.<name>`` key of the command line
(``experiments.ppo_hyper.PPOHyperConfig`` inherits these classes), the name a preset sets
(``experiments.algorithms``, checked against these fields), what the actor and critic
interfaces receive (one :class:`PPOConfig`, sent to the workers as plain data) and what the
loss and the advantage computation read. Adding a knob is one field here plus the code that
uses it.

The parts are nested by inheritance, not by attribute, so that the command-line keys stay flat
(``ppo.eps_clip``, not ``ppo.loss.eps_clip``) while each consumer names the part it reads:

* :class:`KLConfig`: the penalty against the reference model (in the reward or in the loss);
* :class:`LossConfig` (+ KL): the actor's loss, :func:`mfc.losses.ppo_actor_loss`;
* :class:`AdvantageConfig` (+ KL): rewards to advantages, :func:`mfc.rl_batch.compute_rl_tensors`;
* :class:`PPOConfig`: all of them, plus the update schedule and the critic's clip.

A field's ``metadata["check"]`` returns why a value is bad (or None); ``_rules`` methods check
what spans fields. Errors name the key as the user wrote it (``ppo.`` on the command line).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Optional

from mfc.kl import KL_ESTIMATORS
from mfc.losses import AGG_MODES, IS_LEVELS, policy_losses
from mfc.mismatch import CORRECTIONS
from mfc.normalization import NormConfig

__all__ = ["ESTIMATORS", "CAP_MODES", "knob", "Knobs", "KLConfig", "LossConfig", "AdvantageConfig", "PPOConfig"]

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce++")
CAP_MODES = ("truncate", "mask")
Check = Callable[[Any], Optional[str]]


# ---- declaring a knob ----------------------------------------------------------------------------


def knob(default: Any = dataclasses.MISSING, *, help: str, check: Optional[Check] = None,
         default_factory: Any = dataclasses.MISSING) -> Any:
    """A field with its help text (shown by ``--help``) and its check."""
    return field(default=default, default_factory=default_factory, metadata={"help": help, "check": check})


def one_of(choices: Iterable[str] | Callable[[], Iterable[str]], optional: bool = False) -> Check:
    """``choices`` may be a callable: a registry's names, read when the value is checked."""
    def check(v: Any) -> Optional[str]:
        known = list(choices() if callable(choices) else choices)
        if (optional and v is None) or v in known:
            return None
        return f"must be one of {', '.join(known)}" + (" (or none)" if optional else "")
    return check


def above(lo: float, optional: bool = False, below: Optional[float] = None, closed: bool = False) -> Check:
    """``v > lo`` (``v >= lo`` if ``closed``), and ``v < below`` when given."""
    def check(v: Any) -> Optional[str]:
        if optional and v is None:
            return None
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= lo if closed else v > lo)
        if ok and (below is None or v < below):
            return None
        rng = f"{'>=' if closed else '>'} {lo:g}" + (f" and < {below:g}" if below is not None else "")
        return f"must be {rng}" + (" (or none)" if optional else "")
    return check


def in_unit(v: Any) -> Optional[str]:
    return None if isinstance(v, (int, float)) and 0.0 <= v <= 1.0 else "must be in [0, 1]"


def integer_at_least_1(v: Any) -> Optional[str]:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "must be an integer >= 1"


@dataclass
class Knobs:
    """Checks every field's ``metadata["check"]``, then each class's ``_rules`` (base first)."""

    #: how the keys are named in errors: "" for a config built in code, "ppo." on the command line
    key_prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            why = check(getattr(self, f.name)) if check else None
            if why:
                raise ValueError(f"{self.key_prefix}{f.name}={getattr(self, f.name)!r} {why}")
        for cls in reversed(type(self).__mro__):
            rules = cls.__dict__.get("_rules")
            if rules is not None:
                rules(self)

    def clash(self, a: str, b: str, why: str) -> ValueError:
        """Two keys that each work alone but not together: one line naming both."""
        p = self.key_prefix
        return ValueError(f"{p}{a}={getattr(self, a)!r} and {p}{b}={getattr(self, b)!r} cannot be combined: {why}")

    def part(self, cls: type["Knobs"]) -> Any:
        """The fields of ``cls`` (a class this one inherits) as a ``cls``, e.g. the :class:`PPOConfig`
        part of the command line's config (what the interfaces receive)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls) if f.init})


# ---- the knobs -----------------------------------------------------------------------------------


@dataclass
class KLConfig(Knobs):
    """The KL penalty against the reference model."""

    kl_coef: float = knob(0.0, check=above(0.0, closed=True), help="KL penalty against the reference model (0 = no ref)")
    kl_in: str = knob("reward", check=one_of(("reward", "loss")), help=(
        "reward: a per-token penalty in the reward (AReaL) | loss: a term of the actor's loss (GRPO paper)"))
    kl_estimator: Optional[str] = knob(None, check=one_of(KL_ESTIMATORS, optional=True), help=(
        "k1 | k2 | k3 (Schulman's estimators); none = by kl_in: k1 in the reward (verl's reward-KL default "
        "'kl'), k3 in the loss (verl's low_var_kl: k1's gradient has zero mean on-policy, so as a loss term "
        "it would exert no pull toward the reference)"))
    kl_clamp: Optional[float] = knob(10.0, check=above(0.0, optional=True), help=(
        "each token's KL estimate is clamped to [-kl_clamp, kl_clamp] (verl: 10; None = off)"))
    kl_ctl: str = knob("fixed", check=one_of(("fixed", "adaptive")),
                       help="fixed | adaptive KL coefficient (kl_in=reward)")
    kl_target: float = knob(6.0, check=above(0.0), help="adaptive: target KL per sequence")
    kl_horizon: float = knob(10000.0, check=above(0.0), help=(
        "adaptive: the coefficient moves by at most 20% x (sequences in the step / kl_horizon) per step"))

    def kl_estimator_used(self) -> str:
        """The estimator in effect: ``kl_estimator``, else k3 in the loss and k1 in the reward."""
        if self.kl_estimator is not None:
            return self.kl_estimator
        return "k3" if self.kl_in == "loss" else "k1"

    def _rules(self) -> None:
        if self.kl_in == "loss" and self.kl_ctl == "adaptive":
            raise self.clash("kl_in", "kl_ctl", "the adaptive controller steers the reward's KL penalty")


@dataclass
class LossConfig(KLConfig):
    """The actor's loss (:func:`mfc.losses.ppo_actor_loss`); its KL term is used when ``kl_in=loss``."""

    eps_clip: float = knob(0.2, check=above(0.0, below=1.0),
                           help="PPO ratio clip: ratio in [1 - eps_clip, 1 + eps_clip]")
    eps_clip_high: Optional[float] = knob(None, check=above(0.0, optional=True), help=(
        "clip-higher (DAPO): the upper bound is 1 + eps_clip_high (None = eps_clip)"))
    dual_clip: Optional[float] = knob(None, check=above(1.0, optional=True),
                                      help="dual-clip constant c > 1: the loss of a negative-advantage token is at "
                                           "most -c A (None = off)")
    policy_loss: str = knob("clip", check=one_of(lambda: policy_losses.names()), help=(
        "clip (PPO's hard clip) | sapo (SAPO's soft gates (4/tau) sigmoid(tau (ratio - 1))) | a loss a "
        "user package registered (mfc.losses.register_policy_loss)"))
    sapo_tau_pos: float = knob(1.0, check=above(0.0), help="SAPO gate temperature where the advantage > 0")
    sapo_tau_neg: float = knob(1.05, check=above(0.0), help="SAPO gate temperature where the advantage <= 0")
    importance_sampling_level: str = knob("token", check=one_of(IS_LEVELS), help=(
        "token | sequence (GSPO: exp(mean token log-ratio) per sequence, clipped per sequence)"))
    loss_agg: str = knob("token-mean", check=one_of(AGG_MODES), help=(
        "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm"))
    loss_agg_norm_len: Optional[float] = knob(None, check=above(0.0, optional=True), help=(
        "seq-mean-token-sum-norm's constant normaliser (None = max_new_tokens)"))
    entropy_coef: float = knob(0.0, check=above(0.0, closed=True), help="entropy bonus")
    behav_imp_weight_cap: Optional[float] = knob(5.0, check=above(1.0, optional=True), help=(
        "decoupled PPO (asynchronous runs): cap on each token's behaviour weight pi_prox / pi_behav "
        "(None = no cap)"))
    behav_cap_mode: str = knob("truncate", check=one_of(CAP_MODES), help=(
        "decoupled PPO: a token whose behaviour weight exceeds behav_imp_weight_cap is weighted by the cap "
        "(truncate) or left out of the loss (mask)"))

    mismatch_correction: str = knob("none", check=one_of(CORRECTIONS), help=(
        "train-inference mismatch correction on rho = pi_train_old / pi_gen (docs/algorithms.md): none | tis "
        "(weight min(rho, C)) | mis (drop tokens with rho outside [1/C, C]) | icepop (drop tokens outside "
        "[icepop_low, icepop_high]) | seq-tis | seq-mis (the sequence's geometric-mean rho); synchronous runs "
        "recompute the trainer's log-probs for it"))
    mismatch_cap: float = knob(2.0, check=above(1.0, closed=True), help=(
        "C of tis / mis / seq-tis / seq-mis (verl's rollout_is_threshold: 2)"))
    icepop_low: float = knob(0.5, check=above(0.0), help="icepop: tokens with rho below this leave the loss")
    icepop_high: float = knob(5.0, check=above(0.0), help="icepop: tokens with rho above this leave the loss")

    def kl_loss_coef(self) -> float:
        """The KL term's coefficient in the loss (0 when the KL is in the reward)."""
        return self.kl_coef if self.kl_in == "loss" else 0.0

    def _rules(self) -> None:
        if not self.icepop_low < self.icepop_high:
            raise self.clash("icepop_low", "icepop_high", "the band [icepop_low, icepop_high] is empty "
                             "(icepop_low must be below icepop_high)")
        if self.policy_loss == "sapo":
            for other in ("dual_clip", "eps_clip_high"):
                if getattr(self, other) is not None:
                    raise self.clash("policy_loss", other, "SAPO's soft gate has no hard clip bound to change")


_NORM_HELP = ("normalisation (mean_level / std_level: batch | group | none; mean_leave1out; std_unbiased; std_of: "
              "centred | raw; eps; see mfc/normalization.py)")


@dataclass
class AdvantageConfig(KLConfig):
    """How rewards become advantages (the same on the actor and the critic side); its KL penalty
    is added to the rewards when ``kl_in=reward``."""

    estimator: str = knob("grpo", check=one_of(ESTIMATORS), help=(
        "gae (critic) | grpo / rloo (outcome reward per sequence) | reinforce++ (discounted return)"))
    gamma: float = knob(1.0, check=in_unit, help="discount")
    lam: float = knob(1.0, check=in_unit, help="GAE lambda")
    reward_scale: float = knob(1.0, help="rewards become clip((r + reward_bias) * reward_scale) before normalisation")
    reward_bias: float = knob(0.0, help="see reward_scale")
    reward_clip: Optional[float] = knob(None, check=above(0.0, optional=True),
                                        help="clip the scaled rewards to [-reward_clip, reward_clip] (None = off)")
    reward_norm: Optional[NormConfig] = knob(None, help=(
        "rewards' " + _NORM_HELP + "; None = the estimator's own (grpo: group mean and unbiased std, eps "
        "1e-6; rloo: group leave-one-out mean; others: none). Setting any reward_norm key replaces it"))
    adv_norm: NormConfig = knob(default_factory=lambda: NormConfig("batch", "batch"), help=(
        "advantages' " + _NORM_HELP + " (default: batch mean and unbiased std, as AReaL; the GRPO paper "
        "uses none)"))
    mask_truncated: bool = knob(False, help="overlong filtering: no loss on responses cut by max_new_tokens")
    overlong_buffer_ratio: float = knob(0.0, check=above(0.0, below=1.0, closed=True), help=(
        "DAPO soft overlong punishment: the last ratio x max_new_tokens tokens cost up to "
        "overlong_penalty reward, linearly (0 = off)"))
    overlong_penalty: float = knob(1.0, check=above(0.0, closed=True), help="the reward an answer of max_new_tokens loses")

    def reward_norm_used(self) -> NormConfig:
        """``reward_norm``, else the estimator's own (see its help)."""
        if self.reward_norm is not None:
            return self.reward_norm
        if self.estimator == "grpo":
            return NormConfig(mean_level="group", std_level="group", std_unbiased=True, eps=1e-6)
        if self.estimator == "rloo":
            return NormConfig(mean_level="group", std_level="none", mean_leave1out=True)
        return NormConfig()

    def overlong_buffer(self, max_new_tokens: int) -> int:
        """The tokens of DAPO's overlong buffer for responses of at most ``max_new_tokens``."""
        n = round(self.overlong_buffer_ratio * max_new_tokens)
        if n and n >= max_new_tokens:
            raise ValueError(f"{self.key_prefix}overlong_buffer_ratio={self.overlong_buffer_ratio} leaves no "
                             f"unpunished length below max_new_tokens={max_new_tokens}")
        return n

    def _rules(self) -> None:
        # plain data (a config rebuilt from a dict by hand, the shorthands of older code) -> NormConfig
        self.reward_norm = None if self.reward_norm is None else _norm(self.reward_norm, "reward_norm")
        self.adv_norm = _norm(self.adv_norm, "adv_norm")
        if self.overlong_buffer_ratio and self.mask_truncated:
            raise self.clash("overlong_buffer_ratio", "mask_truncated",
                             "truncated answers carry no loss, so their length penalty would never act")


def _norm(value: Any, what: str) -> NormConfig:
    """A NormConfig, its fields as a dict, or the shorthand none | batch | group (mean and
    population std at that level, eps 1e-8: how advantages were normalised before NormConfig)."""
    if isinstance(value, NormConfig):
        return value
    if isinstance(value, dict):
        return NormConfig(**value)
    if value in ("none", "batch", "group"):
        return NormConfig(mean_level=value, std_level=value, std_unbiased=False, eps=1e-8)
    raise ValueError(f"{what}={value!r}: expected a NormConfig, its fields as a dict, or none | batch | group")


@dataclass
class PPOConfig(AdvantageConfig, LossConfig):
    """Every knob of a PPO-family train step: what the actor and critic interfaces receive."""

    ppo_epochs: int = knob(1, check=integer_at_least_1, help="passes over each batch")
    n_minibatches: int = knob(2, check=integer_at_least_1, help="optimizer steps per pass")
    value_eps_clip: float = knob(0.2, check=above(0.0), help="critic value clip")
    recompute_logprobs: bool = knob(False, help=(
        "synchronous runs: the trainer recomputes the log-probs of every sampled token before it updates "
        "(an actor_inf pass): the clip is against its own old policy, the generator's log-probs weight the "
        "loss as in decoupled PPO, and the mismatch is measured on every token instead of the first "
        "mini-batch; on by itself with a mismatch_correction (asynchronous runs always have it)"))

    def recomputes(self) -> bool:
        """Whether a synchronous run adds the recompute pass (asked for, or needed by a correction)."""
        return self.recompute_logprobs or self.mismatch_correction != "none"
