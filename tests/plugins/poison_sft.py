"""A data row that poisons training, for the non-finite tests (loaded with ``--import poison_sft``).

``sft-poison`` is the ``sft`` experiment whose train MFC runs ``sft_poison``: the SFT
interface unchanged, except that at the train steps listed in ``poison_steps`` the loss of
every micro-batch holding the sample ``poison_id`` is multiplied by NaN, as a corrupt row or
an overflowing micro-batch would make it. Everything else -- the engine, its checks, the
workers and the master -- is the real run's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from experiments.sft import SFTConfig
from mfc.sft import SFTInterface
from realflow.api.experiment import ExperimentSetup, register_experiment
from realflow.api.interface import register_interface


@register_interface("sft_poison")
@dataclass
class PoisonedSFTInterface(SFTInterface):
    poison_id: str = ""
    poison_steps: list = field(default_factory=list)
    _steps: int = 0

    def train_step(self, model, batch, mb_spec):
        self._steps += 1
        return super().train_step(model, batch, mb_spec)

    def loss(self, outputs: Any, extra: dict):
        loss_sum, stats = super().loss(outputs, extra)
        if self._steps in self.poison_steps and self.poison_id in extra["ids"]:
            loss_sum = loss_sum * float("nan")
        return loss_sum, stats


@register_experiment("sft-poison")
@dataclass
class PoisonedSFTConfig(SFTConfig):
    poison_id: str = field(default="", metadata={"help": "the sample whose micro-batch's loss becomes NaN"})
    poison_steps: str = field(default="2", metadata={"help": "comma-separated train steps that are poisoned"})

    def setup(self) -> ExperimentSetup:
        setup = super().setup()
        args = {"poison_id": self.poison_id, "poison_steps": [int(s) for s in self.poison_steps.split(",") if s]}
        mfcs = [dataclasses.replace(m, interface_impl="sft_poison", interface_args={**m.interface_args, **args})
                if m.interface_impl == "sft" else m for m in setup.mfcs]
        return dataclasses.replace(setup, mfcs=mfcs)
