"""The pure-data pieces of an execution plan: layouts, placements and hooks.

Everything here is a small frozen dataclass computed identically by every process
from the same :class:`~realflow.api.experiment.ExperimentSetup`, so a plan never has
to travel between processes, and two processes can compare plans with ``==``.
Hooks say *what* must happen around an MFC (move parameters, offload, reload); the
runtime decides *how* (which path, which buffers).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

from realflow.api.allocation import ParallelStrategy

__all__ = ["PlanError", "Layout", "MFCPlacement", "ParamRealloc", "Offload", "Reload", "Hook",
           "DataTransfer", "ReallocPair"]


class PlanError(ValueError):
    """The graph and allocation cannot be executed as given."""


@dataclass(frozen=True)
class Layout:
    """A model layout: a (dp, tp, pp) strategy over an ordered set of workers.

    Worker ``workers[i]`` has tp rank ``i % tp``, dp rank ``(i // tp) % dp`` and
    pp rank ``i // (tp * dp)`` (megatron's tp-dp-pp order: tp is the fastest axis).
    """

    workers: tuple[int, ...]
    strategy: ParallelStrategy

    def coords(self, worker: int) -> tuple[int, int, int]:
        """(dp, tp, pp) ranks of ``worker`` in this layout."""
        i = self.workers.index(worker)
        s = self.strategy
        return (i // s.tp) % s.dp, i % s.tp, i // (s.tp * s.dp)

    def dp_members(self, dp_rank: int) -> tuple[int, ...]:
        """Every worker that belongs to data-parallel rank ``dp_rank``."""
        return self._dp_members[dp_rank]

    @functools.cached_property
    def _dp_members(self) -> tuple[tuple[int, ...], ...]:  # asked per MFC call: computed once per layout
        return tuple(tuple(w for w in self.workers if self.coords(w)[0] == d) for d in range(self.strategy.dp))

    def dp_head(self, dp_rank: int) -> int:
        """The worker that holds the outputs of ``dp_rank``: tp rank 0 of the last stage."""
        s = self.strategy
        return self.workers[(s.pp - 1) * s.tp * s.dp + dp_rank * s.tp]

    def dp_heads(self) -> tuple[int, ...]:
        """The output-holding worker of every dp rank, in dp order."""
        return tuple(self.dp_head(d) for d in range(self.strategy.dp))

    def grid(self) -> list[list[list[int]]]:
        """``grid[pp][dp][tp]`` -> worker (the same order as ``parallel.groups``)."""
        s = self.strategy
        return [[[self.workers[p * s.dp * s.tp + d * s.tp + t] for t in range(s.tp)] for d in range(s.dp)]
                for p in range(s.pp)]

    def short(self) -> str:
        s = self.strategy
        return f"d{s.dp}t{s.tp}p{s.pp}@{list(self.workers)}"

    def __str__(self) -> str:
        return self.short()


@dataclass
class MFCPlacement:
    mfc: str
    role: str
    layout: Layout


@dataclass(frozen=True)
class ParamRealloc:
    """Parameters of ``src_role`` in ``src`` -> ``dst_role`` in ``dst``: ``dst = eta*src + (1-eta)*dst``.

    ``reason``: ``"to MFC layout"`` (home -> the layout an MFC runs in), ``"back home"``
    (after it, for trained roles, whose optimizer lives at home) or ``"declared"`` (a
    :class:`~realflow.api.mfc.ParamReallocHook` of the MFC, e.g. an EMA reference).
    """

    src_role: str
    src: Layout
    dst_role: str
    dst: Layout
    eta: float = 1.0
    reason: str = "declared"

    def __str__(self) -> str:
        ema = "" if self.eta == 1.0 else f" (eta={self.eta:g})"
        return f"realloc {self.src_role} {self.src.short()} -> {self.dst_role} {self.dst.short()}{ema} [{self.reason}]"


@dataclass(frozen=True)
class Offload:
    """Move ``role``'s state on ``layout`` off the devices (to host memory) after an MFC."""

    role: str
    layout: Layout
    reason: str = ""

    def __str__(self) -> str:
        return f"offload {self.role} {self.layout.short()} [{self.reason}]"


@dataclass(frozen=True)
class Reload:
    """Bring ``role``'s offloaded state on ``layout`` back before an MFC (a no-op if it is resident)."""

    role: str
    layout: Layout
    reason: str = ""

    def __str__(self) -> str:
        return f"reload {self.role} {self.layout.short()} [{self.reason}]"


Hook = Union[ParamRealloc, Offload, Reload]


@dataclass(frozen=True)
class DataTransfer:
    """Key ``key`` of an edge: the producer's dp heads hold it; every worker of the consumer needs its part."""

    key: str
    producer: str
    consumer: str
    src_workers: tuple[int, ...]
    dst_workers: tuple[int, ...]

    @property
    def local(self) -> bool:
        """True when every consumer worker already holds the key (it produced it): nothing moves."""
        return set(self.dst_workers) <= set(self.src_workers)

    def __str__(self) -> str:
        where = "local" if self.local else f"w{list(self.src_workers)} -> w{list(self.dst_workers)}"
        return f"{self.key}: {self.producer} -> {self.consumer} ({where})"


@dataclass(frozen=True)
class ReallocPair:
    """A (source, destination) layout pair whose reallocation plan and groups must be set up once."""

    src_role: str
    src: Layout
    dst_role: str
    dst: Layout

    def __str__(self) -> str:
        return f"{self.src_role} {self.src.short()} -> {self.dst_role} {self.dst.short()}"
