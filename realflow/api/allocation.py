"""Where each MFC runs: a device mesh (a set of model workers) and a parallel strategy.

Users write short strings; this module turns them into one structure,
:class:`Allocation` (MFC name -> :class:`MFCAllocation`), that the plan compiler
consumes.  The grammar (:data:`ALLOCATION_GRAMMAR`) covers one strategy for every
MFC (``"d2t2"``), per-MFC maps with a default (``"actor_train:d1t2p2,*:d2"``),
disjoint splits (``"gen:d4+train:d2p2"``) and explicit worker sets
(``"ref_inf:d2@4-5"``).

Parsing has two steps so each error can say exactly what is wrong: *terms*
(what the string says, syntax only) and *layout* (which workers each term gets
and which MFCs each entry selects).  Selection is by specificity, so a short
default never fights an explicit entry: an MFC name beats ``gen``/``train``,
which beat ``*``.  The interface types that ``gen``/``train`` need come from
the caller (MFCDefs or a name -> type map); this module does not import
:mod:`realflow.api.mfc` so that parsing stays cheap and torch-free.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence, Union

from realflow.api.registry import closest

__all__ = [
    "AllocationError", "ParallelStrategy", "parse_strategy", "DeviceMesh", "MFCAllocation", "Allocation",
    "parse_allocation", "STRATEGY_GRAMMAR", "ALLOCATION_GRAMMAR", "MFCTypes",
]

STRATEGY_GRAMMAR = (
    "strategy := one or more of d<N> (data parallel), t<N> (tensor parallel), p<N> (pipeline parallel), "
    "e<N> (expert parallel, MoE models: experts sharded over N of the d*t ranks of a stage, so N must "
    "divide d*t and the rank count stays d*t*p), each letter at most once, in any order, missing = 1; "
    "e.g. 'd2', 'd2t1p1', 't2d1', 'd2e2', 'd1t2e2'"
)
ALLOCATION_GRAMMAR = """allocation grammar:
  allocation := term ('+' term)*
  term       := entry (',' entry)*              braces are optional: '{a:d2,*:d4}'
  entry      := [selector ':'] strategy ['@' workers]
  selector   := MFC name | 'gen' (generate MFCs) | 'train' (train_step and inference MFCs)
                | '*' (every MFC no other selector takes); no selector means '*'
  strategy   := d<N>, t<N>, p<N>, e<N> in any order, each at most once, missing = 1;
                e<N> shards an MoE model's experts over N of the d*t ranks of each stage
  workers    := N | N-M | '[' N[-M] (',' N[-M])* ']'   absolute worker indices, ranges inclusive
  rules: without '+', the term spans all workers; with '+', each term takes the next block of
    consecutive workers, as many as the d*t*p of its entries without '@' (which must agree).
    An entry without '@' runs on its whole block (d*t*p must equal the block size); '@' puts an
    entry on an explicit worker set, inside its term's block. Terms must not overlap and together
    must use every worker. An MFC name beats gen/train, which beat '*'; each selector appears once.
  examples: 'd4' | 't2d2' | 'actor_train:d1t2p2,actor_gen:d4,*:d2t2' | 'gen:d4+train:d2p2'
    | 'actor_gen:d4+{actor_train:d2p2,ref_inf:d2@6-7}' | 'd4,ref_inf:d2@2-3'"""


class AllocationError(ValueError):
    """A bad strategy / allocation string or an inconsistent allocation; shows the grammar when parsing."""


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelStrategy:
    """Data, tensor, pipeline and expert parallel degrees of one MFC (``world_size = dp*tp*pp``).

    Expert parallelism is carved out of the ``dp*tp`` ranks of each pipeline stage, as
    megatron-core does it: attention stays data/tensor parallel, and an MoE layer's experts
    are sharded over groups of ``ep`` consecutive ranks of the stage (each expert whole on its
    rank), with ``dp*tp/ep`` copies of every expert.  So ``d2e2`` is two ranks that see
    different data and hold half the experts each; ``d1t2e2`` two tensor-parallel ranks that
    hold half the experts each.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "ep"):
            if not _positive_int(getattr(self, f)):
                raise AllocationError(f"ParallelStrategy.{f} must be an integer >= 1, got {getattr(self, f)!r}")
        if (self.dp * self.tp) % self.ep:
            raise AllocationError(
                f"strategy {self}: expert parallel e{self.ep} must divide d*t = {self.dp * self.tp} (experts "
                f"are sharded over the data/tensor-parallel ranks of a stage, so the rank count stays d*t*p): "
                f"for e{self.ep} use e.g. d{self.ep}e{self.ep} or d1t{self.ep}e{self.ep}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        """Copies of each expert in a stage (gradients of an expert are reduced over them)."""
        return self.dp * self.tp // self.ep

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel degree of an expert's weights: whole experts once they are sharded."""
        return 1 if self.ep > 1 else self.tp

    def __str__(self) -> str:
        return f"d{self.dp}t{self.tp}p{self.pp}" + (f"e{self.ep}" if self.ep > 1 else "")


_TERM = re.compile(r"([dtpe])(\d+)")


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
    return ParallelStrategy(dp=degrees.get("d", 1), tp=degrees.get("t", 1), pp=degrees.get("p", 1),
                            ep=degrees.get("e", 1))


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

GEN, TRAIN, ANY = "gen", "train", "*"
_KIND_OF_TYPE = {"generate": GEN, "inference": TRAIN, "train_step": TRAIN}
_SELECTOR = re.compile(r"^(\*|[A-Za-z_][A-Za-z0-9_.\-]*)$")
_WORKER_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")

MFCTypes = Union[Sequence[str], Sequence[Any], Mapping[str, Any]]
"""What :func:`parse_allocation` accepts for the MFCs: names, MFCDef-like objects (``.name`` and
``.interface_type``) or a name -> interface type map (``ModelInterfaceType`` or its value)."""


@dataclass(frozen=True)
class _Entry:
    """``selector:strategy@workers`` as written; ``workers`` is None when the entry has no '@'."""

    text: str
    selector: str
    strategy: ParallelStrategy
    workers: tuple[int, ...] | None


@dataclass(frozen=True)
class _Term:
    """One '+'-separated part of an allocation string (``index`` counts from 1 for messages)."""

    index: int
    text: str
    entries: tuple[_Entry, ...]


def _fail(source: str, what: str) -> AllocationError:
    return AllocationError(f"allocation {source!r}: {what}\n{ALLOCATION_GRAMMAR}")


def _split_top(text: str, sep: str, source: str) -> list[str]:
    """Split ``text`` on ``sep`` outside braces and brackets, checking that they balance."""
    parts, start, stack = [], 0, []
    for i, c in enumerate(text):
        if c in "{[":
            stack.append(c)
        elif c in "}]":
            if not stack or stack.pop() != {"}": "{", "]": "["}[c]:
                raise _fail(source, f"unbalanced {c!r} at position {i}")
        elif c == sep and not stack:
            parts.append(text[start:i])
            start = i + 1
    if stack:
        raise _fail(source, f"unclosed {stack[-1]!r}")
    parts.append(text[start:])
    return parts


def _parse_workers(spec: str, entry: str, source: str) -> tuple[int, ...]:
    body = spec[1:-1] if spec.startswith("[") and spec.endswith("]") else spec
    workers: list[int] = []
    for item in body.split(","):
        m = _WORKER_ITEM.match(item.strip())
        if m is None:
            raise _fail(source, f"entry {entry!r}: bad worker set '@{spec}' at {item.strip()!r}")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise _fail(source, f"entry {entry!r}: worker range {lo}-{hi} is empty")
        workers.extend(range(lo, hi + 1))
    if len(set(workers)) != len(workers):
        raise _fail(source, f"entry {entry!r}: worker set '@{spec}' lists a worker twice")
    return tuple(workers)


def _parse_entry(text: str, source: str) -> _Entry:
    entry = text.strip()
    if not entry:
        raise _fail(source, "empty entry (a stray ',' or '+'?)")
    selector, rest = entry.split(":", 1) if ":" in entry else (ANY, entry)
    selector = selector.strip()
    if not _SELECTOR.match(selector):
        raise _fail(source, f"entry {entry!r}: bad selector {selector!r}")
    strat_text, at, worker_text = rest.partition("@")
    try:
        strategy = parse_strategy(strat_text.strip())
    except AllocationError as e:
        raise _fail(source, f"entry {entry!r}: {str(e).replace('; ' + STRATEGY_GRAMMAR, '')}") from None
    workers = _parse_workers(worker_text.strip(), entry, source) if at else None
    if workers is not None and len(workers) != strategy.world_size:
        raise _fail(source, f"entry {entry!r}: strategy {strategy} needs d*t*p = {strategy.world_size} workers "
                            f"but '@{worker_text.strip()}' names {len(workers)}")
    return _Entry(entry, selector, strategy, workers)


def _parse_terms(s: str) -> list[_Term]:
    """Syntax only: '+' terms of ',' entries (see :data:`ALLOCATION_GRAMMAR`)."""
    if not isinstance(s, str) or not s.strip():
        raise _fail(s, "empty allocation")
    terms = []
    for i, raw in enumerate(_split_top(s.strip(), "+", s), start=1):
        text = raw.strip()
        if not text:
            raise _fail(s, f"term {i} is empty (a stray '+'?)")
        body = text[1:-1] if text.startswith("{") and text.endswith("}") else text
        if "{" in body or "}" in body:
            raise _fail(s, f"term {i} {text!r}: braces only group a whole term and do not nest")
        entries = tuple(_parse_entry(e, s) for e in _split_top(body, ",", s))
        terms.append(_Term(i, text, entries))
    return terms


def _mfc_kinds(mfcs: MFCTypes) -> dict[str, str | None]:
    """MFC name -> 'gen' / 'train' / None (type unknown: the caller passed bare names)."""
    if isinstance(mfcs, Mapping):
        items = list(mfcs.items())
    else:
        items = [(m, None) if isinstance(m, str) else (getattr(m, "name", m), getattr(m, "interface_type", None))
                 for m in mfcs]
    kinds: dict[str, str | None] = {}
    seen: list[str] = []
    for name, itype in items:
        if not isinstance(name, str) or not name:
            raise AllocationError(f"parse_allocation: MFC names must be non-empty str, got {name!r}")
        seen.append(name)
        if itype is None:
            kinds[name] = None
            continue
        value = getattr(itype, "value", itype)
        if value not in _KIND_OF_TYPE:
            raise AllocationError(f"parse_allocation: MFC {name!r} has unknown interface type {itype!r} "
                                  f"(expected one of {sorted(_KIND_OF_TYPE)})")
        kinds[name] = _KIND_OF_TYPE[value]
    if not seen:
        raise AllocationError("parse_allocation: no MFC names given")
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise AllocationError(f"parse_allocation: MFC names listed twice: {dup}")
    return kinds


def _selected(entry: _Entry, kinds: dict[str, str | None], source: str) -> tuple[int, set[str]]:
    """(specificity, MFCs the selector matches): name = 2, gen/train = 1, '*' = 0."""
    sel = entry.selector
    if sel in kinds:  # an MFC literally named 'gen' or 'train' is selected by name
        return 2, {sel}
    if sel in (GEN, TRAIN):
        unknown = sorted(n for n, k in kinds.items() if k is None)
        if unknown:
            raise _fail(source, f"selector {sel!r} needs the interface type of every MFC, but none was given for "
                                f"{unknown}; pass MFCDefs or a name -> interface type map to parse_allocation")
        return 1, {n for n, k in kinds.items() if k == sel}
    if sel == ANY:
        return 0, set(kinds)
    hint = closest(sel, list(kinds))
    near = f"; did you mean {', '.join(map(repr, hint))}?" if hint else ""
    raise _fail(source, f"entry {entry.text!r}: unknown MFC {sel!r}{near} (MFCs: {', '.join(kinds)})")


def _blocks(terms: list[_Term], n_workers: int, source: str) -> list[tuple[int, ...]]:
    """Workers of each term: all of them without '+', else consecutive blocks (see the grammar)."""
    def fmt(ws: Sequence[int]) -> str:
        return str(DeviceMesh(tuple(ws))) if ws else "none"

    blocks: list[tuple[int, ...]] = []
    cursor = 0
    for term in terms:
        sized = [e for e in term.entries if e.workers is None]
        sizes = sorted({e.strategy.world_size for e in sized})
        if len(sizes) > 1:
            detail = ", ".join(f"{e.text!r} = {e.strategy.world_size}" for e in sized)
            raise _fail(source, f"term {term.index} {term.text!r}: its entries without '@' must use the same number "
                                f"of workers (d*t*p), got {detail}")
        if len(terms) == 1:
            block = tuple(range(n_workers))
            if sizes and sizes[0] != n_workers:
                e = sized[0]
                st = e.strategy
                raise _fail(source, f"{e.text!r} uses d{st.dp}*t{st.tp}*p{st.pp} = {st.world_size} workers "
                                    f"but there are {n_workers}")
        elif sizes:
            block = tuple(range(cursor, cursor + sizes[0]))
        else:
            block = tuple(sorted({w for e in term.entries for w in e.workers or ()}))
        for e in term.entries:
            beyond = sorted(w for w in (e.workers or ()) if w >= n_workers)
            if beyond:
                raise _fail(source, f"entry {e.text!r} uses worker(s) {beyond} but there are only {n_workers} "
                                    f"workers ({fmt(range(n_workers))})")
            outside = sorted(set(e.workers or ()) - set(block))
            if outside:
                raise _fail(source, f"entry {e.text!r}: workers {outside} lie outside its term's block "
                                    f"{fmt(block)}")
        if block and block[-1] >= n_workers:
            raise _fail(source, f"term {term.index} {term.text!r} needs workers {fmt(block)} but there are only "
                                f"{n_workers} workers ({fmt(range(n_workers))}): more workers used than exist")
        for prev_i, prev in enumerate(blocks, start=1):
            both = sorted(set(prev) & set(block))
            if both:
                raise _fail(source, f"terms {prev_i} {terms[prev_i - 1].text!r} and {term.index} {term.text!r} "
                                    f"overlap on workers {both}")
        blocks.append(block)
        cursor = max(cursor, block[-1] + 1) if block else cursor
    unused = sorted(set(range(n_workers)) - {w for b in blocks for w in b})
    if unused:
        raise _fail(source, f"workers {unused} are used by no term (there are {n_workers} workers); "
                            f"they would idle")
    return blocks


def _layout(terms: list[_Term], kinds: dict[str, str | None], n_workers: int, source: str) -> Allocation:
    """Give each term its workers and each MFC the most specific entry that selects it."""
    blocks = _blocks(terms, n_workers, source)
    seen: dict[str, str] = {}
    for term in terms:
        for e in term.entries:
            if e.selector in seen:
                raise _fail(source, f"selector {e.selector!r} appears twice ({seen[e.selector]!r} and {e.text!r}): "
                                    f"an MFC would be covered twice")
            seen[e.selector] = e.text
    candidates: list[tuple[int, set[str], _Entry, tuple[int, ...]]] = []
    for term, block in zip(terms, blocks):
        for e in term.entries:
            level, names = _selected(e, kinds, source)
            candidates.append((level, names, e, e.workers or block))
    best: dict[str, tuple[int, _Entry, tuple[int, ...]]] = {}
    for level, names, e, workers in candidates:
        for name in names:
            if name not in best or level > best[name][0]:
                best[name] = (level, e, workers)
    used = {e.text for _, e, _ in best.values()}
    for _, names, e, _ in candidates:
        if e.selector in (GEN, TRAIN) and e.selector not in kinds and e.text not in used:
            what = "no generate MFC" if e.selector == GEN else "no train_step or inference MFC"
            left = "" if not names else f" (all of {sorted(names)} are named explicitly)"
            raise _fail(source, f"entry {e.text!r} selects {what}{left}")
    missing = [n for n in kinds if n not in best]
    if missing:
        raise _fail(source, f"MFC(s) {missing} covered by no entry; name them or add a '*' default")
    if len(terms) > 1:
        for term in terms:
            if not any(e.text in used for e in term.entries):
                raise _fail(source, f"term {term.index} {term.text!r} selects no MFC; its workers would idle")
    alloc = Allocation({n: MFCAllocation(DeviceMesh(best[n][2]), best[n][1].strategy) for n in kinds})
    idle = sorted(set(range(n_workers)) - set(alloc.workers()))
    if idle:
        raise _fail(source, f"workers {idle} run no MFC (there are {n_workers} workers); they would idle")
    return alloc


def parse_allocation(s: str, mfcs: MFCTypes, n_workers: int) -> Allocation:
    """Parse an allocation string (see :data:`ALLOCATION_GRAMMAR`) over workers ``0..n_workers-1``.

    ``mfcs``: MFC names (then ``gen``/``train`` selectors are unavailable), MFCDef-like
    objects, or a name -> interface type map. The result lists MFCs in the given order.
    """
    if not _positive_int(n_workers):
        raise AllocationError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    kinds = _mfc_kinds(mfcs)
    return _layout(_parse_terms(s), kinds, n_workers, s)
