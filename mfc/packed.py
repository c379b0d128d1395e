"""Small vectorised helpers for packed (concatenated variable-length) sequences."""
from __future__ import annotations

import torch


def next_token_targets(ids: torch.Tensor, seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets for next-token prediction over a packed batch.

    Position ``t`` predicts ``ids[t + 1]``; the last position of every sequence has
    no target inside its own sequence, so ``valid`` is False there (its target is
    set to 0 to stay a valid index).
    """
    targets = torch.roll(ids, -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    ends = torch.cumsum(torch.tensor(seqlens, dtype=torch.long), 0) - 1
    valid[ends] = False
    targets = torch.where(valid, targets, torch.zeros_like(targets))
    return targets, valid
