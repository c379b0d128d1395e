"""``reward-model``: train a Bradley-Terry reward model on preference pairs.

    python -m realflow.apps.main experiment=reward-model --import examples.reward_model

Default (CPU, minutes): the arithmetic SFT start (``fileroot/sft/trial0``, trained first with
``main_sft``'s defaults if absent) with a fresh scalar head, on locally built pairs
(:mod:`examples.preference`: correct vs near-miss worked solutions of new arithmetic
problems). Point ``model_path`` and ``data.train_path``/``data.test_path`` at an HF
checkpoint and your own ``preference`` jsonl to train something else. Held-out pair accuracy
and margin are evaluated before and after (``eval/pair_accuracy``, ``eval/margin``); the
result is ``checkpoints/reward/final``, a token-classification checkpoint whose score at
a sequence's last token is its reward.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

from examples.preference import ensure_pairs
from examples.reward_model.graph import REWARD
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.experiment import (BaseExperimentConfig, DatasetSpec, EvalSpec, ExperimentSetup, ModelSpec,
                                     OptimizerConfig, register_experiment)

SFT_TIMEOUT_S = 1800


@dataclass
class PairDataConfig:
    train_path: str = field(default="", metadata={"help": "preference jsonl ('' = build arithmetic pairs)"})
    test_path: str = field(default="", metadata={"help": "held-out preference jsonl"})
    n_train: int = field(default=8000, metadata={"help": "built training pairs"})
    n_test: int = field(default=256, metadata={"help": "built held-out pairs"})
    data_seed: int = field(default=2, metadata={"help": "seed of the built pairs (the SFT start used 0)"})
    difficulty: int = field(default=2, metadata={"help": "max operand digits of the built problems"})
    max_seq_len: int = field(default=128, metadata={"help": "longer pairs are dropped"})


@register_experiment("reward-model")
@dataclass
class RewardModelConfig(BaseExperimentConfig):
    """Bradley-Terry reward-model training on preference pairs (a user package: examples/reward_model)."""

    model_path: str = field(default="", metadata={
        "help": "HF checkpoint to start from ('' = the arithmetic SFT start, trained first if absent)"})
    data: PairDataConfig = field(default_factory=PairDataConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=2e-3, weight_decay=0.0, warmup_steps_proportion=0.05, lr_scheduler_type="constant"))
    batch_size: int = field(default=32, metadata={"help": "pairs per step (global)"})
    max_tokens_per_mb: int = field(default=4096, metadata={"help": "micro-batch token budget per worker"})
    total_train_epochs: int = field(default=5, metadata={"help": "passes over the pairs"})
    max_train_steps: Optional[int] = field(default=300, metadata={"help": "stop after this many steps"})
    eval_freq_steps: int = field(default=100, metadata={"help": "evaluate every N steps (0 = before and after)"})

    _name = "reward-model"

    def _start(self) -> str:
        return self.model_path or os.path.abspath(os.path.join(self.fileroot, "sft", "trial0", "checkpoints",
                                                               "default", "final"))

    def _pairs(self) -> tuple[str, str]:
        d = self.data
        if d.train_path:
            return d.train_path, d.test_path or d.train_path
        name = f"pairs-d{d.difficulty}-s{d.data_seed}-n{d.n_train}-t{d.n_test}"
        out = os.path.abspath(os.path.join(self.fileroot, "data", name))
        return os.path.join(out, "train.jsonl"), os.path.join(out, "test.jsonl")

    def prepare(self) -> None:
        d = self.data
        if not d.train_path:
            ensure_pairs(os.path.dirname(self._pairs()[0]), d.n_train, d.n_test, d.data_seed, d.difficulty)
        start = self._start()
        if self.model_path or os.path.isfile(os.path.join(start, "config.json")):
            return
        cmd = [sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={self.fileroot}",
               f"n_workers={self.n_workers}"]
        print(f"no SFT start at {start}: running {' '.join(cmd[1:])}", flush=True)
        try:
            ok = subprocess.run(cmd, timeout=SFT_TIMEOUT_S).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if not ok or not os.path.isfile(os.path.join(start, "config.json")):
            raise RuntimeError(f"the SFT run that makes the reward model's start {start} failed (see above)")

    def setup(self) -> ExperimentSetup:
        train, test = self._pairs()
        start = self._start()
        planned = None
        if not self.model_path and not os.path.isfile(os.path.join(start, "config.json")):
            from experiments.init_model import TinyArchConfig, planned_hf_config

            planned = planned_hf_config(TinyArchConfig())  # main_sft's default arch
        mb_spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=self.max_tokens_per_mb)
        data_args = {"max_seq_len": self.data.max_seq_len}
        return ExperimentSetup(
            experiment_name=self.experiment_name or self._name,
            trial_name=self.trial_name,
            mfcs=graph_registry.get("reward_model")(self.batch_size, mb_spec),
            models={REWARD: ModelSpec(role=REWARD, path=start, tokenizer_path=start, optimizer=self.optimizer,
                                      backend_args={"critic": True}, expected_config=planned)},
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
