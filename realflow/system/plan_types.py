"""The pure-data pieces of an execution plan: layouts, placements and hooks.

Everything here is a small frozen dataclass computed identically by every process
from the same :class:`~realflow.api.experiment.ExperimentSetup`, so a plan never has
to travel between processes, and two processes can compare plans with ``==``.
Hooks say *what* must happen around an MFC (move parameters, offload, reload); the
runtime decides *how* (which path, which buffers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from realflow.api.layout import Layout

__all__ = ["PlanError", "MFCPlacement", "ParamRealloc", "Offload", "Reload", "Hook",
           "DataTransfer", "ReallocPair"]


class PlanError(ValueError):
    """The graph and allocation cannot be executed as given."""


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
