"""Layout: a (dp, tp, pp) strategy over an ordered set of model workers.

One class for one idea. The execution plan places each MFC on a layout, the
parameter-reallocation planner (``parallel.realloc``) intersects two layouts'
shards, and the model store keys its models by layout; they all mean the same
thing by it, so they share this type (an earlier ``LayoutSpec`` in ``parallel/``
duplicated it with another field name and its own checks).

Worker ``i`` of the experiment is global rank ``i`` of the model workers'
``torch.distributed`` world, so ``workers`` are also global ranks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from realflow.api.allocation import AllocationError, ParallelStrategy

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """A model laid out as ``strategy`` on ``workers`` (global ranks), in megatron's grid order.

    Worker ``workers[i]`` has tp rank ``i % tp``, dp rank ``(i // tp) % dp`` and
    pp rank ``i // (tp * dp)`` (tp is the fastest axis, then dp, then pp; the same
    order as :mod:`parallel.groups`).
    """

    workers: tuple[int, ...]
    strategy: ParallelStrategy

    def __post_init__(self) -> None:
        workers = tuple(int(w) for w in self.workers)
        object.__setattr__(self, "workers", workers)
        s = self.strategy
        if len(workers) != s.world_size:
            raise AllocationError(f"layout {s}: needs {s.world_size} workers (dp*tp*pp), got "
                                  f"{len(workers)}: {list(workers)}")
        if len(set(workers)) != len(workers) or (workers and min(workers) < 0):
            raise AllocationError(f"layout {s}: workers must be distinct and >= 0, got {list(workers)}")

    def coords(self, worker: int) -> tuple[int, int, int]:
        """(dp, tp, pp) ranks of ``worker`` in this layout (ValueError if it is not in it)."""
        i = self.workers.index(worker)
        s = self.strategy
        return (i // s.tp) % s.dp, i % s.tp, i // (s.tp * s.dp)

    def worker_at(self, dp: int, tp: int, pp: int) -> int:
        """The worker at grid coordinates (dp, tp, pp)."""
        s = self.strategy
        return self.workers[pp * s.dp * s.tp + dp * s.tp + tp]

    def dp_members(self, dp_rank: int) -> tuple[int, ...]:
        """Every worker that belongs to data-parallel rank ``dp_rank``."""
        return self._dp_members[dp_rank]

    @functools.cached_property
    def _dp_members(self) -> tuple[tuple[int, ...], ...]:  # asked per MFC call: computed once per layout
        return tuple(tuple(w for w in self.workers if self.coords(w)[0] == d) for d in range(self.strategy.dp))

    def dp_head(self, dp_rank: int) -> int:
        """The worker that holds the outputs of ``dp_rank``: tp rank 0 of the last stage."""
        return self.worker_at(dp_rank, 0, self.strategy.pp - 1)

    def dp_heads(self) -> tuple[int, ...]:
        """The output-holding worker of every dp rank, in dp order."""
        return tuple(self.dp_head(d) for d in range(self.strategy.dp))

    def ep_coords(self, worker: int) -> tuple[int, int]:
        """(ep rank, expert-dp rank) of ``worker``: expert-parallel groups are runs of ``ep``
        consecutive ranks of a stage's ``(dp, tp)`` order (megatron's expert grid, etp = 1)."""
        s = self.strategy
        i = self.workers.index(worker) % (s.dp * s.tp)
        return i % s.ep, i // s.ep

    def grid(self) -> list[list[list[int]]]:
        """``grid[pp][dp][tp]`` -> worker (the same order as ``parallel.groups``)."""
        s = self.strategy
        return [[[self.worker_at(d, t, p) for t in range(s.tp)] for d in range(s.dp)] for p in range(s.pp)]

    def short(self) -> str:
        s = self.strategy
        return f"{s}@{_workers_text(self.workers)}"

    def __str__(self) -> str:
        return self.short()


def _workers_text(workers: tuple[int, ...]) -> str:
    """``[0, 1]`` for a few workers; runs as ranges (``[0-1023]``) once the list gets long."""
    if len(workers) <= 8:
        return str(list(workers))
    runs, start = [], 0
    for i in range(1, len(workers) + 1):
        if i == len(workers) or workers[i] != workers[i - 1] + 1:
            a, b = workers[start], workers[i - 1]
            runs.append(f"{a}-{b}" if b > a else str(a))
            start = i
    return "[" + ", ".join(runs) + "]"

