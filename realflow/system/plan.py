"""Plan compiler: data-flow graph + allocation -> execution plan.

The plan is pure data computed identically by the master and every worker from the
same :class:`ExperimentSetup`, so no process has to ship it to another. It fixes
which workers run each MFC and in which (dp, tp, pp) layout, each role's *home*
layout (the layout of its train_step, where its weights and optimizer live), the
hooks around each MFC (parameter reallocation, offload / reload; rules in
:mod:`realflow.system.plan_hooks`), the data transfers of each graph edge, and the
order in which per-layout process groups are created (a collective that every
worker must perform in the same order).

Every MFC layout is also checked against its model by the role's backend (heads
vs tp, layers vs pp, memory), so a layout that cannot work fails here, naming the
MFC and the numbers, rather than inside megatron on some worker.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional

from realflow.api.allocation import parse_allocation
from realflow.api.backend import model_backends
from realflow.api.dfg import DataFlowGraph
from realflow.api.experiment import ExperimentSetup
from realflow.api.layout import Layout
from realflow.api.mfc import ModelInterfaceType
from realflow.api.registry import RegistryError
from realflow.system.plan_hooks import (
    attach_hooks, data_transfers, group_order, offloaded_roles, realloc_pairs, role_homes,
)
from realflow.system.plan_types import (
    DataTransfer, Hook, MFCPlacement, Offload, ParamRealloc, PlanError, ReallocPair, Reload,
)

__all__ = ["PlanError", "Layout", "MFCPlacement", "ExecutionPlan", "compile_plan", "build_graph",
           "ParamRealloc", "Offload", "Reload", "DataTransfer", "ReallocPair"]


@dataclass
class ExecutionPlan:
    graph: DataFlowGraph
    n_workers: int
    placements: dict[str, MFCPlacement]
    role_home: dict[str, Layout]
    group_order: list[tuple[str, Layout]] = field(default_factory=list)
    pre_hooks: dict[str, tuple[Hook, ...]] = field(default_factory=dict)
    post_hooks: dict[str, tuple[Hook, ...]] = field(default_factory=dict)
    transfers: list[DataTransfer] = field(default_factory=list)
    realloc_pairs: list[ReallocPair] = field(default_factory=list)
    offloaded: dict[str, list[str]] = field(default_factory=dict)  # role -> roles it shares workers with
    trained_roles: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)  # what could not be checked (e.g. dry run before prepare)

    def workers_of_role(self, role: str) -> tuple[int, ...]:
        return self.role_home[role].workers

    def hooks(self) -> list[tuple[str, str, Hook]]:
        """``(mfc, "before" | "after", hook)`` in execution order (topological, pre then post)."""
        out = []
        for name in self.graph.topological_order():
            out += [(name, "before", h) for h in self.pre_hooks.get(name, ())]
            out += [(name, "after", h) for h in self.post_hooks.get(name, ())]
        return out

    @property
    def needs_hooks(self) -> bool:
        """True when running this plan needs parameter reallocation or offload."""
        return bool(self.hooks())

    def describe(self) -> str:
        """Human-readable plan for ``--dry-run``."""
        from realflow.system.plan_view import describe_plan

        return describe_plan(self)

    def draw(self, path_png: str | pathlib.Path) -> pathlib.Path:
        """PNG with the graph (colored by placement) and the worker x MFC placement grid."""
        from realflow.system.plan_view import draw_plan

        return draw_plan(self, pathlib.Path(path_png))


def compile_plan(setup: ExperimentSetup, graph: DataFlowGraph | None = None,
                 capacity_bytes: Optional[int] = None) -> ExecutionPlan:
    """Turn ``setup`` into an :class:`ExecutionPlan`, or raise :class:`PlanError`.

    Allocation-string errors raise :class:`~realflow.api.allocation.AllocationError`
    (a ``ValueError`` too) with the grammar. ``capacity_bytes``: a worker's memory for the
    layout checks when the plan is for another machine (the planner's simulated clusters);
    None = this machine's.
    """
    if graph is None:
        graph = build_graph(setup)
    for mfc in graph.mfcs:
        if mfc.model_name not in setup.models:
            raise PlanError(
                f"MFC '{mfc.name}' runs on model '{mfc.model_name}', which the experiment does not "
                f"define (models: {sorted(setup.models)})"
            )
    alloc = parse_allocation(setup.allocation, graph.mfcs, setup.n_workers)
    placements = {
        m.name: MFCPlacement(m.name, m.model_name, Layout(tuple(alloc[m.name].mesh.workers), alloc[m.name].strategy))
        for m in graph.mfcs
    }
    homes = role_homes(graph, placements)
    if setup.eval is not None and setup.eval.role not in homes:
        raise PlanError(f"evaluation role '{setup.eval.role}' is not used by any MFC")
    notes: list[str] = []
    backends = {role: _backend(setup, role) for role in graph.roles()}
    _check_layouts(setup, graph, placements, homes, backends, notes, capacity_bytes)

    def arch_check(src: str, dst: str) -> Optional[str]:
        check = getattr(backends[src], "check_same_architecture", None)
        if check is None:
            return f"backend '{setup.models[src].backend}' cannot compare architectures; not checked"
        return check(setup.models[src], setup.models[dst])

    pre, post = attach_hooks(graph, setup, placements, homes, arch_check, notes)
    return ExecutionPlan(
        graph=graph,
        n_workers=setup.n_workers,
        placements=placements,
        role_home=homes,
        group_order=group_order(graph, placements, homes),
        pre_hooks=pre,
        post_hooks=post,
        transfers=data_transfers(graph, placements),
        realloc_pairs=realloc_pairs(graph, pre, post),
        offloaded=offloaded_roles(graph, placements, homes),
        trained_roles=tuple(r for r in graph.roles() if graph.train_mfc(r) is not None),
        notes=notes,
    )


def _backend(setup: ExperimentSetup, role: str) -> Any:
    name = setup.models[role].backend
    try:
        return model_backends.get(name)()
    except RegistryError as e:
        raise PlanError(f"model '{role}': {e}") from None


def _check_layouts(setup: ExperimentSetup, graph: DataFlowGraph, placements: dict[str, MFCPlacement],
                   homes: dict[str, Layout], backends: dict[str, Any], notes: list[str],
                   capacity_bytes: Optional[int] = None) -> None:
    """Ask each role's backend whether every MFC layout of the role can work (once per distinct layout).

    A layout is checked as trained when it is the home of a trained role: that is where
    the gradients and optimizer states live, whichever MFC runs there.
    """
    # all workers of a local run share one host; a multi-host launcher would pass its own count
    per_host = setup.n_workers
    done: set[tuple[str, Any, bool]] = set()
    for name in graph.topological_order():
        p = placements[name]
        if graph.mfc(name).interface_type == ModelInterfaceType.GENERATE and p.layout.strategy.pp > 1 \
                and setup.models[p.role].backend != "none":
            # autoregressive decoding here is one forward per token over the whole model: the
            # generation engines (built-in and SGLang) take tp and dp, never pipeline stages
            raise PlanError(f"MFC '{name}' generates, and generation does not pipeline: its layout "
                            f"{p.layout.short()} has pp={p.layout.strategy.pp}; give it pp=1 "
                            f"(e.g. '{name}:d{p.layout.strategy.dp * p.layout.strategy.pp}t{p.layout.strategy.tp},...')")
        trained = graph.train_mfc(p.role) is not None and p.layout == homes[p.role]
        key = (p.role, p.layout.strategy, trained)
        if key in done:
            continue
        done.add(key)
        check = getattr(backends[p.role], "check_layout", None)
        if check is None:
            notes.append(f"backend '{setup.models[p.role].backend}' of role '{p.role}' does not check layouts")
            continue
        try:
            extra = {} if capacity_bytes is None else {"capacity_bytes": capacity_bytes}
            note = check(setup.models[p.role], p.layout.strategy, trained, per_host, **extra)
        except ValueError as e:
            raise PlanError(f"MFC '{name}' (role '{p.role}', layout {p.layout.short()}): {e}") from None
        if note and note not in notes:
            notes.append(note)


def build_graph(setup: ExperimentSetup) -> DataFlowGraph:
    """The graph of ``setup``; its source keys are the data set's, or the trajectory stream's
    when the run is asynchronous (:data:`realflow.api.rollout.TRAJECTORY_KEYS` and versions)."""
    if setup.rollout is not None:
        from realflow.api.rollout import (OPTIONAL_TRAJECTORY_KEYS, TRAJECTORY_KEYS, VERSION_ADMIT, VERSION_NEWEST,
                                          VERSION_OLDEST)

        keys = {*TRAJECTORY_KEYS, *OPTIONAL_TRAJECTORY_KEYS, VERSION_ADMIT, VERSION_OLDEST, VERSION_NEWEST, "answer"}
        return DataFlowGraph(setup.mfcs, dataset_keys=keys)
    from realflow.data.source import dataset_keys

    return DataFlowGraph(setup.mfcs, dataset_keys=set(dataset_keys(setup.dataset)))
