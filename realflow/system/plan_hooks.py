"""What must happen around each MFC, derived from placements: the plan compiler's hook rules.

A role's parameters live in its *home* layout (its train_step's, where the optimizer
is; or its first MFC's if it is never trained). Rules, in the order the hooks run:

before an MFC
  1. declared ``ParamReallocHook`` s of its ``pre_hooks`` (home -> home of another role);
  2. ``Reload`` of the role if it was offloaded after its previous MFC;
  3. ``ParamRealloc`` home -> the MFC's layout, only when the two differ.
after an MFC
  1. ``ParamRealloc`` back home, only when the layouts differ AND the role is trained
     (a never-trained role's home copy is still valid, so nothing moves back);
  2. ``Offload`` of the role (every layout it occupies now) when the role is never
     trained and shares a worker with another role, or the MFC declares an ``OffloadHook``;
  3. declared ``ParamReallocHook`` s of its ``post_hooks`` (e.g. actor -> ref, eta < 1: EMA).

Declared hooks act between home layouts, after the automatic ones have put every
role back home, so an EMA never reads a transient generation-layout copy.
"""
from __future__ import annotations

from typing import Callable, Optional

from realflow.api.dfg import DataFlowGraph
from realflow.api.experiment import ExperimentSetup
from realflow.api.layout import Layout
from realflow.api.mfc import MFCDef, OffloadHook, ParamReallocHook
from realflow.api.registry import did_you_mean
from realflow.system.plan_types import (
    DataTransfer, Hook, MFCPlacement, Offload, ParamRealloc, PlanError, ReallocPair, Reload,
)

__all__ = ["role_homes", "offloaded_roles", "attach_hooks", "data_transfers", "group_order", "realloc_pairs"]

ArchCheck = Callable[[str, str], Optional[str]]  # (source role, target role) -> note; raises on mismatch


def role_homes(graph: DataFlowGraph, placements: dict[str, MFCPlacement]) -> dict[str, Layout]:
    """Each role's home: its train_step's layout, else the layout of its first MFC (declaration order)."""
    homes: dict[str, Layout] = {}
    for role in graph.roles():
        first = graph.train_mfc(role) or graph.mfcs_of_role(role)[0]
        homes[role] = placements[first].layout
    return homes


def _role_workers(placements: dict[str, MFCPlacement], homes: dict[str, Layout]) -> dict[str, set[int]]:
    out = {role: set(home.workers) for role, home in homes.items()}
    for p in placements.values():
        out[p.role] |= set(p.layout.workers)
    return out


def offloaded_roles(graph: DataFlowGraph, placements: dict[str, MFCPlacement],
                    homes: dict[str, Layout]) -> dict[str, list[str]]:
    """Never-trained roles that share a worker with another role -> the roles they share with."""
    workers = _role_workers(placements, homes)
    out: dict[str, list[str]] = {}
    for role in graph.roles():
        if graph.train_mfc(role) is not None:
            continue
        sharing = [r for r in graph.roles() if r != role and workers[r] & workers[role]]
        if sharing:
            out[role] = sharing
    return out


def _declared_realloc(mfc: MFCDef, hook: ParamReallocHook, where: str, homes: dict[str, Layout],
                      setup: ExperimentSetup, arch_check: ArchCheck, notes: list[str]) -> ParamRealloc:
    for what, role in (("source_role", hook.source_role), ("target_role", hook.target_role)):
        if role not in homes:
            raise PlanError(
                f"MFC '{mfc.name}': {where} ParamReallocHook {what} '{role}' is not a role of any MFC"
                f"{did_you_mean(role, list(homes))} (roles: {sorted(homes)})"
            )
    src, dst = hook.source_role, hook.target_role
    if src == dst:
        raise PlanError(f"MFC '{mfc.name}': {where} ParamReallocHook moves role '{src}' onto itself")
    a, b = setup.models[src], setup.models[dst]
    if a.backend != b.backend:
        raise PlanError(f"MFC '{mfc.name}': ParamReallocHook {src} -> {dst}: the roles use different backends "
                        f"('{a.backend}' vs '{b.backend}'); parameters cannot move between them")
    if a.path != b.path:
        try:
            note = arch_check(src, dst)
        except ValueError as e:
            raise PlanError(f"MFC '{mfc.name}': ParamReallocHook {src} -> {dst}: {e}") from None
        if note:
            notes.append(f"MFC '{mfc.name}': ParamReallocHook {src} -> {dst}: {note}")
    return ParamRealloc(src, homes[src], dst, homes[dst], float(hook.eta), "declared")


def attach_hooks(graph: DataFlowGraph, setup: ExperimentSetup, placements: dict[str, MFCPlacement],
                 homes: dict[str, Layout], arch_check: ArchCheck, notes: list[str],
                 ) -> tuple[dict[str, tuple[Hook, ...]], dict[str, tuple[Hook, ...]]]:
    """(pre hooks, post hooks) per MFC name, following the module's rules."""
    auto_offload = offloaded_roles(graph, placements, homes)
    order = graph.topological_order()
    declared_offload: set[str] = set()
    for name in order:
        mfc = graph.mfc(name)
        if any(isinstance(h, OffloadHook) for h in mfc.pre_hooks):
            raise PlanError(f"MFC '{name}': OffloadHook belongs in post_hooks (a model is offloaded after it ran)")
        if any(isinstance(h, OffloadHook) for h in mfc.post_hooks):
            declared_offload.add(name)
    offload_after = {n for n in order if graph.mfc(n).model_name in auto_offload} | declared_offload
    # a role offloaded after one of its MFCs is reloaded before its next one (cyclically: next step)
    reload_before: set[str] = set()
    for role in graph.roles():
        mine = [n for n in order if graph.mfc(n).model_name == role]
        for i, n in enumerate(mine):
            if n in offload_after:
                reload_before.add(mine[(i + 1) % len(mine)])

    pre: dict[str, tuple[Hook, ...]] = {}
    post: dict[str, tuple[Hook, ...]] = {}
    for name in order:
        mfc, p = graph.mfc(name), placements[name]
        role, layout, home = p.role, p.layout, homes[p.role]
        trained = graph.train_mfc(role) is not None
        before: list[Hook] = [
            _declared_realloc(mfc, h, "pre_hooks", homes, setup, arch_check, notes)
            for h in mfc.pre_hooks if isinstance(h, ParamReallocHook)
        ]
        if name in reload_before:
            before.append(Reload(role, home, "offloaded after its previous MFC"))
        if layout != home:
            before.append(ParamRealloc(role, home, role, layout, 1.0, "to MFC layout"))
        after: list[Hook] = []
        if layout != home and trained:
            after.append(ParamRealloc(role, layout, role, home, 1.0, "back home"))
        if name in offload_after:
            why = ("declared OffloadHook" if name in declared_offload
                   else f"never trained, shares workers with {', '.join(auto_offload[role])}")
            held = [home] if trained or layout == home else [layout, home]
            after.extend(Offload(role, lay, why) for lay in held)
        after.extend(_declared_realloc(mfc, h, "post_hooks", homes, setup, arch_check, notes)
                     for h in mfc.post_hooks if isinstance(h, ParamReallocHook))
        pre[name], post[name] = tuple(before), tuple(after)
    return pre, post


def data_transfers(graph: DataFlowGraph, placements: dict[str, MFCPlacement]) -> list[DataTransfer]:
    """One step per (edge, key): the producer's dp heads -> every worker of the consumer."""
    out = []
    for producer, consumer, keys in graph.edges():
        src = placements[producer].layout.dp_heads()
        dst = placements[consumer].layout.workers
        out.extend(DataTransfer(k, producer, consumer, src, dst) for k in keys)
    return out


def group_order(graph: DataFlowGraph, placements: dict[str, MFCPlacement],
                homes: dict[str, Layout]) -> list[tuple[str, Layout]]:
    """Every (role, layout) whose process groups each worker creates, in one deterministic order.

    Home layouts first (by role name), then the other MFC layouts in topological order;
    each pair once. Group creation is collective over all workers, so this order must be
    (and is: it depends only on the setup) the same everywhere.
    """
    order = [(role, homes[role]) for role in sorted(homes)]
    for name in graph.topological_order():
        p = placements[name]
        if (p.role, p.layout) not in order:
            order.append((p.role, p.layout))
    return order


def realloc_pairs(graph: DataFlowGraph, pre: dict[str, tuple[Hook, ...]],
                  post: dict[str, tuple[Hook, ...]]) -> list[ReallocPair]:
    """Distinct (source, destination) reallocations in the order they first run."""
    out: list[ReallocPair] = []
    for name in graph.topological_order():
        for h in (*pre[name], *post[name]):
            if isinstance(h, ParamRealloc):
                pair = ReallocPair(h.src_role, h.src, h.dst_role, h.dst)
                if pair not in out:
                    out.append(pair)
    return out
