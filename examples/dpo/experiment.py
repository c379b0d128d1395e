"""``dpo``: direct preference optimisation of a policy on preference pairs.

    python -m realflow.apps.main experiment=dpo --import examples.dpo

Default (CPU, minutes): the arithmetic SFT start (``fileroot/sft/trial0``, trained first with
``main_sft``'s defaults if absent) as both policy and frozen reference, on the pairs of
:mod:`examples.preference` (correct vs near-miss worked solutions). The reference has its
own layout when ``allocation`` gives it one (e.g. ``dpo_train:d2,ref_inf:d1t2``) and
``ref_offload=true`` offloads it after each call. Held-out preference accuracy and implicit
reward margin (``eval/pref_accuracy``, ``eval/reward_margin``) are evaluated before, every
``eval_freq_steps`` and after; the held-out rows carry the reference's sums, computed by
``prepare`` with transformers.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Optional

from examples.dpo.graph import ACTOR, REF
from examples.dpo.reference import write_with_reference
from examples.pair_experiment import PairExperimentBase
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.model_options import LoRAConfig
from realflow.api.experiment import DatasetSpec, EvalSpec, ExperimentSetup, ModelSpec, OptimizerConfig, \
    register_experiment


@register_experiment("dpo")
@dataclass
class DPOConfig(PairExperimentBase):
    """DPO on preference pairs (a user package: examples/dpo)."""

    beta: float = field(default=0.1, metadata={"help": "DPO temperature: scale of the implicit reward"})
    ref_offload: bool = field(default=False, metadata={"help": "offload the reference after each call"})
    lora: LoRAConfig = field(default_factory=LoRAConfig, metadata={
        "help": "train LoRA adapters (lora.enabled=true): the reference is the frozen start with adapters off"})
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=5e-4, weight_decay=0.0, warmup_steps_proportion=0.05, lr_scheduler_type="constant"))
    total_train_epochs: int = field(default=3, metadata={"help": "passes over the pairs"})
    max_train_steps: Optional[int] = field(default=150, metadata={"help": "stop after this many steps"})
    eval_freq_steps: int = field(default=50, metadata={"help": "evaluate every N steps (0 = before and after)"})

    _name = "dpo"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta} must be > 0")

    def _scored_heldout(self) -> str:
        """Where the held-out pairs with the reference's sums go (keyed by start and file)."""
        test = self._pair_files()[1]
        key = hashlib.sha256(f"{self._start()}\0{os.path.abspath(test)}".encode()).hexdigest()[:12]
        return os.path.abspath(os.path.join(self.fileroot, "data", "dpo-reference", f"{key}.jsonl"))

    def prepare(self) -> None:
        self._prepare_pairs_and_start()
        write_with_reference(self._start(), self._pair_files()[1], self._scored_heldout())

    def setup(self) -> ExperimentSetup:
        train, scored, start = self._pair_files()[0], self._scored_heldout(), self._start()
        planned = self._planned_start_config()
        mb_spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=self.max_tokens_per_mb)
        data_args = {"max_seq_len": self.data.max_seq_len}
        return ExperimentSetup(
            experiment_name=self.experiment_name or self._name,
            trial_name=self.trial_name,
            mfcs=graph_registry.get("dpo")(self.batch_size, mb_spec, beta=self.beta, ref_offload=self.ref_offload,
                                           ref_from_actor_base=self.lora.enabled),
            models={ACTOR: ModelSpec(role=ACTOR, path=start, tokenizer_path=start, optimizer=self.optimizer,
                                     expected_config=planned, lora=self.lora),
                    **({} if self.lora.enabled else
                       {REF: ModelSpec(role=REF, path=start, tokenizer_path=start, expected_config=planned)})},
            dataset=DatasetSpec(format="preference", path=train, args=data_args),
            n_workers=self.n_workers,
            allocation=self.allocation or f"d{self.n_workers}",
            run_dir=self.run_dir(self._name),
            total_train_epochs=self.total_train_epochs,
            max_train_steps=self.max_train_steps,
            eval=EvalSpec(role=ACTOR, dataset=DatasetSpec(format="preference", path=scored, args=data_args),
                          interface_impl="dpo", interface_args={"beta": self.beta,
                                                                "max_tokens_per_mb": self.max_tokens_per_mb},
                          freq_steps=self.eval_freq_steps),
            **self.runtime_fields(),
        )
