"""Which buffered rollouts the trainer's next step takes, so that staleness is bounded exactly.

Notation: the trainer's step ``k`` trains weights of version ``k`` on ``B`` rollouts;
``eta`` is ``max_head_offpolicyness``. A rollout admitted while the servers ran version
``w`` has every token generated at a version ``>= w``. The bound to keep is
``k - w_oldest <= eta`` for every rollout trained at step ``k``.

Two rules keep it, from exact counts only (no polled estimate):

1. Admission (the rollout controller): at server version ``v`` at most
   ``(v + eta + 1) * B`` rollouts may have been admitted in total, failed ones not
   counted (:meth:`realflow.api.rollout.RolloutSpec.admission_limit`).
2. Selection (here, in the master): let ``M_j`` be the number of admitted, not failed
   and not yet trained rollouts admitted at a version ``<= j - eta`` (buffered or
   still running). Step ``k`` may take a set ``S`` of ``B`` buffered rollouts only if,
   for every ``j`` in ``k .. k + eta - 1``, ``M_j - |S ∩ {w <= j - eta}| <= (j - k) * B``:
   whatever must be trained by step ``j`` still fits in the steps left before it.
   Taking the oldest first (by admission version) satisfies every ``j`` whenever any
   choice does; when it cannot, the step waits for the stragglers to finish.

Why rule 2 is needed and enough: for ``j >= k + eta`` rule 1 alone bounds ``M_j``
(every trained rollout was admitted at a version ``<= k <= j - eta``, so the admitted
total minus the ``(k + 1) * B`` trained leaves at most ``(j - k) * B``); for smaller
``j`` a step that trained newer rollouts while old ones were still running could leave
more old ones than later steps can take. ``j = k`` is "take every rollout whose last
chance is now". With ``eta = 0`` the set is empty and the run is synchronous on-policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["Candidate", "select_batch", "StalenessViolation", "check_bound", "outstanding_per_version"]


class StalenessViolation(RuntimeError):
    """A rollout about to be trained is older than the bound allows (a bug, never expected)."""


@dataclass(frozen=True)
class Candidate:
    """A buffered rollout as the master sees it."""

    id: str
    worker: int  # the model worker whose inbox holds it
    admit: int  # server version when it was admitted
    oldest: int  # version of its oldest generated token
    newest: int  # version of its newest generated token
    seq: int = 0  # arrival order within its worker's inbox


def outstanding_per_version(admitted: Mapping[int, int], failed: Mapping[int, int],
                            consumed: Mapping[int, int]) -> dict[int, int]:
    """Per admission version: admitted, not failed, not yet trained (running or buffered)."""
    versions = set(admitted) | set(failed) | set(consumed)
    out = {w: admitted.get(w, 0) - failed.get(w, 0) - consumed.get(w, 0) for w in versions}
    bad = {w: n for w, n in out.items() if n < 0}
    if bad:
        raise ValueError(f"rollout counts are inconsistent (negative outstanding per version: {bad})")
    return out


def select_batch(candidates: Sequence[Candidate], outstanding: Mapping[int, int], step: int, eta: int,
                 batch_size: int) -> Optional[list[Candidate]]:
    """The rollouts step ``step`` trains, oldest first, or None when it must wait (see module doc)."""
    if len(candidates) < batch_size:
        return None
    chosen = sorted(candidates, key=lambda c: (c.admit, c.oldest, c.seq, c.worker, c.id))[:batch_size]
    for j in range(step, step + eta):
        limit = j - eta
        must = sum(n for w, n in outstanding.items() if w <= limit)
        taken = sum(1 for c in chosen if c.admit <= limit)
        if must - taken > (j - step) * batch_size:
            return None
    return chosen


def check_bound(chosen: Sequence[Candidate], step: int, eta: int) -> None:
    """Raise if any chosen rollout has a token older than ``step - eta`` (the guarantee, checked)."""
    bad = [c for c in chosen if step - c.oldest > eta]
    if bad:
        c = bad[0]
        raise StalenessViolation(f"rollout {c.id} has a token of version {c.oldest}, too old to train at step "
                                 f"{step} with max_head_offpolicyness={eta} ({len(bad)} such rollouts)")
