"""The data flow graph: MFCs as nodes, keys as edges.

Edges are not declared; they follow from keys.  An MFC that lists ``k`` in its
``input_keys`` depends on the single MFC that lists ``k`` in its
``output_keys`` (or on the data set, when ``k`` is a data set key).  Because
the whole execution plan is derived from this, the graph is checked when it
is built and every error names the MFC(s) and key(s) involved:

* empty or duplicate MFC names, invalid MFC fields;
* a key produced twice (two MFCs, or an MFC and the data set);
* an input key that no MFC produces and the data set lacks;
* more than one ``train_step`` MFC per role;
* a cycle (named as ``a -[key]-> b -[key]-> a``).

Graph builders (config -> ``[MFCDef]``) register here by name.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import networkx as nx

from realflow.api.mfc import MFCDef, MFCDefError, ModelInterfaceType
from realflow.api.registry import Registry, did_you_mean

__all__ = ["GraphError", "DataFlowGraph", "DATASET", "graph_registry", "register_graph", "build_graph"]

DATASET = "dataset"
"""Producer name used for keys that come from the data set (in summaries and drawings)."""

GraphBuilder = Callable[..., list[MFCDef]]
graph_registry: Registry[GraphBuilder] = Registry("graph builder")


def register_graph(name: str) -> Callable[[GraphBuilder], GraphBuilder]:
    """Decorator: register a graph builder, a function ``(config values...) -> list[MFCDef]``."""
    return graph_registry.register(name)


class GraphError(ValueError):
    """An invalid data flow graph; ``problems`` lists every issue found at the failing stage."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid data flow graph: " + "; ".join(self.problems))


class DataFlowGraph:
    """A validated DAG of :class:`MFCDef` nodes (see the module docstring)."""

    def __init__(self, mfcs: Sequence[MFCDef], dataset_keys: Iterable[str] = ()) -> None:
        mfcs = list(mfcs)
        dataset_keys = set(dataset_keys)
        self._check_nodes(mfcs, dataset_keys)
        self._mfcs: dict[str, MFCDef] = {m.name: m for m in mfcs}
        self._order = {m.name: i for i, m in enumerate(mfcs)}
        self._dataset_keys = frozenset(dataset_keys)
        self._producer: dict[str, str] = {}
        self._check_keys(mfcs)
        g = nx.DiGraph()
        for m in mfcs:
            g.add_node(m.name)
        for m in mfcs:
            for k in m.input_keys:
                src = self._producer.get(k)
                if src is None:
                    continue
                if g.has_edge(src, m.name):
                    g.edges[src, m.name]["keys"] += (k,)
                else:
                    g.add_edge(src, m.name, keys=(k,))
        self._g = g
        self._check_cycles()

    # ---- validation ---------------------------------------------------------------------------

    @staticmethod
    def _check_nodes(mfcs: list[MFCDef], dataset_keys: set[str]) -> None:
        problems: list[str] = []
        if not mfcs:
            problems.append("the graph has no MFCs")
        seen: dict[str, int] = {}
        for i, m in enumerate(mfcs):
            if not isinstance(m, MFCDef):
                problems.append(f"entry {i} is a {type(m).__name__}, not an MFCDef")
                continue
            try:
                m.validate()
            except MFCDefError as e:
                problems.append(str(e))
                continue
            if m.name in seen:
                problems.append(f"duplicate MFC name {m.name!r} (entries {seen[m.name]} and {i})")
            seen.setdefault(m.name, i)
        for k in sorted(dataset_keys, key=str):
            if not isinstance(k, str) or not k.strip():
                problems.append(f"data set key {k!r} is empty or not a str")
        if problems:
            raise GraphError(problems)

    def _check_keys(self, mfcs: list[MFCDef]) -> None:
        problems: list[str] = []
        producers: dict[str, list[str]] = {}
        for m in mfcs:
            for k in m.output_keys:
                producers.setdefault(k, []).append(m.name)
        for k, names in producers.items():
            if len(names) > 1:
                problems.append(f"key {k!r} is produced by more than one MFC: {', '.join(map(repr, names))}")
            if k in self._dataset_keys:
                problems.append(f"key {k!r} is produced by MFC {names[0]!r} and also comes from the data set")
            self._producer[k] = names[0]
        known = set(producers) | self._dataset_keys
        for m in mfcs:
            for k in m.input_keys:
                if k not in known:
                    problems.append(
                        f"MFC {m.name!r} needs key {k!r}, which no MFC produces and the data set lacks"
                        + did_you_mean(k, known, sep=" ")
                    )
        trainers: dict[str, list[str]] = {}
        for m in mfcs:
            if m.interface_type is ModelInterfaceType.TRAIN_STEP:
                trainers.setdefault(m.model_name, []).append(m.name)
        for role, names in trainers.items():
            if len(names) > 1:
                problems.append(
                    f"role {role!r} has more than one train_step MFC: {', '.join(map(repr, names))} (at most one per role)"
                )
        if problems:
            raise GraphError(problems)

    def _check_cycles(self) -> None:
        try:
            cycle = nx.find_cycle(self._g)
        except nx.NetworkXNoCycle:
            return
        path = cycle[0][0]
        for u, v in cycle:
            path += f" -[{','.join(self._g.edges[u, v]['keys'])}]-> {v}"
        names = sorted({u for u, _ in cycle}, key=self._order.__getitem__)
        raise GraphError(f"cycle between MFCs {', '.join(map(repr, names))}: {path}")

    def check_references(self, roles: Iterable[str] | None = None, interfaces: Any = None) -> None:
        """Check that roles are known (when ``roles`` is given) and interfaces are registered.

        Separate from construction because registrations happen when plugin
        modules are imported, which the entry point does after building configs.
        ``interfaces`` defaults to the global interface registry.
        """
        if interfaces is None:
            from realflow.api.interface import interface_registry

            interfaces = interface_registry
        known_roles = None if roles is None else set(roles)
        problems: list[str] = []
        for m in self._mfcs.values():
            if known_roles is not None and m.model_name not in known_roles:
                problems.append(
                    f"MFC {m.name!r} uses unknown role {m.model_name!r}"
                    + did_you_mean(m.model_name, known_roles, sep=" ") + f" (roles: {sorted(known_roles)})"
                )
            if m.interface_impl not in interfaces:
                problems.append(
                    f"MFC {m.name!r} uses unregistered interface {m.interface_impl!r}"
                    + did_you_mean(m.interface_impl, list(interfaces), sep=" ") + " (plugins load with --import MODULE)"
                )
        if problems:
            raise GraphError(problems)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def mfcs(self) -> list[MFCDef]:
        """MFCs in declaration order."""
        return list(self._mfcs.values())

    @property
    def names(self) -> list[str]:
        return list(self._mfcs)

    @property
    def dataset_keys(self) -> frozenset[str]:
        return self._dataset_keys

    @property
    def nx_graph(self) -> nx.DiGraph:
        """A copy of the underlying networkx graph (edge attribute ``keys``)."""
        return self._g.copy()

    def __len__(self) -> int:
        return len(self._mfcs)

    def __iter__(self) -> Iterator[MFCDef]:
        return iter(self.mfcs)

    def __contains__(self, name: object) -> bool:
        return name in self._mfcs

    def mfc(self, name: str) -> MFCDef:
        """The MFC called ``name``; unknown names raise :class:`GraphError` with suggestions."""
        if name not in self._mfcs:
            raise GraphError(f"no MFC named {name!r}" + did_you_mean(name, self.names) + f" (MFCs: {self.names})")
        return self._mfcs[name]

    def all_keys(self) -> set[str]:
        """Every key in the graph: data set keys and every MFC output."""
        return set(self._dataset_keys) | set(self._producer)

    def _require_key(self, key: str) -> None:
        used = self.all_keys() | {k for m in self._mfcs.values() for k in m.input_keys}
        if key not in used:
            raise GraphError(f"unknown key {key!r}" + did_you_mean(key, used))

    def producers(self, key: str) -> list[str]:
        """Names of the MFCs producing ``key``: one, or none for a data set key."""
        self._require_key(key)
        return [self._producer[key]] if key in self._producer else []

    def consumers(self, key: str) -> list[str]:
        """Names of the MFCs reading ``key``, in declaration order."""
        self._require_key(key)
        return [m.name for m in self._mfcs.values() if key in m.input_keys]

    def dataset_inputs(self, name: str) -> tuple[str, ...]:
        """The input keys of MFC ``name`` that come straight from the data set."""
        return tuple(k for k in self.mfc(name).input_keys if k in self._dataset_keys)

    def final_keys(self) -> list[str]:
        """Outputs no MFC consumes (results the master only logs or drops)."""
        consumed = {k for m in self._mfcs.values() for k in m.input_keys}
        return [k for m in self._mfcs.values() for k in m.output_keys if k not in consumed]

    def edges(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """``(producer, consumer, keys)`` for each MFC -> MFC dependency, in declaration order."""
        out = [(u, v, tuple(d["keys"])) for u, v, d in self._g.edges(data=True)]
        return sorted(out, key=lambda e: (self._order[e[0]], self._order[e[1]]))

    def predecessors(self, name: str) -> list[str]:
        self.mfc(name)
        return sorted(self._g.predecessors(name), key=self._order.__getitem__)

    def successors(self, name: str) -> list[str]:
        self.mfc(name)
        return sorted(self._g.successors(name), key=self._order.__getitem__)

    def topological_generations(self) -> list[list[str]]:
        """MFC names grouped by depth: each MFC's producers are in earlier groups (declaration order inside)."""
        return [sorted(gen, key=self._order.__getitem__) for gen in nx.topological_generations(self._g)]

    def topological_order(self) -> list[str]:
        return [n for gen in self.topological_generations() for n in gen]

    def roles(self) -> list[str]:
        """Model roles in order of first appearance."""
        return list(dict.fromkeys(m.model_name for m in self._mfcs.values()))

    def mfcs_of_role(self, role: str) -> list[str]:
        return [m.name for m in self._mfcs.values() if m.model_name == role]

    def train_mfc(self, role: str) -> str | None:
        """The name of ``role``'s train_step MFC, or None if the role is never trained."""
        return next((m.name for m in self._mfcs.values() if m.model_name == role and m.is_train), None)

    # ---- presentation -------------------------------------------------------------------------

    def summary(self) -> str:
        """A plain-text description: MFCs by generation, their keys, edges and final keys."""
        lines = [
            f"DataFlowGraph: {len(self)} MFCs, roles {self.roles()}, "
            f"data set keys {sorted(self._dataset_keys)}"
        ]
        for gi, gen in enumerate(self.topological_generations()):
            lines.append(f"generation {gi}:")
            for name in gen:
                m = self._mfcs[name]
                ins = ", ".join(f"{k} <- {self._producer.get(k, DATASET)}" for k in m.input_keys) or "-"
                lines.append(
                    f"  {name}: {m.model_name}.{m.interface_type.value} [{m.interface_impl}] "
                    f"n_seqs={m.n_seqs} mbs={m.mb_spec.n_mbs}"
                )
                lines.append(f"    in : {ins}")
                lines.append(f"    out: {', '.join(m.output_keys) or '-'}")
        lines.append("edges:")
        for u, v, keys in self.edges():
            lines.append(f"  {u} -> {v}: {', '.join(keys)}")
        if not self.edges():
            lines.append("  (none)")
        lines.append(f"final keys: {', '.join(self.final_keys()) or '-'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DataFlowGraph({self.names}, dataset_keys={sorted(self._dataset_keys)})"



def build_graph(builder: str, *args: Any, dataset_keys: Iterable[str] = (), **kwargs: Any) -> DataFlowGraph:
    """Look up a registered graph builder, call it and validate its MFCs as a graph."""
    mfcs = graph_registry.get(builder)(*args, **kwargs)
    return DataFlowGraph(mfcs, dataset_keys)
