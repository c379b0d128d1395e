"""A lower bound on any allocation's step time: how much faster than a baseline a plan could be.

Why: "the best plan is at least 1.2x faster than the best single global strategy" can only hold
where the global strategy is more than 1.2x slower than the best possible plan. This bound says
how fast the best possible plan could be under the same cost model, so a search result can be
judged against what is attainable, not only against the baseline.

Relaxations (each can only lower the bound): every MFC is priced alone at its fastest strategy
(any dp x tp x pp on any number of devices up to the cluster's, tp within a node, generation
unpipelined as the runtime requires), with no reallocation or offload hooks, a KV cache that may
use 90% of a device, and no memory limit. The step is then at least

* the longest chain of dependent MFCs, each at its fastest (a chain runs in sequence),
* the device-seconds every MFC needs at its most frugal, spread over all devices (MFCs that run
  at once share the devices), and
* for every MFC, its earliest finish plus the device-seconds of all MFCs that depend on it,
  spread over all devices (they can only start after it: in RL graphs, everything after the
  generation).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import networkx as nx

from realflow.api.allocation import ParallelStrategy
from realflow.api.experiment import ExperimentSetup
from realflow.planner.cluster import ClusterSpec
from realflow.planner.cost import ModelFacts, mfc_cost
from realflow.planner.search import short, strategies
from realflow.planner.simulate import Prediction, Workload, works_of


@dataclass(frozen=True)
class StepBound:
    seconds: float  # no allocation's step is faster
    chain_s: float  # the longest dependent chain at each MFC's fastest
    work_s: float  # every MFC's least device-seconds over all devices
    fastest: dict[str, tuple[str, float]]  # MFC -> (its fastest strategy, seconds)


def step_lower_bound(pred: Prediction, setup: ExperimentSetup, cluster: ClusterSpec,
                     model_cfgs: dict[str, dict[str, Any]], workload: Workload) -> StepBound:
    """The bound for the experiment ``pred`` (any compiled plan of it: only its graph and the
    work of each MFC are used, not its allocation)."""
    plan = pred.plan
    works = works_of(plan, workload, setup.rollout, setup.models, model_cfgs)
    facts = {r: ModelFacts.from_hf(c) for r, c in model_cfgs.items()}
    n = cluster.n_devices
    fastest: dict[str, tuple[str, float]] = {}
    frugal: dict[str, float] = {}
    for name in plan.graph.topological_order():
        role = plan.placements[name].role
        if role not in facts:
            continue  # not priced by the simulator either (a rule reward)
        work = works[name]
        if work.kind == "generate":
            work = dataclasses.replace(work, kv_budget_bytes=0.9 * cluster.device.memory_bytes)
        best = (float("inf"), "")
        least = float("inf")
        for size in range(1, n + 1):
            if n % size:
                continue
            for s in strategies(size, cluster.devices_per_node):
                if not _valid(s, facts[role], work.kind):
                    continue
                t = mfc_cost(facts[role], s, list(range(size)), work, cluster).total
                best = min(best, (t, short(s)))
                least = min(least, t * size)
        fastest[name] = (best[1], best[0])
        frugal[name] = least
    graph = nx.DiGraph()
    for name in fastest:
        graph.add_node(name, t=fastest[name][1])
    for u, v in plan.graph.nx_graph.edges:
        if u in fastest and v in fastest:
            graph.add_edge(u, v)
    finish = _earliest_finish(graph)
    chain = max(finish.values(), default=0.0)
    work = sum(frugal.values()) / n
    # every MFC that depends on v starts after v ends: their device-seconds come after v's finish
    after = max((finish[v] + sum(frugal[d] for d in nx.descendants(graph, v)) / n for v in graph), default=0.0)
    return StepBound(max(chain, work, after), chain, work, fastest)


def _valid(s: ParallelStrategy, f: ModelFacts, kind: str) -> bool:
    if kind == "generate" and s.pp > 1:
        return False  # the runtime generates without pipelining
    return f.heads % s.tp == 0 and f.kv_heads % s.tp == 0 and s.pp <= f.layers


def _earliest_finish(graph: nx.DiGraph) -> dict[str, float]:
    """Each MFC's finish if every MFC ran at its fastest as soon as its inputs were ready."""
    best: dict[str, float] = {}
    for v in nx.topological_sort(graph):
        best[v] = graph.nodes[v]["t"] + max((best[u] for u in graph.predecessors(v)), default=0.0)
    return best
