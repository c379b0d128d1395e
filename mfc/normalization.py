"""One normalisation, for rewards and for advantages: ``(x - mean) / (std + eps)`` at chosen levels.

Why one config for both: the PPO family differs mostly in *where* it centres and scales. GRPO
centres and scales rewards within each prompt's group; Dr. GRPO only centres them; RLOO
centres each on the mean of the *other* members of its group; LitePPO centres in the group
and scales by the batch; REINFORCE++ and PPO normalise advantages over the batch. Writing
each as ``NormConfig`` values makes them comparable and reachable by ``key=value``.

* ``mean_level`` / ``std_level``: ``batch`` (over the global batch: every data-parallel rank's
  values, summed exactly with ``dp_sum``), ``group`` (over the sequences of one prompt) or
  ``none`` (no centring / no scaling).
* ``mean_leave1out``: each value is centred on the mean of the *others* at its level (RLOO);
  a group of one then has no others and its value becomes 0.
* ``std_unbiased``: the sample std (divide by n - 1: TRL, verl and AReaL's default) or the
  population std (divide by n).
* ``std_of``: what the std at ``std_level`` is taken of. ``centred`` (default): the values minus
  their (plain, not leave-one-out) mean at ``mean_level``, as AReaL and ROLL compute LitePPO's
  group mean / batch std; ``raw``: the values themselves. The two differ only when the std's
  level is wider than the mean's (``mean_level=group std_level=batch``): the batch std of raw
  rewards also counts how far the groups' means lie apart, the centred one only the spread
  inside the groups. Elsewhere they are equal (a shift by a constant per level does not change
  the std), and both are computed from the raw values, as before.
* ``eps`` is added to the std.

Values are given per entry with the group index of each entry and a mask of which entries
count (advantages are per token: every token of a sequence carries its sequence's group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

LEVELS = ("batch", "group", "none")
STD_OF = ("centred", "raw")
DpSum = Callable[[list[float]], list[float]]


@dataclass
class NormConfig:
    """Off unless levels are named (see the module docstring)."""

    mean_level: str = "none"
    std_level: str = "none"
    mean_leave1out: bool = False
    std_unbiased: bool = True
    eps: float = 1e-5
    std_of: str = "centred"

    def __post_init__(self) -> None:
        for name in ("mean_level", "std_level"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(LEVELS)}")
        if self.std_of not in STD_OF:
            raise ValueError(f"std_of={self.std_of!r} must be one of {', '.join(STD_OF)}")
        if not self.eps >= 0:
            raise ValueError(f"eps={self.eps!r} must be >= 0")

    @property
    def is_identity(self) -> bool:
        return self.mean_level == "none" and self.std_level == "none"

    def needs_groups(self) -> bool:
        return "group" in (self.mean_level, self.std_level)


def _sums(x: torch.Tensor, m: torch.Tensor, gid: Optional[torch.Tensor], level: str,
          dp_sum: Optional[DpSum]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, sum, sum of squares) at ``level``, broadcast back to every entry."""
    if level == "batch":
        s = [float(m.sum()), float((x * m).sum()), float((x * x * m).sum())]
        if dp_sum is not None:
            s = dp_sum(s)
        return tuple(torch.full_like(x, v) for v in s)  # type: ignore[return-value]
    if gid is None or gid.shape != x.shape:
        raise ValueError("group-level normalisation needs one group index per entry")
    n_g = int(gid.max()) + 1 if gid.numel() else 0

    def per_group(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_g, dtype=torch.float64, device=x.device).index_add_(0, gid, v)[gid]

    return per_group(m), per_group(x * m), per_group(x * x * m)


def normalize(x: torch.Tensor, cfg: NormConfig, group_ids: Optional[torch.Tensor] = None,
              mask: Optional[torch.Tensor] = None, dp_sum: Optional[DpSum] = None) -> torch.Tensor:
    """``x`` normalised by ``cfg`` (see the module docstring); entries outside ``mask`` come back 0
    and do not count. ``group_ids``: the group of every entry (needed at the group level)."""
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    if m.shape != x.shape:
        raise ValueError(f"normalize: mask shape {tuple(m.shape)} != x shape {tuple(x.shape)}")
    xd = x.detach().to(torch.float64)
    md = m.to(torch.float64)
    gid = None if group_ids is None else group_ids.to(device=x.device, dtype=torch.long)
    out = xd
    if cfg.mean_level != "none":
        n, s, _ = _sums(xd, md, gid, cfg.mean_level, dp_sum)
        if cfg.mean_leave1out:  # the mean of the others; nobody else: the value itself (-> 0)
            others = n - md
            mean = torch.where(others > 0, (s - xd * md) / others.clamp(min=1), xd)
        else:
            mean = s / n.clamp(min=1)
        out = xd - mean
    if cfg.std_level != "none":
        spread = xd
        if cfg.std_of == "centred" and cfg.mean_level == "group" and cfg.std_level == "batch":
            n, s, _ = _sums(xd, md, gid, "group", dp_sum)
            spread = xd - s / n.clamp(min=1)  # within-group deviations (see the module docstring)
        n, s, ss = _sums(spread, md, gid, cfg.std_level, dp_sum)
        mu = s / n.clamp(min=1)
        dev2 = (ss - n * mu * mu).clamp(min=0)
        denom = (n - 1).clamp(min=1) if cfg.std_unbiased else n.clamp(min=1)
        std = torch.where(n > 1, (dev2 / denom).sqrt(), torch.zeros_like(dev2))
        out = out / (std + cfg.eps)
    return torch.where(m, out, torch.zeros_like(out)).to(x.dtype)
