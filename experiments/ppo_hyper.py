"""The PPO family's command-line keys (``ppo.*``), shared by every RL experiment.

The algorithm's knobs (clip, loss aggregation, KL, advantages, normalisation, update schedule)
are declared once, with their defaults, help texts and checks, in :mod:`mfc.ppo_config`; this
class inherits them, so each is the key ``ppo.<name>`` and reaches the interfaces as one
:class:`mfc.ppo_config.PPOConfig` (:meth:`PPOHyperConfig.actor_args`). Declared here are the keys
that are not the loss's: how responses are sampled, and the data-side choices (dynamic sampling,
the reference's EMA). An algorithm is a set of values of these keys (``experiments.algorithms``
holds the presets; docs/algorithms.md the formulas). Every value is checked where it is set, and
so is every combination that cannot work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from mfc.ppo_config import PPOConfig
from realflow.api.config_values import config_to_dict
from realflow.api.generation import check_inference_memory


@dataclass
class PPOHyperConfig(PPOConfig):
    """``ppo.*``: the knobs of :class:`mfc.ppo_config.PPOConfig`, and how responses are sampled."""

    key_prefix: ClassVar[str] = "ppo."

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
    ref_ema_eta: Optional[float] = field(default=None, metadata={"help": "ref <- eta*actor + (1-eta)*ref per step"})
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO: drop groups whose rewards are all equal and draw more prompts until the batch is full "
                "(asynchronous runs: dropped at the rollout side, never counted against staleness)"})
    dynamic_sampling_max_rounds: int = field(default=8, metadata={
        "help": "synchronous: extra rounds of drawing before the step fails with an error saying so"})
    gpu_memory_utilization: Optional[float] = field(default=None, metadata={
        "help": "the trainer's own generator (synchronous generation, held-out evaluation): fraction of the free "
                "device memory its KV cache may take, in (0, 1] (None = 0.5, beside the trainer's state; "
                "generation servers: rollout.gpu_memory_utilization)"})
    max_model_len: Optional[int] = field(default=None, metadata={
        "help": "the trainer's generator: prompt + new tokens of one sequence, the length of each KV-cache slot "
                "(None = the longest prompt + max_new_tokens rounded up to a power of two, at most the model's "
                "context; generation servers: rollout.max_model_len)"})
    enforce_eager: Optional[bool] = field(default=None, metadata={
        "help": "GPU: the trainer's generator decodes without CUDA graphs (None = false; generation servers: "
                "rollout.enforce_eager)"})
    kv_block_size: Optional[int] = field(default=None, metadata={
        "help": "tokens per KV block of the trainer's generator, a power of two (None = 16; generation servers: "
                "rollout.kv_block_size)"})
    prefix_sharing: Optional[bool] = field(default=None, metadata={
        "help": "the trainer's generator: a group's samples prefill their prompt once and share its KV blocks "
                "(None = true; generation servers: rollout.prefix_sharing)"})

    def __post_init__(self) -> None:
        """Every value is checked where it is set (a bad one fails before anything runs): the knobs
        by their declarations (:class:`mfc.ppo_config.PPOConfig`), the sampling keys here."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"ppo.{name}={getattr(self, name)!r} {why}")

        for name in ("n_samples", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "must be an integer >= 1")
        super().__post_init__()
        if not self.temperature >= 0:
            raise bad("temperature", "must be >= 0")
        if self.ref_ema_eta is not None and not 0.0 < self.ref_ema_eta <= 1.0:
            raise bad("ref_ema_eta", "must be in (0, 1] (or none: the reference stays fixed)")
        self._check_sampling(bad)
        self._check_combinations()
        check_inference_memory(0.5 if self.gpu_memory_utilization is None else self.gpu_memory_utilization,
                               self.max_model_len, prefix="ppo.")
        b = self.kv_block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1)):
            raise bad("kv_block_size", "must be a power of two (tokens per KV block; 16 is usual)")
        if self.max_model_len is not None and self.max_model_len <= self.max_new_tokens:
            raise bad("max_model_len", f"leaves no room for a prompt before ppo.max_new_tokens={self.max_new_tokens} "
                                       f"new tokens: raise it or leave it unset")

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
        """Keys that each work alone but not together, where one is a key of this class: one line
        naming both (the knobs' own combinations: ``_rules`` in :mod:`mfc.ppo_config`)."""
        if self.estimator in ("grpo", "rloo") and self.n_samples < 2 and self.reward_norm is None:
            raise self.clash("estimator", "n_samples", "it compares the responses to one prompt (n_samples >= 2)")
        if self.reward_norm is not None and self.reward_norm.needs_groups() and self.n_samples < 2:
            raise self.clash("reward_norm", "n_samples", "a group-level statistic needs >= 2 responses per prompt")
        if self.dynamic_sampling and self.n_samples < 2:
            raise self.clash("dynamic_sampling", "n_samples", "a group of one response always has equal rewards")
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(f"ppo.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} must be >= 0")

    # ---- what the interfaces get -----------------------------------------------------------------
    def knobs(self) -> PPOConfig:
        """The :class:`~mfc.ppo_config.PPOConfig` part: what the actor and critic interfaces receive."""
        return self.part(PPOConfig)

    def sampling_args(self) -> dict[str, Any]:
        """How responses are sampled: fields of the same names in ``PPOActorInterface`` (synchronous
        generation and held-out sampling) and the ``math`` agent (asynchronous rollouts)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids)}

    def actor_args(self) -> dict[str, Any]:
        """``mfc.ppo_actor.PPOActorInterface`` arguments: the knobs (as plain data: interface arguments
        travel to the workers as msgpack) and the sampling."""
        return {"max_new_tokens": self.max_new_tokens, **self.sampling_args(), "ppo": config_to_dict(self.knobs()),
                "eval_max_new_tokens": self.max_new_tokens, **self.generator_args()}

    def generator_args(self) -> dict[str, Any]:
        """The trainer's own generator (``mfc.ppo_actor.PPOActorInterface``): its KV cache and engine settings."""
        return {"gpu_memory_utilization": self.gpu_memory_utilization, "max_model_len": self.max_model_len,
                "enforce_eager": self.enforce_eager, "kv_block_size": self.kv_block_size,
                "prefix_sharing": self.prefix_sharing}

    def critic_args(self) -> dict[str, Any]:
        """``mfc.ppo_critic.PPOCriticInterface`` arguments (the same knobs as the actor's)."""
        return {"max_new_tokens": self.max_new_tokens, "ppo": config_to_dict(self.knobs())}
