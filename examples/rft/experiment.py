"""``rft``: rejection-sampling fine-tuning (expert iteration) on math prompts.

    python -m realflow.apps.main experiment=rft --import examples.rft

Each step generates ``ppo.n_samples`` responses per prompt at ``ppo.temperature``, rewards
them (``reward``, default: the arithmetic final-answer check) and takes one SFT step on the
responses rewarded at least ``min_reward``. Everything but the graph and the start -- the
reward, held-out greedy accuracy and pass@1, layouts -- comes from the shipped ``grpo-math``
config, which this subclasses: a user algorithm can reuse a shipped experiment's plumbing
and replace only its graph.

The start (trained first if absent, 2 min) is a careless solver (:mod:`examples.careless`):
a ``slip_rate`` share of its demonstrated answers are near misses, so its samples disagree
and some of a prompt's ``n_samples`` are right where others slip. Keeping only the right
ones removes the slips: held-out pass@1 at temperature 1 rises towards greedy accuracy.
(The plain arithmetic SFT start samples its greedy answer nearly always: nothing to select.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from examples.careless import careless_rows
from examples.own_start import OwnStartMixin
from examples.rft.graph import ACTOR, REWARD
from experiments.ppo_math import GRPOMathConfig, PPOHyperConfig, RLDataConfig
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.experiment import DatasetSpec, ExperimentSetup, ModelSpec, OptimizerConfig, register_experiment


@register_experiment("rft")
@dataclass
class RFTConfig(OwnStartMixin, GRPOMathConfig):
    """Rejection-sampling fine-tuning (a user package: examples/rft)."""

    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="arithmetic", difficulty=2,
                                                                       n_train=8000, n_test=256))
    slip_rate: float = field(default=0.3, metadata={"help": "share of the start's demonstrated answers that slip"})
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=4, kl_coef=0.0))
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=3e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))
    min_reward: float = field(default=1.0, metadata={"help": "responses rewarded at least this are trained on"})
    max_kept_per_prompt: int = field(default=2, metadata={"help": "kept responses per prompt and step, at most"})
    batch_size: int = field(default=32, metadata={"help": "prompts per step (global)"})
    max_train_steps: Optional[int] = field(default=60, metadata={"help": "stop after this many steps"})

    _name = "rft"
    _start_name = "rft-careless"
    _sft_extra = ("eval_max_new_tokens=16",)

    def _data_tag(self) -> str:
        return f"rft-careless-v1-d{self._difficulty()}-slip{self.slip_rate:g}"

    def make_rows(self, n: int, seed: int) -> tuple[list[dict], list[dict]]:
        return careless_rows(n, seed, self._difficulty(), self.slip_rate, "rft")

    def setup(self) -> ExperimentSetup:
        from realflow.api.reward import REWARD_FUNCTIONS

        REWARD_FUNCTIONS.get(self.reward)  # an unknown reward fails here, naming the close ones
        actor, tok, train, test = self._paths()
        h = self.ppo
        gen_args: dict[str, Any] = {"n_samples": h.n_samples, "max_new_tokens": h.max_new_tokens,
                                    "temperature": h.temperature, "seed": self.seed}
        mfcs = graph_registry.get("rft")(
            self.batch_size, MicroBatchSpec(max_tokens_per_mb=self.max_tokens_per_mb), gen_args,
            {"reward": self.reward, "reward_args": dict(self.reward_args)},
            {"min_reward": self.min_reward, "max_kept_per_prompt": self.max_kept_per_prompt})
        data_args = self.data_args()
        return ExperimentSetup(
            experiment_name=self.experiment_name or self._name, trial_name=self.trial_name, mfcs=mfcs,
            models={ACTOR: ModelSpec(role=ACTOR, path=actor, tokenizer_path=tok, optimizer=self.actor_optimizer,
                                     expected_config=self.planned_actor_config()),
                    REWARD: ModelSpec(role=REWARD, path=tok, tokenizer_path=tok, backend="none")},
            dataset=DatasetSpec(format=self.dataset.format, path=train, args=data_args),
            n_workers=self.n_workers, allocation=self.allocation or self._default_allocation(),
            run_dir=self.run_dir(self._name), total_train_epochs=self.total_train_epochs,
            max_train_steps=self.max_train_steps, save_freq_steps=self.save_freq_steps,
            eval=self._eval_spec(test, data_args),
            **self.runtime_fields(),
        )
