"""``reward-model``: train a Bradley-Terry reward model on preference pairs.

    python -m realflow.apps.main experiment=reward-model --import examples.reward_model

Default (CPU, minutes): the arithmetic SFT start (``fileroot/sft/trial0``, trained first with
``main_sft``'s defaults if absent) with a fresh scalar head, on locally built pairs
(:mod:`examples.preference`: correct vs near-miss worked solutions of new arithmetic
problems). Point ``model_path`` and ``data.train_path``/``data.test_path`` at an HF
checkpoint and your own ``preference`` jsonl to train something else. Held-out pair accuracy
and margin are evaluated before, every ``eval_freq_steps`` and after (``eval/pair_accuracy``,
``eval/margin``); the result is ``checkpoints/reward/final``, a token-classification
checkpoint whose score at a sequence's last token is its reward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from examples.pair_experiment import PairExperimentBase
from examples.reward_model.graph import REWARD
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.experiment import DatasetSpec, EvalSpec, ExperimentSetup, ModelSpec, OptimizerConfig, \
    register_experiment


@register_experiment("reward-model")
@dataclass
class RewardModelConfig(PairExperimentBase):
    """Bradley-Terry reward-model training on preference pairs (a user package: examples/reward_model)."""

    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=2e-3, weight_decay=0.0, warmup_steps_proportion=0.05, lr_scheduler_type="constant"))
    total_train_epochs: int = field(default=5, metadata={"help": "passes over the pairs"})
    max_train_steps: Optional[int] = field(default=300, metadata={"help": "stop after this many steps"})
    eval_freq_steps: int = field(default=100, metadata={"help": "evaluate every N steps (0 = before and after)"})

    _name = "reward-model"

    def prepare(self) -> None:
        self._prepare_pairs_and_start()

    def setup(self) -> ExperimentSetup:
        train, test = self._pair_files()
        start = self._start()
        mb_spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=self.max_tokens_per_mb)
        data_args = {"max_seq_len": self.data.max_seq_len}
        return ExperimentSetup(
            experiment_name=self.experiment_name or self._name,
            trial_name=self.trial_name,
            mfcs=graph_registry.get("reward_model")(self.batch_size, mb_spec),
            models={REWARD: ModelSpec(role=REWARD, path=start, tokenizer_path=start, optimizer=self.optimizer,
                                      backend_args={"critic": True}, expected_config=self._planned_start_config())},
            dataset=DatasetSpec(format="preference", path=train, args=data_args),
            n_workers=self.n_workers,
            allocation=self.allocation or f"d{self.n_workers}",
            run_dir=self.run_dir(self._name),
            total_train_epochs=self.total_train_epochs,
            max_train_steps=self.max_train_steps,
            eval=EvalSpec(role=REWARD, dataset=DatasetSpec(format="preference", path=test, args=data_args),
                          interface_impl="bradley_terry", interface_args={"max_tokens_per_mb": self.max_tokens_per_mb},
                          freq_steps=self.eval_freq_steps),
            **self.runtime_fields(),
        )
