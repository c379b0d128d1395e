"""``check.*``: extra checks that ``--check`` runs before a long run (they start no worker).

Why opt-in: they cost a model build and a few generations (seconds on a tiny model, longer on a
big one), and a plain ``--check`` must stay fast.  ``check.mismatch=true`` generates a few
samples with the actor as configured and measures how far the trainer's log-probs of them are
from the generator's (:mod:`experiments.mismatch_check`), so that a precision or kernel gap is
seen before hours of training, not in its stats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MismatchCheckConfig"]


@dataclass
class MismatchCheckConfig:
    mismatch: bool = field(default=False, metadata={
        "help": "with --check: generate check.mismatch_samples responses in-process with the actor's sampling "
                "and precision and print the gap between the generator's and the trainer's log-probs"})
    mismatch_samples: int = field(default=8, metadata={
        "help": "responses check.mismatch generates (from the first prompts of the training data)"})

    def __post_init__(self) -> None:
        if isinstance(self.mismatch_samples, bool) or not isinstance(self.mismatch_samples, int) \
                or self.mismatch_samples < 1:
            raise ValueError(f"check.mismatch_samples={self.mismatch_samples!r} must be an integer >= 1")
