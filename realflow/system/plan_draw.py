"""Matplotlib rendering of a data flow graph (:func:`draw_dataflow`) and of an execution plan.

Uses ``Figure`` + the Agg canvas directly instead of pyplot, so drawing never
touches the process-wide backend or needs a display.  Nodes are laid out one
column per topological generation; an edge bends (deterministically) when a
straight arrow would cross another node. ``draw_plan_figure`` adds a panel with
the MFC x worker placement grid below the graph (``--dry-run``).
"""
from __future__ import annotations

import pathlib

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from realflow.api.dfg import DataFlowGraph, GraphError
from realflow.api.registry import did_you_mean

_PALETTE = ["#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c", "#e31a1c", "#ff7f00"]
_BENDS = (0.0, 0.2, -0.2, 0.35, -0.35, 0.5, -0.5)
_DS = "__dataset__"


def _bezier(p0, c, p1, t):
    return ((1 - t) ** 2 * p0[0] + 2 * (1 - t) * t * c[0] + t * t * p1[0],
            (1 - t) ** 2 * p0[1] + 2 * (1 - t) * t * c[1] + t * t * p1[1])


def _control(p0, p1, rad):
    """The control point matplotlib's ``arc3,rad=...`` uses (display coordinates)."""
    (x0, y0), (x1, y1) = p0, p1
    return ((x0 + x1) / 2 + rad * (y1 - y0), (y0 + y1) / 2 - rad * (x1 - x0))


def draw_dataflow(graph: DataFlowGraph, path_png: str | pathlib.Path,
                  placement: dict[str, str] | None = None) -> pathlib.Path:
    """Draw ``graph`` to a PNG, one column per topological generation (deterministic layout).

    ``placement`` maps MFC name -> a short label (e.g. ``"w0-3 d2t2"``); MFCs
    with the same label get the same color, so colocation is visible.
    Without it, colors follow roles.
    """
    placement = dict(placement or {})
    for name in placement:
        if name not in graph.names:
            raise GraphError(f"placement names unknown MFC {name!r}" + did_you_mean(name, graph.names))
    nodes = []
    for gi, gen in enumerate(graph.topological_generations()):
        for row, name in enumerate(gen):
            m = graph.mfc(name)
            nodes.append((name, gi, row, len(gen), f"{m.model_name}.{m.interface_type.value}"))
    ds_edges = [(k, m.name) for m in graph.mfcs for k in m.input_keys if k in graph.dataset_keys]
    return draw_graph(pathlib.Path(path_png), nodes, graph.edges(), ds_edges, placement,
                      {m.name: m.model_name for m in graph.mfcs})


def draw_graph(
    path: pathlib.Path,
    nodes: list[tuple[str, int, int, int, str]],
    edges: list[tuple[str, str, tuple[str, ...]]],
    dataset_edges: list[tuple[str, str]],
    placement: dict[str, str],
    roles: dict[str, str],
) -> pathlib.Path:
    """``nodes``: (name, generation, row, rows in generation, subtitle). Returns ``path``."""
    n_cols, max_rows = _graph_extent(nodes, dataset_edges)
    fig = Figure(figsize=(3.0 * n_cols + 0.8, 1.6 * max_rows + 1.8), dpi=100)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.9))
    _graph_panel(canvas, ax, nodes, edges, dataset_edges, placement, roles)
    return _save(fig, path)


def draw_plan_figure(
    path: pathlib.Path,
    nodes: list[tuple[str, int, int, int, str]],
    edges: list[tuple[str, str, tuple[str, ...]]],
    dataset_edges: list[tuple[str, str]],
    placement: dict[str, str],
    roles: dict[str, str],
    mfcs: list[str],
    workers: list[int],
    cells: dict[tuple[str, int], str],
    hooks: dict[str, int],
) -> pathlib.Path:
    """The graph on top; below it the MFC x worker grid (cell = the worker's dp/tp/pp rank, color = role).

    ``hooks``: MFC -> number of reallocation/offload hooks around it (shown next to its name).
    """
    n_cols, max_rows = _graph_extent(nodes, dataset_edges)
    width = max(3.0 * n_cols + 0.8, 1.0 * len(workers) + 3.0)
    graph_h, grid_h = 1.6 * max_rows + 1.8, 0.45 * len(mfcs) + 1.4
    fig = Figure(figsize=(width, graph_h + grid_h), dpi=100)
    canvas = FigureCanvasAgg(fig)
    frac = grid_h / (graph_h + grid_h)
    ax = fig.add_axes((0.02, frac + 0.01, 0.96, (1 - frac) * 0.9))
    grid_ax = fig.add_axes((0.16, 0.6 / (graph_h + grid_h), 0.8, frac - 1.3 / (graph_h + grid_h)))
    role_color = _graph_panel(canvas, ax, nodes, edges, dataset_edges, placement, roles, by_role=True)
    _placement_panel(grid_ax, mfcs, workers, cells, roles, role_color, hooks)
    return _save(fig, path)


def _placement_panel(ax, mfcs, workers, cells, roles, role_color, hooks) -> None:
    ax.set_xlim(-0.5, len(workers) - 0.5)
    ax.set_ylim(len(mfcs) - 0.5, -0.5)
    ax.set_xticks(range(len(workers)), [f"w{w}" for w in workers], fontsize=8)
    labels = [m + (f"  ({hooks[m]} hook{'s' if hooks[m] > 1 else ''})" if hooks.get(m) else "") for m in mfcs]
    ax.set_yticks(range(len(mfcs)), labels, fontsize=8)
    ax.tick_params(length=0)
    for y, m in enumerate(mfcs):
        for x, w in enumerate(workers):
            label = cells.get((m, w))
            if label is None:
                continue
            ax.add_patch(Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, fc=role_color.get(roles[m], "#dddddd"),
                                   ec="#333333", lw=0.6))
            ax.text(x, y, label, ha="center", va="center", fontsize=7)
    ax.set_title("placement: MFC x worker (data / tensor / pipeline rank; color = role)", fontsize=9)


def _graph_extent(nodes, dataset_edges) -> tuple[int, int]:
    x0 = 1 if dataset_edges else 0
    n_cols = max((g for _, g, _, _, _ in nodes), default=0) + 1 + x0
    return n_cols, max((n for *_, n, _ in nodes), default=1)


def _save(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png")
    return path


def _graph_panel(canvas, ax, nodes, edges, dataset_edges, placement, roles, by_role: bool = False) -> dict[str, str]:
    """Draw the graph on ``ax``; returns the color of each group (role when ``by_role``, else placement)."""
    x0 = 1 if dataset_edges else 0
    pos = {name: ((x0 + g) * 3.0, ((rows - 1) / 2.0 - row) * 1.6) for name, g, row, rows, _ in nodes}
    group_of = roles if by_role or not placement else {name: placement.get(name, "(unplaced)") for name, *_ in nodes}
    groups = list(dict.fromkeys(group_of[name] for name, *_ in nodes))
    color = {grp: _PALETTE[i % len(_PALETTE)] for i, grp in enumerate(groups)}
    ax.set_axis_off()
    texts = {}
    for name, _, _, _, sub in nodes:
        label = f"{name}\n{sub}" + (f"\n[{placement[name]}]" if name in placement else "")
        texts[name] = ax.text(*pos[name], label, ha="center", va="center", fontsize=9, zorder=3,
                              bbox=dict(boxstyle="round,pad=0.4", fc=color[group_of[name]], ec="#333333"))
    all_edges = list(edges)
    if dataset_edges:
        pos[_DS] = (0.0, 0.0)
        keys = sorted({k for k, _ in dataset_edges})
        texts[_DS] = ax.text(0.0, 0.0, "data set\n" + "\n".join(keys), ha="center", va="center", fontsize=8,
                             zorder=3, bbox=dict(boxstyle="square,pad=0.4", fc="#eeeeee", ec="#333333"))
        by_consumer: dict[str, list[str]] = {}
        for k, c in dataset_edges:
            by_consumer.setdefault(c, []).append(k)
        all_edges = [(_DS, c, tuple(ks)) for c, ks in by_consumer.items()] + all_edges
    xs, ys = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 1.5, max(xs) + 1.5)
    ax.set_ylim(min(ys) - 1.2, max(ys) + 1.0)
    if len(groups) > 1 or placement:
        ax.legend(handles=[Patch(fc=color[g], ec="#333333", label=g) for g in groups], loc="lower right",
                  fontsize=7, title="role" if by_role or not placement else "placement", title_fontsize=7)
    ax.set_title(f"data flow graph ({len(nodes)} MFCs)", fontsize=10)
    canvas.draw()  # positions the text boxes, so arrows can be clipped at their borders

    boxes = {n: t.get_bbox_patch().get_window_extent().expanded(1.1, 1.3) for n, t in texts.items()}
    to_data = ax.transData.inverted()
    for u, v, keys in all_edges:
        p0, p1 = ax.transData.transform(pos[u]), ax.transData.transform(pos[v])
        others = [b for n, b in boxes.items() if n not in (u, v)]
        rad = _BENDS[-1]
        for cand in _BENDS:
            c = _control(p0, p1, cand)
            if not any(b.contains(*_bezier(p0, c, p1, t / 20)) for b in others for t in range(1, 20)):
                rad = cand
                break
        ax.annotate("", xy=pos[v], xytext=pos[u], zorder=2,
                    arrowprops=dict(arrowstyle="-|>", color="#555555", connectionstyle=f"arc3,rad={rad}",
                                    mutation_scale=14, shrinkA=0, shrinkB=2,
                                    patchA=texts[u].get_bbox_patch(), patchB=texts[v].get_bbox_patch()))
        lx, ly = to_data.transform(_bezier(p0, _control(p0, p1, rad), p1, 0.5))
        ax.text(lx, ly, ", ".join(keys), ha="center", va="center", fontsize=7, color="#333333", zorder=4,
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85))
    return color
