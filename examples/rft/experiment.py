"""``rft``: rejection-sampling fine-tuning (expert iteration) on math prompts.

    python -m realflow.apps.main experiment=rft --import examples.rft

Each step generates ``ppo.n_samples`` responses per prompt at ``ppo.temperature``, rewards
them (``reward``, default: the arithmetic final-answer check) and takes one SFT step on the
responses rewarded at least ``min_reward``. Everything but the graph -- model and data paths,
the SFT start trained first if absent, held-out greedy accuracy and pass@1 -- comes from
the shipped ``grpo-math`` config, which this subclasses: a user algorithm can reuse a
shipped experiment's plumbing and replace only its graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from examples.rft.graph import ACTOR, REWARD
from experiments.ppo_math import GRPOMathConfig, PPOHyperConfig
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.experiment import DatasetSpec, ExperimentSetup, ModelSpec, OptimizerConfig, register_experiment


@register_experiment("rft")
@dataclass
class RFTConfig(GRPOMathConfig):
    """Rejection-sampling fine-tuning (a user package: examples/rft)."""

    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=4, kl_coef=0.0))
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))
    min_reward: float = field(default=1.0, metadata={"help": "responses rewarded at least this are trained on"})
    max_kept_per_prompt: int = field(default=2, metadata={"help": "kept responses per prompt and step, at most"})
    batch_size: int = field(default=32, metadata={"help": "prompts per step (global)"})
    max_train_steps: Optional[int] = field(default=60, metadata={"help": "stop after this many steps"})

    _name = "rft"

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
        data_args: dict[str, Any] = {"max_prompt_len": self.dataset.max_prompt_len}
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
