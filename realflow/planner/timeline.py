"""The predicted timeline of a step as a PNG: one row per device, one bar per MFC.

Devices whose step looks the same (the same MFCs at the same times) share a row, labelled
with their range, so a 1024-device plan stays readable.
"""
from __future__ import annotations

from pathlib import Path

from realflow.planner.simulate import Prediction


def _rows(pred: Prediction, n_devices: int) -> list[tuple[str, list]]:
    per_dev: dict[int, list] = {d: [] for d in range(n_devices)}
    for m in pred.mfcs:
        for w in m.workers:
            per_dev[w].append(m)
    rows: list[tuple[list[int], list]] = []
    for d in range(n_devices):
        key = [(m.name, m.start, m.end) for m in per_dev[d]]
        if rows and [(m.name, m.start, m.end) for m in rows[-1][1]] == key:
            rows[-1][0].append(d)
        else:
            rows.append(([d], per_dev[d]))
    return [(f"{ds[0]}" if len(ds) == 1 else f"{ds[0]}-{ds[-1]}", ms) for ds, ms in rows]


def draw_timeline(pred: Prediction, n_devices: int, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(pred, n_devices)
    names = [m.name for m in pred.mfcs]
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(dict.fromkeys(names))}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.35 * len(rows)))
    for y, (_, ms) in enumerate(rows):
        for m in ms:
            if m.hooks_s > 0:
                ax.barh(y, m.hooks_s, left=m.start, color=colors[m.name], alpha=0.4, hatch="//", edgecolor="k")
            ax.barh(y, m.end - m.start - m.hooks_s, left=m.start + m.hooks_s, color=colors[m.name], edgecolor="k")
    ax.set_yticks(range(len(rows)), [f"devices {label}" for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (hatched: parameter reallocation / offload before the MFC)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8)
    ax.set_title(title or f"{pred.allocation}: predicted step {pred.step_s:.3g} s")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
