"""Examples that make their own SFT start from demonstrations they generate.

Why: the habits an example's RL works on (calling a tool, answering again after
feedback, a careless solver's slips that RL or rejection sampling should remove) are
in no general-purpose start a CPU can train in minutes, so each such example writes
its demonstrations and RL problems once under ``<fileroot>/data/<tag>`` and trains a
tiny start on them with ``main_sft`` when no checkpoint is there yet -- as a user
would, through the public entry points only. Mix :class:`OwnStartMixin` in before the
shipped experiment config it builds on; say what the rows look like (:meth:`make_rows`)
and how the SFT run differs (:attr:`_sft_extra`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Optional

SFT_TIMEOUT_S = 1800


def write_jsonl(path: str, rows: list[dict]) -> None:
    """Write ``rows`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


@dataclass
class OwnStartMixin:
    """The start, data and held-out rows of an experiment config (GRPO-math family) made here.

    Mixed in first (``class C(OwnStartMixin, GRPOMathConfig)``) it replaces the config's
    paths, its ``prepare`` and its planned start; everything else stays the config's."""

    sft_steps: int = field(default=2500, metadata={"help": "steps of the SFT start (trained when absent)"})

    _start_name: ClassVar[str] = ""  # the SFT trial: <fileroot>/sft/<_start_name>/checkpoints/default/final
    _markup: ClassVar[tuple[str, ...]] = ()  # strings the tokenizer keeps whole
    _sft_extra: ClassVar[tuple[str, ...]] = ()  # main_sft overrides beyond the shared tiny arch

    def make_rows(self, n: int, seed: int) -> tuple[list[dict], list[dict]]:
        """(SFT demonstrations, RL rows) for ``n`` problems drawn with ``seed``."""
        raise NotImplementedError

    def _data_tag(self) -> str:
        """Names the generated data; change it whenever :meth:`make_rows` would write other rows."""
        raise NotImplementedError

    def _data_dir(self) -> str:
        return os.path.abspath(os.path.join(self.fileroot, "data", f"{self._data_tag()}-s{self.dataset.data_seed}"))

    def _paths(self) -> tuple[str, str, str, str]:
        actor = self.model.path or os.path.join(self.fileroot, "sft", self._start_name, "checkpoints", "default",
                                                "final")
        d = self._data_dir()
        return actor, self.model.tokenizer_path or actor, os.path.join(d, "rl_train.jsonl"), \
            os.path.join(d, "rl_test.jsonl")

    def planned_actor_config(self) -> Optional[dict]:
        return None  # the start's arch is this example's own (prepare)

    def prepare(self) -> None:
        actor, _, train, test = self._paths()
        d = self._data_dir()
        if not os.path.isfile(train):
            os.makedirs(d, exist_ok=True)
            sft, rl = self.make_rows(self.dataset.n_train, self.dataset.data_seed)
            sft_test, rl_test = self.make_rows(self.dataset.n_test, self.dataset.data_seed + 1000)
            write_jsonl(os.path.join(d, "sft_train.jsonl"), sft)
            write_jsonl(os.path.join(d, "sft_test.jsonl"), sft_test)
            write_jsonl(test, rl_test)
            write_jsonl(train, rl)  # last: its presence means the directory is complete
        if self.model.path or os.path.isfile(os.path.join(actor, "config.json")):
            return
        from experiments.tasks.tokenizer import ensure_tokenizer

        tok = ensure_tokenizer(os.path.join(d, "tokenizer"), [os.path.join(d, "sft_train.jsonl")],
                               extra_tokens=self._markup)
        cmd = [sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={self.fileroot}",
               f"trial_name={self._start_name}", f"model.tokenizer_path={tok}",
               f"dataset.train_path={os.path.join(d, 'sft_train.jsonl')}",
               f"dataset.test_path={os.path.join(d, 'sft_test.jsonl')}", "model.arch.hidden_size=64",
               "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=128", "batch_size=32",
               f"max_train_steps={self.sft_steps}", "optimizer.lr=3e-3", "total_train_epochs=20",
               *self._sft_extra, f"n_workers={self.n_workers}"]
        print(f"no SFT start at {actor}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, timeout=SFT_TIMEOUT_S).returncode != 0 or \
                not os.path.isfile(os.path.join(actor, "config.json")):
            raise RuntimeError(f"the {self._start_name} SFT run producing {actor} failed; see its output above")
