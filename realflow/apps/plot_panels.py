"""Which curves of a run's ``stats.jsonl`` make which plot panel (no drawing here).

Key names follow what the master logs (see :mod:`realflow.system.master`):

* reward: ``<mfc>/...reward...`` (e.g. ``actor_train/reward``); not ``time/reward_inf`` nor
  ``reward_inf/hooks_pre_s``, which are times of the reward MFC;
* held-out scores: ``eval/<metric>`` (``eval/accuracy``, ``eval/sampled_accuracy``, scores
  by reward name), without counts such as ``eval/n_eval``;
* loss: ``<mfc>/loss``;
* throughput: ``*_per_s`` keys (``async/gen_tokens_per_s``, ``async/trained_samples_per_s``);
  where a run has none, tokens/s from ``<mfc>/n_tokens`` over ``time/step``, samples/s from
  ``samples.jsonl`` over ``time/step``, else steps/s;
* time per MFC: ``time/<mfc>`` (plus ``time/fetch``, ``time/step``, ``time/recover_point``);
* train-inference mismatch: ``<mfc>/mismatch/...`` (see :mod:`mfc.mismatch`): mean and max
  |delta log p| (and per version offset), the shares of tokens beyond 0.1 and 1, and the
  per-token histogram as one curve per |delta| decade.

A panel whose keys a run lacks is left out, so SFT, sync PPO and async PPO runs each get
the panels that mean something for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

#: every panel a run can have, in drawing order (file stems under ``plots/``)
PANEL_NAMES = ("reward", "heldout", "loss", "throughput", "mfc_time", "mismatch")


@dataclass
class Series:
    """One curve: a label and its (step, value) points in step order."""

    label: str
    steps: list[int]
    values: list[float]


@dataclass
class Axis:
    """One subplot: curves that share a unit."""

    ylabel: str
    series: list[Series] = field(default_factory=list)
    log: bool = False  # a logarithmic y axis (values spanning decades, e.g. 1e-7 .. 1)


@dataclass
class Panel:
    """One PNG: ``name`` is its file stem, ``axes`` its subplots (never empty)."""

    name: str
    title: str
    axes: list[Axis]


def _leaf(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _series(rows: Sequence[Mapping[str, Any]], key: str, label: Optional[str] = None) -> Series:
    points = [(int(r["step"]), float(r[key])) for r in rows if key in r and isinstance(r[key], (int, float))]
    return Series(label or key, [s for s, _ in points], [v for _, v in points])


def _keys(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every stat key, in the order it first appears (so colours are stable across runs)."""
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k not in ("step", "time"):
                seen.setdefault(k, None)
    return list(seen)


def _ratio(rows: Sequence[Mapping[str, Any]], num: Mapping[int, float], label: str) -> Optional[Series]:
    """``num[step] / time/step`` per step: a rate derived from what a step did and how long it took."""
    steps, values = [], []
    for r in rows:
        t = r.get("time/step")
        if r["step"] in num and isinstance(t, (int, float)) and t > 0:
            steps.append(int(r["step"]))
            values.append(num[r["step"]] / t)
    return Series(label, steps, values) if steps else None


def _throughput(rows: Sequence[Mapping[str, Any]], keys: list[str],
                samples_per_step: Optional[Mapping[int, float]]) -> list[Axis]:
    tokens = Axis("tokens/s", [_series(rows, k) for k in keys if k.endswith("_per_s") and "token" in _leaf(k)])
    samples = Axis("samples/s", [_series(rows, k) for k in keys if k.endswith("_per_s") and "sample" in _leaf(k)])
    if not tokens.series:  # derived: tokens each MFC processed per second of step
        for k in keys:
            if _leaf(k) == "n_tokens":
                per = {int(r["step"]): float(r[k]) for r in rows if isinstance(r.get(k), (int, float))}
                s = _ratio(rows, per, f"{k.rsplit('/', 1)[0]} tokens/s (n_tokens / time/step)")
                if s is not None:
                    tokens.series.append(s)
    if not samples.series and samples_per_step:
        s = _ratio(rows, samples_per_step, "samples/s (samples.jsonl / time/step)")
        if s is not None:
            samples.series.append(s)
    axes = [a for a in (tokens, samples) if a.series]
    if not axes:
        s = _ratio(rows, {int(r["step"]): 1.0 for r in rows}, "steps/s (1 / time/step)")
        if s is not None:
            axes.append(Axis("steps/s", [s]))
    return axes


def _mismatch(rows: Sequence[Mapping[str, Any]], keys: list[str]) -> list[Axis]:
    from realflow.base.stats import decade_label  # (no torch: the stats module imports none)

    mm = [k for k in keys if "mismatch/" in k]
    gap = Axis("|delta log p| (log)", [_series(rows, k) for k in mm
                                       if _leaf(k) in ("abs_mean", "abs_max") or _leaf(k).endswith("_abs_mean")],
               log=True)
    frac = Axis("share of tokens", [_series(rows, k) for k in mm if _leaf(k).startswith("frac_over")
                                    or _leaf(k) == "corrected_frac"])
    bins = sorted((k for k in mm if _leaf(k).startswith("hist_")), key=lambda k: (k.rsplit("/", 1)[0],
                                                                                 int(_leaf(k)[5:])))
    hist = Axis("share per |delta| bin", [s for s in (_series(rows, k, f"|delta| in {decade_label(int(_leaf(k)[5:]))}")
                                                      for k in bins) if any(s.values)])  # (empty bins left out)
    return [gap, frac, hist]


def run_panels(rows: Sequence[Mapping[str, Any]],
               samples_per_step: Optional[Mapping[int, float]] = None) -> list[Panel]:
    """The panels a run's stats rows support, in a fixed order; empty curves are dropped.

    ``samples_per_step``: samples trained per step (from ``samples.jsonl``), used to derive
    samples/s when the run does not log a rate itself.
    """
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    keys = _keys(rows)
    not_timing = [k for k in keys if not k.startswith(("time/", "eval/"))]
    panels = [
        Panel("reward", "reward", [Axis("reward", [_series(rows, k) for k in not_timing
                                                   if "reward" in _leaf(k) and not k.endswith("_s")])]),
        Panel("heldout", "held-out scores", [Axis("score", [_series(rows, k) for k in keys if k.startswith("eval/")
                                                            and not _leaf(k).startswith("n_")])]),
        Panel("loss", "training loss", [Axis("loss", [_series(rows, k) for k in not_timing if _leaf(k) == "loss"])]),
        Panel("throughput", "throughput", _throughput(rows, keys, samples_per_step)),
        Panel("mfc_time", "time per MFC", [Axis("seconds", [_series(rows, k, k[5:]) for k in keys
                                                            if k.startswith("time/")])]),
        Panel("mismatch", "train-inference mismatch (generator vs trainer log-probs)", _mismatch(rows, keys)),
    ]
    out = []
    for p in panels:
        p.axes = [a for a in p.axes if any(s.steps for s in a.series)]
        for a in p.axes:
            a.series = [s for s in a.series if s.steps]
        if p.axes:
            out.append(p)
    return out
