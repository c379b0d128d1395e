"""Search over allocations: one strategy for every MFC, then a strategy and a mesh per MFC.

A mesh is every device, or a block of 1/2, 1/4, 3/4, 1/8 or 7/8 of them at the front or the back
(:func:`meshes`): two complementary blocks let independent MFCs, such as the critic's and the
actor's training, run at the same time on unequal shares (the simulator's clock sees it).

Two baselines are reported beside the best plan. The *best single global strategy* gives every
MFC one (dp, tp, pp) on every device; generation never pipelines, so with a generate MFC it has
pp = 1. The *best training strategy* is the stronger one a user of one Megatron layout would
write: every MFC shares one (dp, tp, pp) except that generate MFCs fold pp into dp (dp*pp, tp).
The search starts from the better of them (or, when none fits, from the one closest to fitting).

Why coordinate descent: a step's MFCs interact only through the reallocation hooks between
their layouts and through the devices they share, so improving one MFC's strategy at a time
from the best global strategy converges in a few rounds, where the full product of
per-MFC choices grows as (strategies)^(MFCs). :func:`exhaustive` enumerates that product for
small cases; the tests check that the search finds its optimum there. Plans whose state does
not fit a device are rejected (the compiler's layout check, then the simulator's peak).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from realflow.api.allocation import ParallelStrategy
from realflow.api.experiment import ExperimentSetup
from realflow.planner.cluster import ClusterSpec
from realflow.planner.simulate import Prediction, Workload, simulate


class NoPlanFits(ValueError):
    """No allocation can run the experiment on the cluster; the message says the closest miss."""


@dataclass
class SearchResult:
    best: Prediction
    best_global: Optional[Prediction]  # one (dp, tp, pp) for every MFC
    best_training_strategy: Optional[Prediction]  # the same, generation's pp folded into dp
    ranked: list[Prediction]  # feasible plans, fastest first (distinct allocations)
    rejected: dict[str, str]  # allocation -> why it cannot run
    evaluated: int

    @property
    def speedup_over_global(self) -> float:
        return self.best_global.step_s / self.best.step_s if self.best_global else float("nan")


def strategies(n: int, max_tp: int) -> list[ParallelStrategy]:
    """Every (dp, tp, pp) with dp*tp*pp == n, tp a power of two up to ``max_tp`` (within a node)."""
    out = []
    tp = 1
    while tp <= min(n, max_tp):
        if n % tp == 0:
            rest = n // tp
            for pp in range(1, rest + 1):
                if rest % pp == 0:
                    out.append(ParallelStrategy(dp=rest // pp, tp=tp, pp=pp))
        tp *= 2
    return out


def short(s: ParallelStrategy) -> str:
    return f"d{s.dp}" + (f"t{s.tp}" if s.tp > 1 else "") + (f"p{s.pp}" if s.pp > 1 else "")


def _model_mfcs(setup: ExperimentSetup, model_roles: Iterable[str]) -> list[str]:
    roles = set(model_roles)
    return [m.name for m in setup.mfcs if m.model_name in roles]


class _Evaluator:
    """Simulates allocations once each. Plans that do not fit still get a score, so the descent
    can walk from an over-full start (no global strategy fits a large model) towards one that fits."""

    def __init__(self, setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
                 workload: Workload) -> None:
        self.args = (setup, cluster, model_cfgs, workload)
        self.cache: dict[str, Optional[Prediction]] = {}
        self.oversize: dict[str, float] = {}  # allocation -> peak bytes, for plans that compile but overflow
        self.durations: dict[str, dict[str, float]] = {}  # allocation -> MFC -> its own seconds
        self.rejected: dict[str, str] = {}
        self.graph: Any = None  # the compiled graph's networkx edges (the same for every plan)

    def __call__(self, alloc: str) -> Optional[Prediction]:
        if alloc not in self.cache:
            setup, cluster, cfgs, workload = self.args
            try:
                pred = simulate(setup, cluster, cfgs, workload, alloc)
            except ValueError as e:
                self.rejected[alloc] = str(e).splitlines()[0]
                pred = None
            if pred is not None:
                self.graph = pred.plan.graph.nx_graph
                self.durations[alloc] = {m.name: m.end - m.start for m in pred.mfcs}
            if pred is not None and not pred.fits:
                gib = 2 ** 30
                self.rejected[alloc] = (f"peak memory {pred.max_peak_bytes / gib:.1f} GiB exceeds the device's "
                                        f"{pred.capacity_bytes / gib:.1f} GiB")
                self.oversize[alloc] = pred.max_peak_bytes
                pred = None
            self.cache[alloc] = pred
        return self.cache[alloc]

    def score(self, alloc: str) -> tuple[int, float]:
        """(0, step seconds) if it fits, (1, peak bytes) if it compiles but overflows, else (2, 0)."""
        pred = self(alloc)
        if pred is not None:
            return (0, pred.step_s)
        return (1, self.oversize[alloc]) if alloc in self.oversize else (2, 0.0)


def _better(a: tuple[int, float], b: tuple[int, float]) -> bool:
    return a[0] < b[0] or (a[0] == b[0] and a[1] < b[1] * (1 - 1e-9))


@dataclass(frozen=True)
class Choice:
    """One MFC's strategy on a mesh: every device (``mesh=None``) or the devices ``lo..hi``."""

    strategy: ParallelStrategy
    mesh: Optional[tuple[int, int]] = None

    def text(self) -> str:
        return short(self.strategy) + (f"@{self.mesh[0]}-{self.mesh[1]}" if self.mesh else "")


def mesh_sizes(n: int) -> list[int]:
    """Sizes of the partial meshes: halves, quarters and eighths of the devices and their complements."""
    return sorted({n * a // b for a, b in ((1, 2), (1, 4), (3, 4), (1, 8), (7, 8)) if n * a % b == 0 and n * a // b >= 1})


def meshes(n: int) -> list[Optional[tuple[int, int]]]:
    """Every device (None), then each partial mesh at the front and at the back of the devices, so
    that any two complementary ones (k devices and n-k) split the cluster between two MFCs."""
    out: list[Optional[tuple[int, int]]] = [None]
    for k in mesh_sizes(n):
        for m in ((0, k - 1), (n - k, n - 1)):
            if m not in out:
                out.append(m)
    return out


def choices(n: int, max_tp: int, halves: bool = True) -> list[Choice]:
    """Every strategy on every mesh of :func:`meshes` (only the whole mesh with ``halves=False``)."""
    out = []
    for m in meshes(n) if halves else [None]:
        size = n if m is None else m[1] - m[0] + 1
        out += [Choice(s, m) for s in strategies(size, max_tp)]
    return out


def _generate_mfcs(setup: ExperimentSetup) -> set[str]:
    from realflow.api.mfc import ModelInterfaceType

    return {m.name for m in setup.mfcs if m.interface_type == ModelInterfaceType.GENERATE}


def _global_plan(s: ParallelStrategy, names: list[str], generating: set[str]) -> dict[str, Choice]:
    """One strategy for every MFC; generate MFCs fold pp into dp (they cannot pipeline)."""
    unpiped = ParallelStrategy(dp=s.dp * s.pp, tp=s.tp, pp=1)
    return {m: Choice(unpiped if m in generating else s) for m in names}


def _per_mfc(choice: dict[str, Choice], others: str = "") -> str:
    parts = [f"{name}:{c.text()}" for name, c in choice.items()]
    return ",".join(parts + ([f"*:{others}"] if others else []))


def search(setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
           workload: Workload, rounds: int = 4, top: int = 5) -> SearchResult:
    """The fastest allocation found (see module docstring); raises :class:`NoPlanFits`."""
    ev = _Evaluator(setup, cluster, model_cfgs, workload)
    n = cluster.n_devices
    strats = strategies(n, cluster.devices_per_node)
    singles = [c for c in choices(n, cluster.devices_per_node)
               if c.mesh is None or c.mesh[1] - c.mesh[0] + 1 == n // 2]  # one-MFC moves: all or a half
    names = _model_mfcs(setup, model_cfgs)
    generating = _generate_mfcs(setup)
    fill = short(strats[0])
    globals_ = [(_global_alloc(s, names, generating, fill), _global_plan(s, names, generating)) for s in strats]
    strict = [ev(short(s)) for s in strats if s.pp == 1 or not generating & set(names)]
    best_global = min((p for p in strict if p is not None), key=lambda p: p.step_s, default=None)
    best_training = min((ev(a) for a, _ in globals_ if ev(a) is not None), key=lambda p: p.step_s, default=None)
    # start from the best global strategy or, if none fits, the one closest to fitting
    alloc0, current = min(globals_, key=lambda g: ev.score(g[0]))
    score = ev.score(alloc0)
    for _ in range(rounds):
        improved = False
        for name in names:
            for c in singles:
                if c == current[name]:
                    continue
                trial = {**current, name: c}
                sc = ev.score(_per_mfc(trial, fill))
                if _better(sc, score):
                    score, current, improved = sc, trial, True
        split = _split_moves(ev, names, current, fill, score, n, cluster.devices_per_node)
        if split:
            score, current = split
        elif not improved:
            break
    feasible = [p for p in ev.cache.values() if p is not None]
    if not feasible:
        raise NoPlanFits(_closest_miss(ev.rejected, cluster))
    ranked = sorted(_distinct(feasible), key=lambda p: p.step_s)[:top]
    return SearchResult(best=min(feasible, key=lambda p: p.step_s), best_global=best_global,
                        best_training_strategy=best_training, ranked=ranked, rejected=ev.rejected,
                        evaluated=len(ev.cache))


def _global_alloc(s: ParallelStrategy, names: list[str], generating: set[str], fill: str) -> str:
    if s.pp == 1 or not generating & set(names):
        return short(s)
    return _per_mfc(_global_plan(s, names, generating), fill)


SPLIT_TOP_K = 3  # strategies tried per MFC and mesh size in a split move


def _split_moves(ev: _Evaluator, names: list[str], current: dict[str, Choice], fill: str,
                 score: tuple[int, float], n: int, max_tp: int) -> Optional[tuple[tuple[int, float], dict[str, Choice]]]:
    """Split the devices between two MFCs that do not depend on each other, k devices for one and
    n-k for the other, so they run at the same time (a move neither makes alone pays off, as each
    would wait for the other). Each MFC tries its :data:`SPLIT_TOP_K` fastest strategies on its
    share, timed alone first. Returns (score, plan) when it found something better, else None."""
    import networkx as nx

    g = ev.graph
    if g is None:
        return None
    pairs = [(a, b) for a, b in itertools.combinations(names, 2) if not (nx.has_path(g, a, b) or nx.has_path(g, b, a))]
    if not pairs:
        return None
    fastest: dict[tuple[str, int], list[ParallelStrategy]] = {}

    def top(name: str, k: int) -> list[ParallelStrategy]:
        if (name, k) not in fastest:
            timed = []
            for s in strategies(k, max_tp):
                alloc = _per_mfc({**current, name: Choice(s, (0, k - 1))}, fill)
                ev(alloc)
                if alloc in ev.durations and (ev(alloc) is not None or alloc in ev.oversize):
                    timed.append((ev.durations[alloc][name], s))
            fastest[(name, k)] = [s for _, s in sorted(timed, key=lambda t: t[0])[:SPLIT_TOP_K]]
        return fastest[(name, k)]

    found = None
    for a, b in pairs:
        for k in mesh_sizes(n):
            for sa in top(a, k):
                for sb in top(b, n - k):
                    trial = {**current, a: Choice(sa, (0, k - 1)), b: Choice(sb, (k, n - 1))}
                    sc = ev.score(_per_mfc(trial, fill))
                    if _better(sc, score):
                        score, found = sc, trial
    return (score, found) if found is not None else None


def exhaustive(setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
               workload: Workload) -> Prediction:
    """The optimum over the full product of per-MFC strategies (small cases only)."""
    ev = _Evaluator(setup, cluster, model_cfgs, workload)
    strats = strategies(cluster.n_devices, cluster.devices_per_node)
    cands = choices(cluster.n_devices, cluster.devices_per_node)
    names = _model_mfcs(setup, model_cfgs)
    preds = [ev(_per_mfc(dict(zip(names, combo)), short(strats[0])))
             for combo in itertools.product(cands, repeat=len(names))]
    preds += [ev(short(s)) for s in strats]
    preds += [ev(_per_mfc(_global_plan(s, names, _generate_mfcs(setup)), short(strats[0]))) for s in strats]
    feasible = [p for p in preds if p is not None]
    if not feasible:
        raise NoPlanFits(_closest_miss(ev.rejected, cluster))
    return min(feasible, key=lambda p: p.step_s)


def _distinct(preds: list[Prediction]) -> list[Prediction]:
    """One prediction per distinct set of MFC layouts (different strings may say the same)."""
    seen, out = set(), []
    for p in sorted(preds, key=lambda p: p.step_s):
        key = tuple(sorted((n, pl.layout.short()) for n, pl in p.plan.placements.items()))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _closest_miss(rejected: dict[str, str], cluster: ClusterSpec) -> str:
    mem = [r for r in rejected.values() if "fit" in r or "memory" in r]
    why = mem[0] if mem else next(iter(rejected.values()), "no candidate layout")
    return (f"no allocation fits {cluster.n_devices} x {cluster.device.name} "
            f"({cluster.device.memory_bytes / 2**30:.0f} GiB each); {len(rejected)} layouts rejected, e.g.: {why}")
