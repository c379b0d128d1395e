"""Plots of a run: ``realflow plot outputs/<experiment>/<trial> [--out DIR]``.

Also ``python -m realflow.apps.plot RUN_DIR``. Reads ``<run_dir>/stats.jsonl`` (and
``samples.jsonl`` for samples/s) and writes one PNG per panel to ``<run_dir>/plots/``:
``reward.png``, ``heldout.png``, ``loss.png``, ``throughput.png`` and ``mfc_time.png``
(:mod:`realflow.apps.plot_panels` says which keys go where; a panel a run has no keys
for is not drawn). The launcher draws them when a run ends, so every run directory has
its curves without TensorBoard; this command redraws them, e.g. while a run is going.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from realflow.apps.plot_panels import PANEL_NAMES, Panel, Series, run_panels
from realflow.base.stats import read_jsonl

_SMOOTH_MIN_POINTS = 40  # noisier curves than this get a rolling mean drawn over the raw points


class PlotError(Exception):
    """The run directory cannot be plotted (one line for the user)."""


def _samples_per_step(run_dir: Path) -> Optional[dict[int, float]]:
    path = run_dir / "samples.jsonl"
    if not path.exists():
        return None
    rows = read_jsonl(path, skip_bad=True)
    return {int(r["step"]): float(len(r["ids"])) for r in rows
            if isinstance(r.get("step"), int) and isinstance(r.get("ids"), list)}


def _rolling_mean(values: list[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def _draw_series(ax, s: Series, color: str) -> None:
    """Few points (evaluations, recover points) as markers; long noisy curves raw + smoothed."""
    if len(s.steps) < 12:
        ax.plot(s.steps, s.values, marker="o", color=color, label=s.label)
    elif len(s.steps) >= _SMOOTH_MIN_POINTS:
        ax.plot(s.steps, s.values, color=color, alpha=0.3, linewidth=0.8)
        window = max(2, len(s.steps) // 20)
        ax.plot(s.steps, _rolling_mean(s.values, window), color=color, label=f"{s.label} (mean of {window})")
    else:
        ax.plot(s.steps, s.values, color=color, label=s.label)


def _draw_panel(panel: Panel, title: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2 * len(panel.axes)), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: no GUI backend, no global figure state in the launcher
    colors = [f"C{i}" for i in range(10)]
    for i, axis in enumerate(panel.axes):
        ax = fig.add_subplot(len(panel.axes), 1, i + 1)
        for j, s in enumerate(axis.series):
            _draw_series(ax, s, colors[j % len(colors)])
        if axis.log:
            ax.set_yscale("symlog", linthresh=1e-8)  # (a gap of exactly 0 stays drawable)
        ax.set_ylabel(axis.ylabel)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    fig.suptitle(f"{title}: {panel.title}")
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)  # a reader never sees half a PNG


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Draw the run's panels to ``out_dir`` (default ``<run_dir>/plots``); returns the PNGs written.

    PNGs of panels the run no longer has are removed, so the folder matches the stats.
    """
    run = Path(run_dir)
    stats = run / "stats.jsonl"
    if not stats.is_file():
        raise PlotError(f"no stats.jsonl in {run} (expected a run directory, outputs/<experiment>/<trial>)")
    rows = read_jsonl(stats, skip_bad=True)
    panels = run_panels(rows, _samples_per_step(run))
    if not panels:
        raise PlotError(f"{stats} has no step rows to plot yet")
    out = Path(out_dir) if out_dir is not None else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    title = f"{run.parent.name}/{run.name}"
    written = []
    for panel in panels:
        path = out / f"{panel.name}.png"
        _draw_panel(panel, title, path)
        written.append(path)
    for name in set(PANEL_NAMES) - {p.name for p in panels}:
        (out / f"{name}.png").unlink(missing_ok=True)
    return written


def plot_after_run(run_dir: str | os.PathLike) -> list[Path]:
    """The launcher's end-of-run plots: never fails the run, only warns (plots are a convenience)."""
    try:
        paths = plot_run(run_dir)
    except PlotError:  # no stats (yet): a run that ended before its first step has nothing to draw
        return []
    except Exception as e:  # noqa: BLE001 - any plotting problem must not turn a finished run into a failure
        print(f"warning: could not draw the run's plots: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return []
    if paths:
        print(f"plots: {paths[0].parent} ({', '.join(p.name for p in paths)})", flush=True)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="realflow plot", description="Draw a run's stats.jsonl to PNG files.")
    p.add_argument("run_dir", help="the run directory, outputs/<experiment>/<trial>")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR/plots)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        paths = plot_run(args.run_dir, args.out)
    except (PlotError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
