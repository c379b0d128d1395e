"""Plan compiler: data-flow graph + allocation -> execution plan.

The plan is pure data computed identically by the master and every worker from the
same :class:`ExperimentSetup`, so no process has to ship it to another. It fixes
which workers run each MFC and in which (dp, tp, pp) layout, each role's *home*
layout (the layout of its train_step, where its weights and optimizer live), and
the order in which per-layout process groups are created (a collective that every
worker must perform in the same order).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from realflow.api.allocation import ParallelStrategy, parse_allocation
from realflow.api.dfg import DataFlowGraph
from realflow.api.experiment import ExperimentSetup
from realflow.api.mfc import ModelInterfaceType


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

    def dp_members(self, dp_rank: int) -> list[int]:
        """Every worker that belongs to data-parallel rank ``dp_rank``."""
        return [w for w in self.workers if self.coords(w)[0] == dp_rank]

    def dp_head(self, dp_rank: int) -> int:
        """The worker that holds the outputs of ``dp_rank``: tp rank 0 of the last stage."""
        s = self.strategy
        return self.workers[(s.pp - 1) * s.tp * s.dp + dp_rank * s.tp]

    def short(self) -> str:
        s = self.strategy
        return f"d{s.dp}t{s.tp}p{s.pp}@{list(self.workers)}"


@dataclass
class MFCPlacement:
    mfc: str
    role: str
    layout: Layout


@dataclass
class ExecutionPlan:
    graph: DataFlowGraph
    n_workers: int
    placements: dict[str, MFCPlacement]
    role_home: dict[str, Layout]
    group_order: list[tuple[str, Layout]] = field(default_factory=list)

    def workers_of_role(self, role: str) -> tuple[int, ...]:
        return self.role_home[role].workers

    def describe(self) -> str:
        """Human-readable plan for ``--dry-run``."""
        lines = [f"ExecutionPlan: {self.n_workers} model workers"]
        lines.append("  roles (home layout = where weights and optimizer live):")
        for role, lay in sorted(self.role_home.items()):
            lines.append(f"    {role:<12} {lay.short()}")
        lines.append("  MFCs by topological generation:")
        for gen_i, gen in enumerate(self.graph.topological_generations()):
            for name in gen:
                p = self.placements[name]
                mfc = self.graph.mfc(name)
                moves = "no reallocation" if p.layout == self.role_home[p.role] else "REALLOCATE"
                lines.append(
                    f"    [{gen_i}] {name:<16} {mfc.interface_type.name.lower():<10} role={p.role:<8}"
                    f" {p.layout.short()} ({moves})"
                )
                for key in mfc.input_keys:
                    src = self.graph.producers(key)
                    lines.append(f"          <- {key} from {src[0] if src else 'dataset'}")
        lines.append("  process groups (created in this order on every worker):")
        for role, lay in self.group_order:
            lines.append(f"    {role:<12} {lay.short()}")
        return "\n".join(lines)


def compile_plan(setup: ExperimentSetup, graph: DataFlowGraph | None = None) -> ExecutionPlan:
    """Turn ``setup`` into an :class:`ExecutionPlan`, or raise :class:`PlanError`."""
    if graph is None:
        graph = build_graph(setup)
    names = [m.name for m in setup.mfcs]
    alloc = parse_allocation(setup.allocation, names, setup.n_workers)
    placements: dict[str, MFCPlacement] = {}
    for mfc in setup.mfcs:
        if mfc.model_name not in setup.models:
            raise PlanError(
                f"MFC '{mfc.name}' runs on model '{mfc.model_name}', which the experiment does not "
                f"define (models: {sorted(setup.models)})"
            )
        mesh, strategy = alloc[mfc.name]
        workers = tuple(mesh.workers)
        if strategy.dp * strategy.tp * strategy.pp != len(workers):
            raise PlanError(
                f"MFC '{mfc.name}': strategy {strategy} needs {strategy.dp * strategy.tp * strategy.pp}"
                f" workers but its mesh has {len(workers)}"
            )
        placements[mfc.name] = MFCPlacement(mfc.name, mfc.model_name, Layout(workers, strategy))

    role_home: dict[str, Layout] = {}
    for mfc in setup.mfcs:  # a role's home is its train_step layout ...
        if mfc.interface_type == ModelInterfaceType.TRAIN_STEP:
            role_home[mfc.model_name] = placements[mfc.name].layout
    for mfc in setup.mfcs:  # ... or, if never trained, the layout of its first MFC
        role_home.setdefault(mfc.model_name, placements[mfc.name].layout)
    for mfc in setup.mfcs:
        p = placements[mfc.name]
        if p.layout != role_home[p.role]:
            raise PlanError(
                f"MFC '{mfc.name}' runs role '{p.role}' in layout {p.layout.short()} but the role lives in "
                f"{role_home[p.role].short()}; moving parameters between layouts is not supported yet"
            )
    if setup.eval is not None and setup.eval.role not in role_home:
        raise PlanError(f"evaluation role '{setup.eval.role}' is not used by any MFC")
    group_order = [(role, role_home[role]) for role in sorted(role_home)]
    return ExecutionPlan(graph, setup.n_workers, placements, role_home, group_order)


def build_graph(setup: ExperimentSetup) -> DataFlowGraph:
    from realflow.api.data_source import dataset_keys

    return DataFlowGraph(setup.mfcs, dataset_keys=set(dataset_keys(setup.dataset)))
