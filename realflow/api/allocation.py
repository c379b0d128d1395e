"""Where each MFC runs: a device mesh (a set of model workers) and a parallel strategy.

Users write short strings; this module turns them into one structure,
:class:`Allocation` (MFC name -> :class:`MFCAllocation`), that the plan
compiler consumes.  Today's grammar is a single strategy for every MFC over
every worker (``"d2"``, ``"d2t2p1"``).  The parser is split into *terms* (what
the string says) and *layout* (which workers each term gets) so that per-MFC
maps and ``+`` splits (``"gen:d4+train:d2p2"``) only add term kinds and a
worker-assignment rule, not a new parser.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Sequence

__all__ = [
    "AllocationError", "ParallelStrategy", "parse_strategy", "DeviceMesh", "MFCAllocation", "Allocation",
    "parse_allocation", "STRATEGY_GRAMMAR", "ALLOCATION_GRAMMAR",
]

STRATEGY_GRAMMAR = (
    "strategy := one or more of d<N> (data parallel), t<N> (tensor parallel), p<N> (pipeline parallel), "
    "each letter at most once, in any order, missing = 1; e.g. 'd2', 'd2t1p1', 't2d1'"
)
ALLOCATION_GRAMMAR = (
    "allocation := strategy, applied to every MFC over all workers, with d*t*p == number of workers "
    f"(e.g. 'd2' on 2 workers); {STRATEGY_GRAMMAR}"
)


class AllocationError(ValueError):
    """A bad strategy / allocation string or an inconsistent allocation; shows the grammar when parsing."""


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelStrategy:
    """Data, tensor and pipeline parallel degrees of one MFC (``world_size = dp*tp*pp``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp"):
            if not _positive_int(getattr(self, f)):
                raise AllocationError(f"ParallelStrategy.{f} must be an integer >= 1, got {getattr(self, f)!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"d{self.dp}t{self.tp}p{self.pp}"


_TERM = re.compile(r"([dtp])(\d+)")


def parse_strategy(s: str | ParallelStrategy) -> ParallelStrategy:
    """Parse ``"d2t1p1"``-style strings (see :data:`STRATEGY_GRAMMAR`)."""
    if isinstance(s, ParallelStrategy):
        return s
    if not isinstance(s, str):
        raise AllocationError(f"parallel strategy must be a str, got {type(s).__name__} {s!r}; {STRATEGY_GRAMMAR}")
    text = s.strip().lower()
    pos, degrees = 0, {}
    while pos < len(text):
        m = _TERM.match(text, pos)
        if m is None:
            raise AllocationError(f"cannot parse parallel strategy {s!r} at {text[pos:]!r}; {STRATEGY_GRAMMAR}")
        letter, value = m.group(1), int(m.group(2))
        if letter in degrees:
            raise AllocationError(f"parallel strategy {s!r} sets {letter!r} twice; {STRATEGY_GRAMMAR}")
        if value < 1:
            raise AllocationError(f"parallel strategy {s!r}: {letter}{value} must be >= 1; {STRATEGY_GRAMMAR}")
        degrees[letter] = value
        pos = m.end()
    if not degrees:
        raise AllocationError(f"empty parallel strategy {s!r}; {STRATEGY_GRAMMAR}")
    return ParallelStrategy(dp=degrees.get("d", 1), tp=degrees.get("t", 1), pp=degrees.get("p", 1))


@dataclass(frozen=True)
class DeviceMesh:
    """A set of model workers, by index (on GPU one worker = one device; on CPU one process)."""

    workers: tuple[int, ...]

    def __post_init__(self) -> None:
        ws = tuple(self.workers) if isinstance(self.workers, (list, tuple, range)) else None
        if not ws:
            raise AllocationError(f"DeviceMesh needs a non-empty sequence of worker indices, got {self.workers!r}")
        for w in ws:
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise AllocationError(f"DeviceMesh worker indices must be integers >= 0, got {w!r}")
        if len(set(ws)) != len(ws):
            raise AllocationError(f"DeviceMesh lists a worker twice: {list(ws)}")
        object.__setattr__(self, "workers", ws)

    @classmethod
    def range(cls, start: int, stop: int) -> "DeviceMesh":
        """Workers ``start .. stop-1``."""
        return cls(tuple(range(start, stop)))

    @property
    def size(self) -> int:
        return len(self.workers)

    def __contains__(self, worker: object) -> bool:
        return worker in self.workers

    def overlaps(self, other: "DeviceMesh") -> bool:
        return bool(set(self.workers) & set(other.workers))

    def __str__(self) -> str:
        ws = self.workers
        if ws == tuple(range(ws[0], ws[0] + len(ws))):
            return f"w{ws[0]}" if len(ws) == 1 else f"w{ws[0]}-{ws[-1]}"
        return "w[" + ",".join(map(str, ws)) + "]"


class MFCAllocation(NamedTuple):
    """One MFC's placement; unpacks as ``mesh, strategy = alloc[name]``."""

    mesh: DeviceMesh
    strategy: ParallelStrategy

    def __str__(self) -> str:
        return f"{self.mesh} {self.strategy}"


class Allocation(Mapping[str, MFCAllocation]):
    """MFC name -> (DeviceMesh, ParallelStrategy); checks that each mesh fits its strategy."""

    def __init__(self, entries: Mapping[str, MFCAllocation | tuple[DeviceMesh, ParallelStrategy]]) -> None:
        self._entries: dict[str, MFCAllocation] = {}
        for name, value in entries.items():
            mesh, strategy = value
            if not isinstance(mesh, DeviceMesh) or not isinstance(strategy, ParallelStrategy):
                raise AllocationError(f"MFC {name!r}: allocation must be (DeviceMesh, ParallelStrategy), got {value!r}")
            if mesh.size != strategy.world_size:
                raise AllocationError(
                    f"MFC {name!r}: strategy {strategy} needs {strategy.world_size} workers "
                    f"but its mesh {mesh} has {mesh.size}"
                )
            self._entries[name] = MFCAllocation(mesh, strategy)

    def __getitem__(self, name: str) -> MFCAllocation:
        try:
            return self._entries[name]
        except KeyError:
            raise AllocationError(f"no allocation for MFC {name!r} (allocated: {sorted(self._entries)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def workers(self) -> list[int]:
        """Every worker index used by some MFC, sorted."""
        return sorted({w for a in self._entries.values() for w in a.mesh.workers})

    def __repr__(self) -> str:
        return "Allocation({" + ", ".join(f"{k!r}: {v}" for k, v in self._entries.items()) + "})"


# ---- allocation strings ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Term:
    """One piece of an allocation string: a strategy for some MFCs (``None`` = all of them)."""

    mfcs: tuple[str, ...] | None
    strategy: ParallelStrategy


def _parse_terms(s: str) -> list[_Term]:
    """Split an allocation string into terms (today exactly one, covering every MFC)."""
    if not isinstance(s, str) or not s.strip():
        raise AllocationError(f"empty allocation {s!r}; {ALLOCATION_GRAMMAR}")
    if any(c in s for c in "+:,{}="):
        raise AllocationError(
            f"allocation {s!r}: per-MFC allocations and '+' splits are not supported yet; {ALLOCATION_GRAMMAR}"
        )
    try:
        return [_Term(None, parse_strategy(s))]
    except AllocationError as e:
        raise AllocationError(f"bad allocation {s!r}: {e}".replace(STRATEGY_GRAMMAR, ALLOCATION_GRAMMAR)) from None


def _layout(terms: list[_Term], mfc_names: Sequence[str], n_workers: int, source: str) -> Allocation:
    """Give each term its workers and expand it to per-MFC entries."""
    (term,) = terms
    if term.strategy.world_size != n_workers:
        st = term.strategy
        raise AllocationError(
            f"allocation {source!r} uses d{st.dp}*t{st.tp}*p{st.pp} = {st.world_size} workers "
            f"but there are {n_workers}; {ALLOCATION_GRAMMAR}"
        )
    mesh = DeviceMesh.range(0, n_workers)
    return Allocation({name: MFCAllocation(mesh, term.strategy) for name in mfc_names})


def parse_allocation(s: str, mfc_names: Sequence[str], n_workers: int) -> Allocation:
    """Parse an allocation string for the MFCs ``mfc_names`` over workers ``0..n_workers-1``."""
    if not _positive_int(n_workers):
        raise AllocationError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    names = list(mfc_names)
    if not names:
        raise AllocationError("parse_allocation: no MFC names given")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AllocationError(f"parse_allocation: MFC names listed twice: {dup}")
    return _layout(_parse_terms(s), names, n_workers, s)
