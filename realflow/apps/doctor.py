"""``realflow doctor mismatch RUN_DIR [--step N] [--samples K] [--out DIR]``: why the generator's
log-probs differ from the trainer's.

Why a command of its own: the run's stats show the gap (``mismatch/*``), this finds its cause
after the run, on any machine, from what ``mismatch_dump_every=N`` saved (samples, weights and
settings: :mod:`realflow.system.mismatch_dump`).  It prints a few lines (the gap as recorded,
the replay fidelity, the first layer and op where the two forwards part, and the verdict with
the knob that closes the gap), draws |Δ| per layer to a PNG and writes the report as JSON.
The analysis is the ``mismatch`` entry of :data:`realflow.api.diagnostics.doctors` (registered
by the built-in plugins: ``experiments/mismatch_doctor.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional

__all__ = ["main", "format_report", "draw"]

USAGE = "realflow doctor mismatch RUN_DIR [--step N] [--samples K] [--out DIR]"


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, not argparse's usage block
        raise _Usage(f"{message} (usage: {USAGE})")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="realflow doctor", usage=USAGE, description=(
        "mismatch: replay a run's saved samples (mismatch_dump_every=N) on the generator and the trainer, "
        "compare them layer by layer, move one knob at a time (precision, micro-batching, attention path, "
        "weights) and name the cause of the gap between their log-probs."))
    ap.add_argument("what", choices=["mismatch"], help="what to diagnose (mismatch: train-inference log-probs)")
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (holds mismatch/step_N/)")
    ap.add_argument("--step", type=int, default=None, help="the dump's step (default: the last one saved)")
    ap.add_argument("--samples", type=int, default=None, help="replay the first K samples (default: all saved)")
    ap.add_argument("--out", default=None, help="where the PNG and JSON go (default: RUN_DIR/mismatch)")
    return ap


def _args(argv: list[str]) -> argparse.Namespace:
    ap = _parser()
    if any(a in ("-h", "--help") for a in argv):
        ap.print_help()
        raise SystemExit(0)
    a = ap.parse_args(argv)
    if a.samples is not None and a.samples < 1:
        raise _Usage(f"--samples={a.samples} must be >= 1")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = _args(argv)
    except _Usage as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return int(e.code or 0)
    if not os.path.isdir(a.run_dir):
        print(f"error: {a.run_dir}: no such run directory (give the directory of a run that ran with "
              f"mismatch_dump_every=N)", file=sys.stderr)
        return 2
    import warnings

    # megatron's import-time notices (no Apex, deprecated scopes) are not the user's concern here
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    from realflow.api.diagnostics import doctors
    from realflow.config.cli import ConfigError
    from realflow.plugins import load_plugins
    from realflow.system.mismatch_dump import load_dump

    try:
        load_dump(a.run_dir, a.step)  # a dump to replay, before the engines are imported
        load_plugins()
        rep = doctors.get(a.what)(a.run_dir, a.step, a.samples)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = a.out or os.path.join(a.run_dir, "mismatch")
    os.makedirs(out, exist_ok=True)
    png = os.path.join(out, f"doctor_step_{rep['step']}.png")
    js = os.path.join(out, f"doctor_step_{rep['step']}.json")
    if rep["divergence"]:  # (stale samples without their weights: nothing was replayed to draw)
        draw(rep, png)
    with open(js, "w") as f:
        json.dump(_plain(rep), f, indent=1)
    print(format_report(rep))
    print((f"plot: {png}\n" if rep["divergence"] else "") + f"report: {js}")
    return 0


def _plain(x: Any) -> Any:
    """JSON without NaN/inf (a tensor missing from one copy has an infinite difference)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _e(x: float) -> str:
    return f"{x:.1e}"


def format_report(rep: dict[str, Any]) -> str:
    """The handful of lines the doctor prints."""
    head = (f"mismatch doctor: {rep['run_dir']} step {rep['step']}: {rep['samples']} samples, {rep['tokens']} "
            f"response tokens; weights version {rep['weights_version']}, samples labelled version "
            f"{rep['labelled_version']}; trainer {rep['trainer_precision']}, generator {rep['gen_precision']}"
            f"{' (own weight copy)' if rep['gen_weights'] else ''}, temperature {rep['temperature']:g}")
    g = rep.get("gap_recorded")
    recorded = ("" if g is None else
                f"gap as recorded ({rep['gap_recorded_source']}): mean |Δ log p| {_e(g['mean_abs'])}, max "
                f"{_e(g['max_abs'])}, k3 KL {_e(g['k3_kl'])}, |Δ|>0.1: {100 * g['frac_gt_0.1']:.1f}%, "
                f">1: {100 * g['frac_gt_1']:.1f}%")
    if "fidelity" not in rep:  # nothing replayed (stale samples whose weights no dump holds)
        return "\n".join(x for x in (head, recorded, f"verdict: {rep['verdict']['text']}") if x)
    f = rep["fidelity"]
    lines = [head, recorded]
    if rep.get("compared_on"):
        lines.append(f"compared on {rep['compared_on']}")
    lines += [f"replay fidelity (the generator rebuilt as run vs the recorded behaviour log-probs): mean |Δ| "
             f"{_e(f['mean_abs'])}, max {_e(f['max_abs'])}"
             + ("" if rep["reproduced_by"] == "as run" else f"; {rep['reproduced_by']} reproduce them")]
    lines = [x for x in lines if x]
    first = rep["first_divergence"]
    line = (f"first divergence (a token's hidden vector off by > {rep['tolerance']:.0e} relative): "
            + (f"{first['point']} ({_e(first['rel'])})" if first else "none"))
    if "first_divergence_fp32" in rep:
        f32 = rep["first_divergence_fp32"]
        line += f"; with both sides in fp32: {f32['point'] + ' (' + _e(f32['rel']) + ')' if f32 else 'none'}"
    lines.append(line)
    lines.append("knobs (mean |Δ log p| with the knob moved, from " + _e(rep["gap_replayed"]["mean_abs"]) + "): "
                 + "; ".join(f"{k['knob']} {_e(k['gap']['mean_abs'])}{' closes' if k['closes'] else ''}"
                             for k in rep["knobs"]))
    if rep["weight_diff"]:
        w = rep["weight_diff"]
        lines.append(f"weight copies: gen_weights/ differ from weights/ in {len(w)} tensor(s), first "
                     f"{w[0]['point']} ({w[0]['tensor']}, max |Δ| {_e(w[0]['max_abs'])})")
    lines.append(f"MoE routing: {rep['moe']}")
    lines.append(f"verdict: {rep['verdict']['text']}")
    return "\n".join(lines)


def draw(rep: dict[str, Any], path: str) -> None:
    """|Δ| (relative, per token, worst) at each probe point: as run, and with both sides in fp32."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rep["divergence"]) + 2), 3.6))
    for key, label in (("divergence", "as run"), ("divergence_fp32", "both sides in fp32")):
        pts = rep.get(key) or []
        if pts:
            ax.plot(range(len(pts)), [max(p["rel"], 1e-12) for p in pts], marker="o", label=label)
            ax.set_xticks(range(len(pts)), [p["point"] for p in pts], rotation=60, ha="right", fontsize=7)
    ax.axhline(rep["tolerance"], color="grey", ls="--", lw=1, label=f"tolerance {rep['tolerance']:.0e}")
    ax.set_yscale("log")
    ax.set_ylabel("max relative |Δ| per token")
    ax.set_title(f"generator vs trainer, step {rep['step']}: {rep['verdict']['cause']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
