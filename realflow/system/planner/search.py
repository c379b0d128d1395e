"""Search over allocations: one strategy for every MFC, then a strategy and a mesh per MFC.

A mesh is every device or either half of them (disjoint halves let independent MFCs, such as
the critic's and the actor's training, run at the same time; the simulator's clock sees it).

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
from realflow.system.planner.cluster import ClusterSpec
from realflow.system.planner.simulate import Prediction, Workload, simulate


class NoPlanFits(ValueError):
    """No allocation can run the experiment on the cluster; the message says the closest miss."""


@dataclass
class SearchResult:
    best: Prediction
    best_global: Optional[Prediction]
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
    def __init__(self, setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
                 workload: Workload) -> None:
        self.args = (setup, cluster, model_cfgs, workload)
        self.cache: dict[str, Optional[Prediction]] = {}
        self.rejected: dict[str, str] = {}

    def __call__(self, alloc: str) -> Optional[Prediction]:
        if alloc not in self.cache:
            setup, cluster, cfgs, workload = self.args
            try:
                pred = simulate(setup, cluster, cfgs, workload, alloc)
            except ValueError as e:
                self.rejected[alloc] = str(e).splitlines()[0]
                pred = None
            if pred is not None and not pred.fits:
                gib = 2 ** 30
                self.rejected[alloc] = (f"peak memory {pred.max_peak_bytes / gib:.1f} GiB exceeds the device's "
                                        f"{pred.capacity_bytes / gib:.1f} GiB")
                pred = None
            self.cache[alloc] = pred
        return self.cache[alloc]


@dataclass(frozen=True)
class Choice:
    """One MFC's strategy on a mesh: every device (``mesh=None``) or the devices ``lo..hi``."""

    strategy: ParallelStrategy
    mesh: Optional[tuple[int, int]] = None

    def text(self) -> str:
        return short(self.strategy) + (f"@{self.mesh[0]}-{self.mesh[1]}" if self.mesh else "")


def choices(n: int, max_tp: int, halves: bool = True) -> list[Choice]:
    out = [Choice(s) for s in strategies(n, max_tp)]
    if halves and n >= 2 and n % 2 == 0:
        h = n // 2
        for lo in (0, h):
            out += [Choice(s, (lo, lo + h - 1)) for s in strategies(h, max_tp)]
    return out


def _per_mfc(choice: dict[str, Choice], others: str = "") -> str:
    parts = [f"{name}:{c.text()}" for name, c in choice.items()]
    return ",".join(parts + ([f"*:{others}"] if others else []))


def search(setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
           workload: Workload, rounds: int = 4, top: int = 5) -> SearchResult:
    """The fastest allocation found (see module docstring); raises :class:`NoPlanFits`."""
    ev = _Evaluator(setup, cluster, model_cfgs, workload)
    n = cluster.n_devices
    strats = strategies(n, cluster.devices_per_node)
    cands = choices(n, cluster.devices_per_node)
    globals_ = [p for p in (ev(short(s)) for s in strats) if p is not None]
    names = _model_mfcs(setup, model_cfgs)
    best_global = min(globals_, key=lambda p: p.step_s, default=None)
    # start from the best global strategy (or, if none fits, the first uniform mix that does)
    start = None
    for s in ([_strategy_of(best_global, names[0])] if best_global is not None and names else []) + strats:
        trial = {m: Choice(s) for m in names}
        if ev(_per_mfc(trial, short(s))) is not None:
            start = trial
            break
    current = start or {m: cands[0] for m in names}
    fill = short(strats[0])
    best = ev(_per_mfc(current, fill))
    for _ in range(rounds):
        improved = False
        for name in names:
            for c in cands:
                if c == current[name]:
                    continue
                trial = {**current, name: c}
                pred = ev(_per_mfc(trial, fill))
                if pred is not None and (best is None or pred.step_s < best.step_s * (1 - 1e-9)):
                    best, current, improved = pred, trial, True
        paired = _pair_moves(ev, names, cands, current, fill, best)
        if paired:
            best, current = paired
        elif not improved:
            break
    feasible = [p for p in ev.cache.values() if p is not None]
    if best is None or not feasible:
        raise NoPlanFits(_closest_miss(ev.rejected, cluster))
    ranked = sorted(_distinct(feasible), key=lambda p: p.step_s)[:top]
    return SearchResult(best=min(feasible, key=lambda p: p.step_s), best_global=best_global, ranked=ranked,
                        rejected=ev.rejected, evaluated=len(ev.cache))


def _pair_moves(ev: "_Evaluator", names: list[str], cands: list[Choice], current: dict[str, Choice], fill: str,
                best: Optional[Prediction]) -> Optional[tuple[Prediction, dict[str, Choice]]]:
    """Put two MFCs that do not depend on each other on the two halves at once (a move neither
    makes alone pays off, as each would wait for the other's half). Returns (best, current) when
    it found something faster, else None."""
    import networkx as nx

    if best is None:
        return None
    g = best.plan.graph.nx_graph  # the compiled graph's own edges
    halves = [c for c in cands if c.mesh is not None]
    found = False
    for a, b in itertools.combinations(names, 2):
        if nx.has_path(g, a, b) or nx.has_path(g, b, a):
            continue
        for ca in halves:
            for cb in halves:
                if ca.mesh == cb.mesh:
                    continue
                trial = {**current, a: ca, b: cb}
                pred = ev(_per_mfc(trial, fill))
                if pred is not None and (best is None or pred.step_s < best.step_s * (1 - 1e-9)):
                    best, current, found = pred, trial, True
    return (best, current) if found and best is not None else None


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
    feasible = [p for p in preds if p is not None]
    if not feasible:
        raise NoPlanFits(_closest_miss(ev.rejected, cluster))
    return min(feasible, key=lambda p: p.step_s)


def _strategy_of(pred: Prediction, mfc: str) -> ParallelStrategy:
    return pred.plan.placements[mfc].layout.strategy


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
