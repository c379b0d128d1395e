"""What the preference-pair examples (``reward_model``, ``dpo``) share: the start checkpoint
(the arithmetic SFT start unless ``model_path`` names one, trained first if absent), the
pair files (built from arithmetic unless ``data.train_path`` names one) and their fields."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

from examples.preference import ensure_pairs
from realflow.api.experiment import BaseExperimentConfig

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


@dataclass
class PairExperimentBase(BaseExperimentConfig):
    model_path: str = field(default="", metadata={
        "help": "HF checkpoint to start from ('' = the arithmetic SFT start, trained first if absent)"})
    data: PairDataConfig = field(default_factory=PairDataConfig)
    batch_size: int = field(default=32, metadata={"help": "pairs per step (global)"})
    max_tokens_per_mb: int = field(default=4096, metadata={"help": "micro-batch token budget per worker"})

    def _start(self) -> str:
        return self.model_path or os.path.abspath(os.path.join(self.fileroot, "sft", "trial0", "checkpoints",
                                                               "default", "final"))

    def _pair_files(self) -> tuple[str, str]:
        """(train, held-out) preference jsonl."""
        d = self.data
        if d.train_path:
            return d.train_path, d.test_path or d.train_path
        name = f"pairs-d{d.difficulty}-s{d.data_seed}-n{d.n_train}-t{d.n_test}"
        out = os.path.abspath(os.path.join(self.fileroot, "data", name))
        return os.path.join(out, "train.jsonl"), os.path.join(out, "test.jsonl")

    def _planned_start_config(self) -> Optional[dict]:
        """The HF config of the SFT start ``prepare`` will train (layouts are checked before it)."""
        if self.model_path or os.path.isfile(os.path.join(self._start(), "config.json")):
            return None
        from experiments.init_model import TinyArchConfig, planned_hf_config

        return planned_hf_config(TinyArchConfig())  # main_sft's default arch

    def _prepare_pairs_and_start(self) -> None:
        d = self.data
        if not d.train_path:
            ensure_pairs(os.path.dirname(self._pair_files()[0]), d.n_train, d.n_test, d.data_seed, d.difficulty)
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
            raise RuntimeError(f"the SFT run that makes the start checkpoint {start} failed (see above)")
