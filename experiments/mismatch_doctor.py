"""The mismatch doctor's analysis: replay a dump on both sides, move one knob at a time, name the cause.

Why knobs: a gap between the generator's and the trainer's log-probs has few causes, and each
one is a setting that can be changed in a replay.  The doctor first checks that the generator
rebuilt as it ran reproduces the recorded behaviour log-probs (replay fidelity); when it does
not, the generator ran something else, and the saved weights of other steps, the other weight
copy and the other precision are tried until one reproduces them (stale weights, a corrupt
copy, a precision the settings do not say).  Then each knob is moved alone (precision of either
side, one sequence per micro-batch, one full prefill instead of KV-cache decode, the trainer's
weights in the generator) and the knob that closes the gap is the verdict; the layer-by-layer
comparison of hidden states says where the two forwards part.

The replay tools are :mod:`parallel.mismatch_probe` and :mod:`parallel.mismatch_rebuild`; the
dump format is :mod:`realflow.system.mismatch_dump`; :mod:`realflow.apps.doctor` prints and draws
(it finds :func:`diagnose` as the ``mismatch`` entry of :data:`realflow.api.diagnostics.doctors`:
this layer composes the engines and the runtime's files, the apps reach it by registration).
"""
from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any, Optional

import torch

from parallel.mismatch_probe import (Replay, divergence, gap_stats, point_name, point_order, replay_generator,
                                     replay_trainer)
from parallel.mismatch_rebuild import build_generator, build_trainer
from realflow.api.diagnostics import doctors
from realflow.system.mismatch_dump import MismatchDump, dump_steps, load_dump

__all__ = ["NO_MISMATCH", "FIDELITY_TOL", "DIVERGENCE_TOL", "diagnose", "Replayer", "weight_diff"]

#: a mean |Δ log p| at or below this is no mismatch (fp32 replays of the same weights: ~1e-7)
NO_MISMATCH = 1e-5
#: the generator rebuilt as run reproduces the behaviour log-probs when their mean |Δ| is at most this
FIDELITY_TOL = 1e-4
#: ... or, for a bf16 generator, at most this share of the recorded gap: bf16 sums depend on the batch
#: a server really ran (its other requests, a request resumed after a weight update), which a replay
#: of a few samples cannot rebuild; the replay still explains the gap if it is that much closer
BF16_FIDELITY_SHARE = 0.6


def reproduces(fidelity: dict[str, float], recorded_gap: float, precision: str) -> bool:
    """Whether a replay at ``precision`` reproduces the behaviour log-probs (see the two constants)."""
    m = fidelity["mean_abs"]
    return m <= FIDELITY_TOL or (precision == "bf16" and m <= BF16_FIDELITY_SHARE * recorded_gap)
#: a probe point diverges when one token's hidden vector differs by more than this, relatively
#: (fp32 replays of the same weights agree to ~3e-7; bf16 rounding alone is ~2e-3)
DIVERGENCE_TOL = 1e-4
#: a knob closes the gap when the gap falls to at most this fraction of the baseline (or to NO_MISMATCH)
CLOSES = 0.1
#: how many other saved steps are tried as the weights the generator may really have run
STALE_CANDIDATES = 4


class Replayer:
    """Builds each engine once and replays the dump's samples on it."""

    def __init__(self, seqs: list[list[int]], prompt_lens: list[int], temperature: float,
                 max_tokens_per_mb: Optional[int]) -> None:
        self.seqs, self.pl, self.t, self.mb = seqs, prompt_lens, temperature, max_tokens_per_mb
        self._gens: dict[tuple[str, str], Any] = {}
        self._trainers: dict[tuple[str, str], Any] = {}

    def gen(self, path: str, precision: str, *, probe: bool = False, full: bool = False) -> Replay:
        key = (path, precision)
        if key not in self._gens:
            self._gens[key] = build_generator(path, precision, len(self.seqs), max(len(s) for s in self.seqs))
        return replay_generator(self._gens[key], self.seqs, self.pl, self.t, probe=probe, full_prefill=full)

    def trainer(self, path: str, precision: str, *, probe: bool = False, mb: Any = "run",
                routes: Optional[list[torch.Tensor]] = None) -> Replay:
        key = (path, precision)
        if key not in self._trainers:
            self._trainers[key] = build_trainer(path, precision)
        return replay_trainer(self._trainers[key], self.seqs, self.pl, self.mb if mb == "run" else mb,
                              self.t, probe=probe, routes=routes)


def _settings(dump: MismatchDump) -> tuple[str, str, float, Optional[int]]:
    s = dump.settings or {}
    mb = s.get("max_tokens_per_mb")
    return (str(s.get("trainer_precision", "fp32")), str(s.get("gen_precision", "fp32")),
            float(s.get("temperature", 1.0) or 1.0), int(mb) if mb else None)


def _first_divergent(div: list[tuple[Any, float]]) -> Optional[dict[str, Any]]:
    for key, rel in div:
        if rel > DIVERGENCE_TOL:
            return {"point": point_name(key), "op": key[0], "layer": key[1], "rel": rel}
    return None


def _hf_point(name: str) -> str:
    m = re.search(r"layers\.(\d+)\.(\w+)", name)
    if m:
        op = "mlp" if m.group(2) in ("mlp", "post_attention_layernorm") else "attention"
        return f"layer {m.group(1)} {op}"
    if "embed" in name:
        return "embedding"
    return "logits" if "lm_head" in name else "final norm"


def weight_diff(path_a: str, path_b: str) -> list[dict[str, Any]]:
    """The tensors of two HF checkpoints that differ (largest relative difference first), each
    named with the layer and op it belongs to."""
    from parallel.hf_io import read_hf_tensors

    a, b = read_hf_tensors(path_a), read_hf_tensors(path_b)
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b or a[name].shape != b[name].shape:
            out.append({"tensor": name, "point": _hf_point(name), "max_abs": float("inf"), "rel": float("inf")})
            continue
        d = (a[name].double() - b[name].double())
        if bool((d != 0).any()):
            out.append({"tensor": name, "point": _hf_point(name), "max_abs": float(d.abs().max()),
                        "rel": float(d.norm() / b[name].double().norm().clamp_min(1e-30))})
    return sorted(out, key=lambda r: -r["rel"])


def _closes(gap: dict[str, float], base: dict[str, float]) -> bool:
    """A gap to close (above NO_MISMATCH) falls to NO_MISMATCH or a tenth of what it was."""
    return base["mean_abs"] > NO_MISMATCH and gap["mean_abs"] <= max(NO_MISMATCH, CLOSES * base["mean_abs"])


@doctors.register("mismatch")
def diagnose(run_dir: str, step: Optional[int] = None, samples: Optional[int] = None) -> dict[str, Any]:
    """The doctor's report of one dump as plain data (see the module docstring)."""
    dump = load_dump(run_dir, step)
    chosen = [s for s in dump.samples if len(s.input_ids) > s.prompt_len >= 1][: samples or None]
    if not chosen:
        raise ValueError(f"{dump.path}: no sample with a prompt and a response to replay")
    tp, gp, temp, mb = _settings(dump)
    seqs = [list(s.input_ids) for s in chosen]
    pl = [s.prompt_len for s in chosen]
    behaviour = [torch.tensor(s.behaviour_logprobs, dtype=torch.float32) for s in chosen]
    labels = Counter(v for s in chosen for v in s.versions)
    label = labels.most_common(1)[0][0] if labels else None
    weights, gen_path = dump.weights_path, dump.gen_weights_path or dump.weights_path
    rebased = None
    if label is not None and label != dump.weights_version:
        # honestly stale samples (asynchronous runs): compare both sides on the weights of the version
        # that generated them, when a dump holds them; else the gap mixes training since then
        rebased = _dump_of_version(run_dir, label)
        if rebased is None:
            return _stale_report(run_dir, dump, chosen, label)
        weights = gen_path = rebased.weights_path
    r = Replayer(seqs, pl, temp, mb)
    num_layers = int(r_cfg(weights)["num_hidden_layers"])
    keys = point_order(num_layers)

    rep: dict[str, Any] = {"run_dir": run_dir, "step": dump.step, "tolerance": DIVERGENCE_TOL, "samples": len(chosen),
                           "tokens": sum(len(b) for b in behaviour), "weights_version": dump.weights_version,
                           "labelled_version": label, "trainer_precision": tp, "gen_precision": gp,
                           "temperature": temp, "max_tokens_per_mb": mb, "gen_weights": dump.gen_weights_path is not None,
                           "engine": (dump.settings or {}).get("engine", "builtin"),
                           "compared_on": None if rebased is None else
                           f"step {rebased.step}'s weights (version {label}, which generated the samples)"}
    t_run = r.trainer(weights, tp, probe=True)
    recorded = [s.trainer_logprobs for s in chosen]
    have_recorded = all(x is not None and len(x) == len(b) for x, b in zip(recorded, behaviour))
    rep["gap_recorded"] = gap_stats(behaviour, recorded if have_recorded else t_run.logprobs)
    rep["gap_recorded_source"] = "the run's trainer log-probs" if have_recorded else "the trainer rebuilt as run"
    if have_recorded:
        rep["trainer_fidelity"] = gap_stats(recorded, t_run.logprobs)

    g_run = r.gen(gen_path, gp, probe=True)
    fid = gap_stats(behaviour, g_run.logprobs)
    rep["fidelity"] = fid
    actual = {"what": "as run", "path": gen_path, "precision": gp, "replay": g_run}
    candidates = []
    if not reproduces(fid, rep["gap_recorded"]["mean_abs"], gp):
        actual = _what_generator_ran(r, dump, run_dir, gen_path, gp, behaviour, candidates,
                                     rep["gap_recorded"]["mean_abs"]) or actual
    rep["candidates"] = [{k: v for k, v in c.items() if k != "replay"} for c in candidates]
    rep["reproduced_by"] = actual["what"]
    g_act = actual["replay"]
    base = gap_stats(g_act.logprobs, t_run.logprobs)
    rep["gap_replayed"] = base

    div = divergence(g_act, t_run, keys)
    rep["divergence"] = [{"point": point_name(k), "rel": v} for k, v in div]
    rep["first_divergence"] = _first_divergent(div)
    knobs = _knobs(r, rep, actual, t_run, weights, gen_path, tp, gp, base, keys)
    rep["knobs"] = knobs
    rep["weight_diff"] = weight_diff(gen_path, weights)[:8] if dump.gen_weights_path else []
    rep["moe"] = _moe_line(knobs, base) if actual["replay"].routes is not None else "n/a (dense model)"
    rep["verdict"] = _verdict(rep, actual, dump)
    return rep


def _moe_line(knobs: list[dict[str, Any]], base: dict[str, float]) -> str:
    k = next(k for k in knobs if k["cause"] == "MoE routing")
    return (f"each side on its own router: mean |Δ log p| {base['mean_abs']:.1e}; the trainer on the generator's "
            f"experts (routing replay): {k['gap']['mean_abs']:.1e}")


def _dump_of_version(run_dir: str, version: int) -> Optional[MismatchDump]:
    """A saved dump whose weights are ``version`` (None if no step saved them)."""
    for s in dump_steps(run_dir):
        try:
            d = load_dump(run_dir, s)
        except (FileNotFoundError, ValueError):
            continue
        if d.weights_version == version:
            return d
    return None


def _stale_report(run_dir: str, dump: MismatchDump, chosen: list, label: int) -> dict[str, Any]:
    """Samples of an older version whose weights no dump holds: what can be said without a replay."""
    tp, gp, temp, mb = _settings(dump)
    behaviour = [torch.tensor(s.behaviour_logprobs, dtype=torch.float32) for s in chosen]
    recorded = [s.trainer_logprobs for s in chosen]
    rep: dict[str, Any] = {"run_dir": run_dir, "step": dump.step, "tolerance": DIVERGENCE_TOL, "samples": len(chosen),
                           "tokens": sum(len(b) for b in behaviour), "weights_version": dump.weights_version,
                           "labelled_version": label, "trainer_precision": tp, "gen_precision": gp,
                           "temperature": temp, "max_tokens_per_mb": mb, "gen_weights": False,
                           "engine": (dump.settings or {}).get("engine", "builtin"), "knobs": [],
                           "divergence": [], "first_divergence": None, "weight_diff": [], "candidates": []}
    if all(x is not None and len(x) == len(b) for x, b in zip(recorded, behaviour)):
        rep["gap_recorded"] = gap_stats(behaviour, recorded)
        rep["gap_recorded_source"] = "the run's trainer log-probs"
    saved = ", ".join(f"step {s}" for s in dump_steps(run_dir))
    rep["verdict"] = {
        "cause": "stale samples",
        "text": f"stale samples: they were generated by version {label}, {dump.weights_version - label} behind the "
                f"trainer's version {dump.weights_version} in this dump, and no dump holds version {label}'s weights "
                f"(saved: {saved}): the recorded gap mixes what the trainer learned since with the mismatch "
                f"(actor_train/mismatch/v0_abs_mean is the mismatch alone); run with mismatch_dump_every=1 so that "
                f"every version's weights are saved",
        "knob": ""}
    return rep


def r_cfg(path: str) -> dict[str, Any]:
    import json

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


def _what_generator_ran(r: Replayer, dump: MismatchDump, run_dir: str, gen_path: str, gp: str,
                        behaviour: list[torch.Tensor], out: list[dict[str, Any]],
                        recorded_gap: float) -> Optional[dict[str, Any]]:
    """The first replay that reproduces the behaviour log-probs: the other precision, the other
    weight copy, other steps' weights (nearest first); None when none does."""
    other = "fp32" if gp == "bf16" else "bf16"
    tries = [(f"generator in {other}", gen_path, other, None)]
    if dump.gen_weights_path:
        tries.append(("the trainer's weights/ instead of gen_weights/", dump.weights_path, gp, None))
    steps = sorted((s for s in dump_steps(run_dir) if s != dump.step), key=lambda s: (abs(s - dump.step), -s))
    for s in steps[:STALE_CANDIDATES]:
        try:
            d = load_dump(run_dir, s)
        except (FileNotFoundError, ValueError):
            continue
        tries.append((f"step {s}'s weights (version {d.weights_version})", d.weights_path, gp,
                      {"step": s, "version": d.weights_version}))
    for what, path, prec, stale in tries:
        rep = r.gen(path, prec, probe=True)
        fid = gap_stats(behaviour, rep.logprobs)
        c = {"what": what, "path": path, "precision": prec, "fidelity": fid, "stale": stale, "replay": rep}
        out.append(c)
        if reproduces(fid, recorded_gap, prec):
            return c
    return None


def _knobs(r: Replayer, rep: dict[str, Any], actual: dict[str, Any], t_run: Replay, weights: str, gen_path: str,
           tp: str, gp: str, base: dict[str, float], keys: list) -> list[dict[str, Any]]:
    """Each knob moved alone: the gap between the generator (as it actually ran) and the trainer."""
    knobs = []
    g_act, a_path, a_prec = actual["replay"], actual["path"], actual["precision"]

    def add(name: str, cause: str, gap: dict[str, float]) -> None:
        knobs.append({"knob": name, "cause": cause, "gap": gap, "closes": _closes(gap, base)})

    g32 = t32 = None
    if a_prec == "bf16":
        g32 = r.gen(a_path, "fp32", probe=True)
        add("generator in fp32", "precision", gap_stats(g32.logprobs, t_run.logprobs))
    if tp == "bf16":
        t32 = r.trainer(weights, "fp32", probe=True)
        add("trainer in fp32", "precision", gap_stats(g_act.logprobs, t32.logprobs))
    if g32 is not None and t32 is not None:
        add("both sides in fp32", "precision", gap_stats(g32.logprobs, t32.logprobs))
    if g32 is not None or t32 is not None:  # where the forwards part with precision taken out
        div = divergence(g32 or g_act, t32 or t_run, keys)
        rep["divergence_fp32"] = [{"point": point_name(k), "rel": v} for k, v in div]
        rep["first_divergence_fp32"] = _first_divergent(div)
    add("one sequence per micro-batch (trainer)", "micro-batching",
        gap_stats(g_act.logprobs, r.trainer(weights, tp, mb=1).logprobs))
    add("one full prefill instead of KV-cache decode (generator)", "attention path",
        gap_stats(r.gen(a_path, a_prec, full=True).logprobs, t_run.logprobs))
    if g_act.routes is not None:  # MoE: the trainer routes every token to the generator's experts (R3)
        add("the trainer routes to the generator's experts (routing replay)", "MoE routing",
            gap_stats(g_act.logprobs, r.trainer(weights, tp, routes=g_act.routes).logprobs))
    if os.path.realpath(a_path) != os.path.realpath(weights):
        add("the trainer's weights in the generator", "stale weights" if actual.get("stale") else "weight copy",
            gap_stats(r.gen(weights, a_prec).logprobs, t_run.logprobs))
    return knobs


def _fmt(x: float) -> str:
    return f"{x:.1e}"


def _verdict(rep: dict[str, Any], actual: dict[str, Any], dump: MismatchDump) -> dict[str, str]:
    base, fid = rep["gap_replayed"], rep["fidelity"]
    if actual["what"] == "as run" and not reproduces(fid, rep["gap_recorded"]["mean_abs"], rep["gen_precision"]):
        return {"cause": "not reproduced",
                "text": f"the generator rebuilt as run does not reproduce the behaviour log-probs (mean |Δ| "
                        f"{_fmt(fid['mean_abs'])}), nor do the other precision, weight copy or saved steps: it ran "
                        f"something the dump does not describe (engine {rep['engine']!r}; settings?)",
                "knob": ""}
    if actual.get("stale"):
        st = actual["stale"]
        return {"cause": "stale weights",
                "text": f"stale weights: the behaviour log-probs are reproduced by step {st['step']}'s weights "
                        f"(version {st['version']}), not by this step's (version {dump.weights_version}; samples "
                        f"labelled version {rep['labelled_version']}): the generator missed a weight update",
                "knob": f"the trainer's weights in the generator close the gap "
                        f"({_fmt(rep['gap_recorded']['mean_abs'])} -> {_fmt(base['mean_abs'])})"}
    if actual["what"] != "as run":
        cause = "precision" if "generator in" in actual["what"] else "weight copy"
        return {"cause": cause, "text": f"{cause}: the generator did not run as the dump says: the behaviour "
                                        f"log-probs are reproduced by {actual['what']}", "knob": actual["what"]}
    if rep["gap_recorded"]["mean_abs"] <= NO_MISMATCH and base["mean_abs"] <= NO_MISMATCH:
        return {"cause": "none", "text": f"no mismatch: mean |Δ log p| {_fmt(rep['gap_recorded']['mean_abs'])} "
                                         f"<= {_fmt(NO_MISMATCH)}", "knob": ""}
    closing = sorted((k for k in rep["knobs"] if k["closes"]), key=lambda k: k["gap"]["mean_abs"])
    if not closing:
        where = rep["first_divergence"]
        return {"cause": "unexplained",
                "text": f"unexplained: no single knob closes the gap ({_fmt(base['mean_abs'])}); the forwards part "
                        f"at {where['point'] if where else 'no probe point'}", "knob": ""}
    best = closing[0]
    text = f"{best['cause']}: moving one knob ({best['knob']}) closes the gap ({_fmt(base['mean_abs'])} -> {_fmt(best['gap']['mean_abs'])})"
    if best["cause"] == "weight copy" and rep["weight_diff"]:
        w = rep["weight_diff"][0]
        text = (f"weight copy: the generator's gen_weights/ differ from the trainer's weights/ at {w['point']} "
                f"({w['tensor']}, max |Δ| {_fmt(w['max_abs'])}); " + text.split(": ", 1)[1])
    elif best["cause"] == "precision":
        text = (f"precision: the generator ran {rep['gen_precision']}, the trainer {rep['trainer_precision']}; "
                + text.split(": ", 1)[1])
    return {"cause": best["cause"], "text": text, "knob": best["knob"]}
