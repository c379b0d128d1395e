"""The PPO family's hyper-parameters (``ppo.*`` keys), shared by every RL experiment.

Each field reaches the actor interface (``mfc.ppo_actor``) or the advantage computation
(``mfc.rl_batch.AdvantageConfig``) unchanged, so an algorithm is a set of values of these keys
(``experiments.algorithms`` holds the presets; docs/algorithms.md the formulas). Every value is
checked here, where it is set, and so is every combination that cannot work.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mfc.normalization import NormConfig

_NORM_HELP = ("normalisation (mean_level / std_level: batch | group | none; mean_leave1out; std_unbiased; eps; "
              "see mfc/normalization.py)")


@dataclass
class PPOHyperConfig:
    n_samples: int = field(default=8, metadata={"help": "responses per prompt"})
    max_new_tokens: int = field(default=16, metadata={"help": "response length cap"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={
        "help": "nucleus sampling: keep the most likely tokens up to this mass, in (0, 1] (1 = off). Top-p, top-k "
                "and min-p sample from a truncation of the policy that is trained (the loss does not see it)"})
    top_k: int = field(default=-1, metadata={"help": "keep the k most likely tokens (-1 = off)"})
    min_p: float = field(default=0.0, metadata={
        "help": "keep tokens whose probability is >= min_p x the most likely one's, after temperature, in [0, 1] "
                "(0 = off)"})
    stop: list[str] = field(default_factory=list, metadata={
        "help": "stop strings: a response ends after the token that completes one (kept in the response; a JSON "
                "list for strings with commas)"})
    stop_token_ids: list[int] = field(default_factory=list, metadata={
        "help": "token ids that end a response, besides the tokenizer's eos"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each batch"})
    n_minibatches: int = field(default=2, metadata={"help": "optimizer steps per pass"})
    eps_clip: float = field(default=0.2, metadata={"help": "PPO ratio clip: ratio in [1 - eps_clip, 1 + eps_clip]"})
    eps_clip_high: Optional[float] = field(default=None, metadata={
        "help": "clip-higher (DAPO): the upper bound is 1 + eps_clip_high (None = eps_clip)"})
    dual_clip: Optional[float] = field(default=None, metadata={"help": "dual-clip constant c (None = off)"})
    policy_loss: str = field(default="clip", metadata={
        "help": "clip (PPO's hard clip) | sapo (SAPO's soft gates (4/tau) sigmoid(tau (ratio - 1))) | a loss a "
                "user package registered (mfc.losses.register_policy_loss)"})
    sapo_tau_pos: float = field(default=1.0, metadata={"help": "SAPO gate temperature where the advantage > 0"})
    sapo_tau_neg: float = field(default=1.05, metadata={"help": "SAPO gate temperature where the advantage <= 0"})
    importance_sampling_level: str = field(default="token", metadata={
        "help": "token | sequence (GSPO: exp(mean token log-ratio) per sequence, clipped per sequence)"})
    loss_agg: str = field(default="token-mean", metadata={
        "help": "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm"})
    loss_agg_norm_len: Optional[float] = field(default=None, metadata={
        "help": "seq-mean-token-sum-norm's constant normaliser (None = max_new_tokens)"})
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus"})
    kl_coef: float = field(default=0.0, metadata={"help": "KL penalty against the reference model (0 = no ref)"})
    kl_in: str = field(default="reward", metadata={
        "help": "reward: a per-token penalty in the reward (AReaL) | loss: a term of the actor's loss (GRPO paper)"})
    kl_estimator: str = field(default="k1", metadata={"help": "k1 | k2 | k3 (Schulman's estimators)"})
    kl_clamp: Optional[float] = field(default=10.0, metadata={
        "help": "each token's KL estimate is clamped to [-kl_clamp, kl_clamp] (verl: 10; None = off)"})
    kl_ctl: str = field(default="fixed", metadata={"help": "fixed | adaptive KL coefficient (kl_in=reward)"})
    kl_target: float = field(default=6.0, metadata={"help": "adaptive: target KL per sequence"})
    ref_ema_eta: Optional[float] = field(default=None, metadata={"help": "ref <- eta*actor + (1-eta)*ref per step"})
    estimator: str = field(default="grpo", metadata={
        "help": "gae (critic) | grpo / rloo (outcome reward per sequence) | reinforce++ (discounted return)"})
    gamma: float = field(default=1.0, metadata={"help": "discount"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda"})
    reward_norm: Optional[NormConfig] = field(default=None, metadata={
        "help": "rewards' " + _NORM_HELP + "; None = the estimator's own (grpo: group mean and unbiased std, eps "
                "1e-6; rloo: group leave-one-out mean; others: none). Setting any reward_norm key replaces it"})
    adv_norm: NormConfig = field(default_factory=lambda: NormConfig("batch", "batch"), metadata={
        "help": "advantages' " + _NORM_HELP + " (default: batch mean and unbiased std, as AReaL; the GRPO paper "
                "uses none)"})
    mask_truncated: bool = field(default=False, metadata={
        "help": "overlong filtering: no loss on responses cut by max_new_tokens"})
    overlong_buffer_ratio: float = field(default=0.0, metadata={
        "help": "DAPO soft overlong punishment: the last ratio x max_new_tokens tokens cost up to "
                "overlong_penalty reward, linearly (0 = off)"})
    overlong_penalty: float = field(default=1.0, metadata={"help": "the reward an answer of max_new_tokens loses"})
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO: drop groups whose rewards are all equal and draw more prompts until the batch is full "
                "(asynchronous runs: dropped at the rollout side, never counted against staleness)"})
    dynamic_sampling_max_rounds: int = field(default=8, metadata={
        "help": "synchronous: extra rounds of drawing before the step fails with an error saying so"})
    value_eps_clip: float = field(default=0.2, metadata={"help": "critic value clip"})

    def __post_init__(self) -> None:
        """Every value is checked where it is set (a bad one fails before anything runs)."""
        from mfc.kl import KL_ESTIMATORS
        from mfc.losses import AGG_MODES, IS_LEVELS, policy_losses
        from mfc.rl_batch import ESTIMATORS

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"ppo.{name}={getattr(self, name)!r} {why}")

        for name in ("n_samples", "max_new_tokens", "ppo_epochs", "n_minibatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "must be an integer >= 1")
        for name, known in (("estimator", ESTIMATORS), ("loss_agg", AGG_MODES), ("policy_loss", policy_losses.names()),
                            ("importance_sampling_level", IS_LEVELS), ("kl_estimator", KL_ESTIMATORS),
                            ("kl_in", ("reward", "loss")), ("kl_ctl", ("fixed", "adaptive"))):
            if getattr(self, name) not in known:
                raise bad(name, f"must be one of {', '.join(known)}")
        for name in ("eps_clip", "value_eps_clip", "kl_target", "sapo_tau_pos", "sapo_tau_neg"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        if not self.eps_clip < 1:
            raise bad("eps_clip", "must be < 1")
        for name in ("temperature", "kl_coef", "entropy_coef", "overlong_penalty"):
            if not getattr(self, name) >= 0:
                raise bad(name, "must be >= 0")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise bad(name, "must be in [0, 1]")
        if not 0.0 <= self.overlong_buffer_ratio < 1.0:
            raise bad("overlong_buffer_ratio", "must be in [0, 1)")
        for name in ("eps_clip_high", "loss_agg_norm_len", "kl_clamp"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise bad(name, "must be > 0 (or none)")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise bad("dual_clip", "must be > 1 (or none: off)")
        if self.ref_ema_eta is not None and not 0.0 < self.ref_ema_eta <= 1.0:
            raise bad("ref_ema_eta", "must be in (0, 1] (or none: the reference stays fixed)")
        self._check_sampling(bad)
        self._check_combinations()

    def _check_sampling(self, bad: Callable[[str, str], ValueError]) -> None:
        """The sampling keys, with the ranges the generation engine accepts (so a bad one fails here,
        at launch, not in the first rollout)."""
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1] (1 = off)")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1] (0 = off)")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")

    def _check_combinations(self) -> None:
        """Keys that each work alone but not together: one line naming both."""
        def clash(a: str, b: str, why: str) -> ValueError:
            return ValueError(f"ppo.{a}={getattr(self, a)!r} and ppo.{b}={getattr(self, b)!r} cannot be combined: {why}")

        if self.policy_loss == "sapo":
            for other in ("dual_clip", "eps_clip_high"):
                if getattr(self, other) is not None:
                    raise clash("policy_loss", other, "SAPO's soft gate has no hard clip bound to change")
        if self.estimator in ("grpo", "rloo") and self.n_samples < 2 and self.reward_norm is None:
            raise clash("estimator", "n_samples", "it compares the responses to one prompt (n_samples >= 2)")
        if self.reward_norm is not None and self.reward_norm.needs_groups() and self.n_samples < 2:
            raise clash("reward_norm", "n_samples", "a group-level statistic needs >= 2 responses per prompt")
        if self.kl_in == "loss" and self.kl_ctl == "adaptive":
            raise clash("kl_in", "kl_ctl", "the adaptive controller steers the reward's KL penalty")
        if self.dynamic_sampling and self.n_samples < 2:
            raise clash("dynamic_sampling", "n_samples", "a group of one response always has equal rewards")
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(f"ppo.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} must be >= 0")
        if self.overlong_buffer_ratio and self.mask_truncated:
            raise clash("overlong_buffer_ratio", "mask_truncated",
                        "truncated answers carry no loss, so their length penalty would never act")

    # ---- what the interfaces get -----------------------------------------------------------------
    def advantage_args(self) -> dict[str, Any]:
        """``mfc.rl_batch.AdvantageConfig`` fields."""
        out: dict[str, Any] = {
            "estimator": self.estimator, "gamma": self.gamma, "lam": self.lam, "kl_coef": self.kl_coef,
            "kl_ctl": self.kl_ctl, "kl_target": self.kl_target, "kl_estimator": self.kl_estimator,
            "kl_clamp": self.kl_clamp, "kl_in": self.kl_in, "adv_norm": dataclasses.asdict(self.adv_norm),
            "mask_truncated": self.mask_truncated, "max_new_tokens": self.max_new_tokens,
            "overlong_buffer": round(self.overlong_buffer_ratio * self.max_new_tokens),
            "overlong_penalty": self.overlong_penalty}
        if self.reward_norm is not None:
            out["reward_norm"] = dataclasses.asdict(self.reward_norm)
        return out

    def sampling_args(self) -> dict[str, Any]:
        """How responses are sampled: fields of the same names in ``PPOActorInterface`` (synchronous
        generation and held-out sampling) and the ``math`` agent (asynchronous rollouts)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids)}

    def actor_args(self) -> dict[str, Any]:
        """``mfc.ppo_actor.PPOActorInterface`` fields of the loss and the sampling."""
        return {"max_new_tokens": self.max_new_tokens, **self.sampling_args(),
                "ppo_epochs": self.ppo_epochs, "n_minibatches": self.n_minibatches, "eps_clip": self.eps_clip,
                "eps_clip_high": self.eps_clip_high, "dual_clip": self.dual_clip,
                "entropy_coef": self.entropy_coef, "loss_agg": self.loss_agg,
                "loss_agg_norm_len": self.loss_agg_norm_len,
                "importance_sampling_level": self.importance_sampling_level, "policy_loss": self.policy_loss,
                "sapo_tau_pos": self.sapo_tau_pos, "sapo_tau_neg": self.sapo_tau_neg,
                "adv": self.advantage_args(), "eval_max_new_tokens": self.max_new_tokens}
