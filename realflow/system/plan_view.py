"""``--dry-run`` views of an :class:`~realflow.system.plan.ExecutionPlan`: text and PNG.

The text is meant to be read before spending hours of devices on a run: it shows
where every MFC runs (with the worker grid of each layout, so a tp group that
straddles hosts is visible), every parameter move and offload the plan implies,
where each key travels, and the collective group-creation order.
"""
from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

from realflow.api.layout import Layout

if TYPE_CHECKING:  # pragma: no cover
    from realflow.system.plan import ExecutionPlan

__all__ = ["describe_plan", "layout_grid", "placement_matrix", "draw_plan"]


def layout_grid(layout: Layout, indent: str = "") -> list[str]:
    """One line per pipeline stage: ``pp0: dp0 [w0 w1] | dp1 [w2 w3]`` (brackets = a tp group)."""
    lines = []
    for p, stage in enumerate(layout.grid()):
        cells = " | ".join(f"dp{d} [{' '.join(f'w{w}' for w in tp)}]" for d, tp in enumerate(stage))
        lines.append(f"{indent}pp{p}: {cells}")
    return lines


def placement_matrix(plan: "ExecutionPlan") -> tuple[list[str], list[int], dict[tuple[str, int], str]]:
    """(MFC names in topological order, workers, {(mfc, worker): "d<i> t<j> p<k>"}) for the workers it uses."""
    names = plan.graph.topological_order()
    cells = {}
    for name in names:
        lay = plan.placements[name].layout
        for w in lay.workers:
            d, t, p = lay.coords(w)
            cells[(name, w)] = f"d{d} t{t} p{p}"
    return names, list(range(plan.n_workers)), cells


def _mfc_line(plan: "ExecutionPlan", gen_i: int, name: str) -> list[str]:
    p = plan.placements[name]
    mfc = plan.graph.mfc(name)
    where = "home layout" if p.layout == plan.role_home[p.role] else "NOT the home layout"
    lines = [f"  [{gen_i}] {name:<16} {mfc.interface_type.value:<10} role={p.role:<8} {p.layout.short()} ({where})"]
    for key in mfc.input_keys:
        src = plan.graph.producers(key)
        lines.append(f"        <- {key} from {src[0] if src else 'data set'}")
    lines += [f"        before: {h}" for h in plan.pre_hooks.get(name, ())]
    lines += [f"        after : {h}" for h in plan.post_hooks.get(name, ())]
    return lines


def describe_plan(plan: "ExecutionPlan") -> str:
    n_hooks = len(plan.hooks())
    lines = [f"ExecutionPlan: {plan.n_workers} model workers, {len(plan.role_home)} roles, "
             f"{len(plan.placements)} MFCs, {n_hooks} hooks"]
    lines.append("roles (home = where weights and optimizer live):")
    for role, lay in sorted(plan.role_home.items()):
        state = "trained" if role in plan.trained_roles else "never trained"
        if role in plan.offloaded:
            state += f"; offloaded between its MFCs (shares workers with {', '.join(plan.offloaded[role])})"
        lines.append(f"  {role:<12} {lay.short()}  {state}")
    lines.append("layouts (one line per pipeline stage; [..] = a tensor-parallel group):")
    for role, lay in plan.group_order:
        users = [n for n, p in plan.placements.items() if p.role == role and p.layout == lay]
        tag = "home" if lay == plan.role_home[role] else "MFC layout"
        lines.append(f"  {role} {lay.short()} ({tag}; MFCs: {', '.join(users) or '-'})")
        lines += layout_grid(lay, indent="      ")
    lines.append("MFCs by topological generation (hooks in the order they run):")
    for gen_i, gen in enumerate(plan.graph.topological_generations()):
        for name in gen:
            lines += _mfc_line(plan, gen_i, name)
    lines.append("data transfers (producer dp heads -> consumer workers):")
    lines += [f"  {t}" for t in plan.transfers] or ["  (none: every MFC reads only the data set)"]
    lines.append("process groups (created in this order on every worker):")
    lines += [f"  {i:>2}. {role:<12} {lay.short()}" for i, (role, lay) in enumerate(plan.group_order)]
    lines.append("parameter reallocation pairs (set up once):")
    lines += [f"  {pair}" for pair in plan.realloc_pairs] or ["  (none: every MFC runs in its role's home layout)"]
    names, workers, cells = placement_matrix(plan)
    width = max([len(n) for n in names] + [8])
    lines.append("placement (MFC x worker: data / tensor / pipeline rank):")
    lines.append("  " + " " * width + "".join(f"  {'w' + str(w):<8}" for w in workers))
    for n in names:
        lines.append(f"  {n:<{width}}" + "".join(f"  {cells.get((n, w), '.'):<8}" for w in workers))
    if plan.notes:
        lines.append("notes:")
        lines += [f"  {note}" for note in plan.notes]
    return "\n".join(lines)


def draw_plan(plan: "ExecutionPlan", path: pathlib.Path) -> pathlib.Path:
    """Two panels: the graph (nodes colored by placement) and the MFC x worker placement grid."""
    from realflow.system.plan_draw import draw_plan_figure

    g = plan.graph
    nodes = []
    for gi, gen in enumerate(g.topological_generations()):
        for row, name in enumerate(gen):
            m = g.mfc(name)
            nodes.append((name, gi, row, len(gen), f"{m.model_name}.{m.interface_type.value}"))
    ds = g.dataset_keys
    ds_edges = [(k, m.name) for m in g.mfcs for k in m.input_keys if k in ds]
    placement = {n: p.layout.short() for n, p in plan.placements.items()}
    roles = {n: p.role for n, p in plan.placements.items()}
    names, workers, cells = placement_matrix(plan)
    hooks = {n: len(plan.pre_hooks.get(n, ())) + len(plan.post_hooks.get(n, ())) for n in names}
    return draw_plan_figure(path, nodes, g.edges(), ds_edges, placement, roles, names, workers, cells, hooks)
