"""The costs of megatron-core itself on this machine, for the planner's device profile.

Why measured in the engine and not counted from primitive ops: a megatron layer's forward and
backward run ~100 framework ops each (norms, rotary, reshapes, sequence-parallel gathers, the
distributed optimizer's bookkeeping), and on small or CPU models that Python and dispatch time,
not the GEMMs, sets the step time. A tiny model is timed at three depths and four token counts;
per token count a line over the depths separates one layer's cost from the call's (loss,
schedule, optimizer). The layer's cost is kept as a curve over the token counts (it is not a
line: see :func:`fit_costs`), the call's as a line (fixed + per token). Generation is timed
the same way at two step counts and two numbers of live sequences: a decode step's cost per
step, per layer, per live sequence (its sampling and bookkeeping) and per sequence and layer,
and what a generate call costs around its steps. (A run decodes tens of sequences per rank; the per-sequence costs, not
the GEMMs, set a small model's decode step.)

Why on ``world`` concurrent processes: a run's workers share the host (cores, caches, memory
bandwidth), so one process timed alone is a faster "device" than any worker of a run. Every
rank of a ``world``-process gloo group measures at once, as data parallel (each rank its own
batch: the run's default) and, when ``world`` is even, as tensor parallel over pairs of ranks
(``tp_*`` costs: the layer's split GEMMs plus megatron's sequence-parallel collectives, measured
rather than modelled; averaged over several launches, see :func:`measure_engine_overheads`).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

# the reference layer: the width of the CPU default models (what the planner scales from)
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=128, intermediate_size=352,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024,
            hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
DEPTHS = (2, 4, 6)
TOKENS = (32, 512, 1024, 2048)  # per rank: a layer's cost is measured at each (a run's micro-batches
# hold ~0.5-2k tokens; the cost model interpolates between them)
SEQ = 16  # tokens per packed sequence
DECODE_BATCHES = (8, 64)  # live sequences: per-sequence decode costs are the slope between them
DECODE_STEPS = (2, 18)
MEASURED_TP = 2


def _grid_median_s(fns: dict[Any, Callable[[], Any]], repeats: int, sync: Callable[[], None]) -> dict[Any, float]:
    """Median seconds of each function, timed in ``repeats`` round-robin rounds over all of them.

    Why round-robin: this host's speed drifts over tens of seconds (other processes, the kernel's
    memory scanning), and timing one grid point after another would turn that drift into a
    false slope across depths or token counts; interleaved, every point sees the same drift.
    Why each visit runs its function twice and times the second: a run repeats the same step
    (its caches warm), and the first call after another grid point's runs on cold caches (seen:
    a 4-layer train step timed 55 ms alone, 58-71 ms as the round's first call).
    """
    for fn in fns.values():
        fn()  # warm up
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            fn()
            sync()  # every rank starts together: the same contention as a run's step
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _layer_params(cfg: dict[str, Any]) -> int:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    return (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd * h + cfg["num_attention_heads"] * hd * h \
        + 3 * f * h


def _line(xs: list[float], ys: list[float], relative: bool = False) -> tuple[float, float]:
    """Least-squares (intercept, slope). ``relative``: each point weighted by 1/y^2, i.e. relative
    errors are minimised -- timings over 32..2048 tokens carry noise in proportion to their size,
    and unweighted, the 2048-token point's few-percent noise swings the intercept (the per
    micro-batch cost) by more than the 32-token point measures it to."""
    w = [1.0 / max(y * y, 1e-30) for y in ys] if relative else [1.0] * len(ys)
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    return my - slope * mx, slope


def fit_costs(t: dict[tuple[int, int], float]) -> dict[str, Any]:
    """A layer's and a call's costs from times at DEPTHS x TOKENS (one micro-batch per call).

    Per token count, a line over the depths splits the time into the call's part (intercept) and
    one layer's (slope). The layer's costs are kept as measured, a curve over the token counts
    (``curve``: made non-decreasing, as noise can dip a point), with ``overhead_s`` its value
    extrapolated to no tokens and ``token_s`` its mean slope. Why a curve, not a line: a
    tensor-parallel layer's cost per token grows past ~1k tokens (seen 10 us below, 16 us
    above), and a line fitted over 32..2048 under-priced the ~1k-token batches of a run by 15%.
    The call's part is a line over the token counts: ``call_s`` (its intercept: schedule, optimizer)
    and ``head_token_s`` (embedding, LM head, loss; at tp their collectives); fitted on relative
    errors, as the largest batch's few percent of noise would otherwise swing the intercept.
    """
    fixed, per_layer = {}, {}
    for n in TOKENS:
        fixed[n], per_layer[n] = _line([float(d) for d in DEPTHS], [t[d, n] for d in DEPTHS])
    ys: list[float] = []
    for n in TOKENS:
        ys.append(max(per_layer[n], ys[-1] if ys else 0.0))
    (n0, y0), (n1, y1) = (TOKENS[0], ys[0]), (TOKENS[1], ys[1])
    layer_fixed = max(y0 - n0 * (y1 - y0) / (n1 - n0), 0.0)
    _, per_token = _line([float(n) for n in TOKENS], ys)
    call_fixed, head = _line([float(n) for n in TOKENS], [fixed[n] for n in TOKENS],
                             relative=min(fixed.values()) > 0)
    return {"token_s": max(per_token, 0.0), "overhead_s": layer_fixed, "call_s": max(call_fixed, 0.0),
            "head_token_s": max(head, 0.0), "curve": tuple((float(n), y) for n, y in zip(TOKENS, ys))}


def _measure_layout(strategy: Any, repeats: int, sync: Callable[[], None]) -> dict[str, Any]:
    import torch

    from parallel.engine import MegatronEngine
    from parallel.generation import EngineConfig, GenerationEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.generation import SamplingParams

    from parallel.model_config import precision_overrides
    from realflow.base.devices import resolve_precision

    groups = build_model_groups(list(range(strategy.world_size)), strategy)
    # the precision a run uses by default here (bf16 on GPUs): the costs it will see
    low = precision_overrides(resolve_precision("auto"))
    batches = {}
    for n in TOKENS:  # each data-parallel rank its own batch
        ids = torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(n + groups.dp_rank))
        batches[n] = (ids, [SEQ] * (n // SEQ))
    prompt = batches[TOKENS[0]][0][:8].tolist()

    def loss_for(t: Any):
        tg = torch.roll(t, -1)
        return lambda out, extra: (-out.logprobs(tg).sum(), {})

    fns: dict[tuple, Callable[[], Any]] = {}
    for depth in DEPTHS:
        eng = MegatronEngine(dict(TINY, num_hidden_layers=depth), groups, None,
                             EngineOptimizerConfig(lr=1e-5, total_train_steps=1000), seed=1, config_overrides=low)
        for n, (t, lens) in batches.items():
            fns["fwd", depth, n] = lambda eng=eng, t=t, lens=lens: eng.logprobs(t, lens)
            fns["train", depth, n] = lambda eng=eng, t=t, lens=lens: eng.train_batch(
                [(t, lens, None)], loss_for(t), lambda _: 1.0)
        gen = GenerationEngine.from_megatron(eng, EngineConfig(max_running_requests=max(DECODE_BATCHES)))
        for b in DECODE_BATCHES:
            for n in DECODE_STEPS:
                fns["gen", depth, b, n] = lambda gen=gen, b=b, n=n: gen.generate(
                    [prompt] * b, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return fit_layout(_grid_median_s(fns, repeats, sync))


def fit_layout(times: dict[tuple, float]) -> dict[str, Any]:
    """The profile's fields from the timed grid (``("train" | "fwd", depth, tokens)`` and
    ``("gen", depth, live sequences, steps)``)."""
    fwd = {(d, n): times["fwd", d, n] for d in DEPTHS for n in TOKENS}
    train = {(d, n): times["train", d, n] for d in DEPTHS for n in TOKENS}
    dec, call = {}, {}
    lo_n, hi_n = DECODE_STEPS
    for depth in DEPTHS:
        for b in DECODE_BATCHES:
            lo, hi = times["gen", depth, b, lo_n], times["gen", depth, b, hi_n]
            dec[depth, b] = (hi - lo) / (hi_n - lo_n)  # one decode step
            call[depth, b] = lo - lo_n * dec[depth, b]  # the call around its steps (and the prefill)
    out: dict[str, Any] = {}
    for name, t in (("train", train), ("forward", fwd)):
        fit = fit_costs(t)
        out[f"layer_{name}_token_s"] = fit["token_s"]
        out[f"layer_{name}_overhead_s"] = fit["overhead_s"]
        out[f"layer_{name}_curve"] = fit["curve"]
        out[f"{name}_head_token_s"] = fit["head_token_s"]
        out["train_step_overhead_s" if name == "train" else "forward_overhead_s"] = fit["call_s"]
    out.update(fit_decode(dec, call))
    return out


def fit_decode(dec: dict[tuple[int, int], float], call: dict[tuple[int, int], float]) -> dict[str, float]:
    """A decode step at depth d with b live sequences costs A + B*d + b*(C + D*d); a generate call
    adds E + F*b around its steps. Lines through the measured (depth, batch) grid give A..F."""
    lo_b, hi_b = DECODE_BATCHES
    depths = [float(d) for d in DEPTHS]
    per_seq = [(dec[d, hi_b] - dec[d, lo_b]) / (hi_b - lo_b) for d in DEPTHS]
    base = [dec[d, lo_b] - lo_b * q for d, q in zip(DEPTHS, per_seq)]
    a, b = _line(depths, base)
    c, d = _line(depths, per_seq)
    call_seq = statistics.mean((call[x, hi_b] - call[x, lo_b]) / (hi_b - lo_b) for x in DEPTHS)
    call_fixed = statistics.mean(call[x, lo_b] for x in DEPTHS) - lo_b * call_seq
    return {"decode_step_overhead_s": max(a, 0.0), "decode_layer_overhead_s": max(b, 0.0),
            "decode_seq_s": max(c, 0.0), "decode_layer_seq_s": max(d, 0.0),
            "generate_call_overhead_s": max(call_fixed, 0.0), "generate_seq_overhead_s": max(call_seq, 0.0)}


def case_measure(ctx: Any, repeats: int = 5) -> dict[str, float]:
    """Run on every rank of a gloo group (:func:`parallel.testing.run_cases`): the data-parallel
    costs (each rank its own batch)."""
    import torch
    import torch.distributed as dist

    from realflow.api.allocation import ParallelStrategy

    torch.manual_seed(0)
    out = _measure_layout(ParallelStrategy(dp=ctx.world_size), repeats, dist.barrier)
    out["layer_reference_params"] = float(_layer_params(TINY))
    out["head_reference_size"] = float(TINY["vocab_size"] * TINY["hidden_size"])
    return out


def case_measure_tp(ctx: Any, repeats: int = 5) -> dict[str, Any]:
    """The tensor-parallel costs over pairs of ranks, as ``tp_*`` (every cost: at tp each has its
    collectives)."""
    import torch
    import torch.distributed as dist

    from realflow.api.allocation import ParallelStrategy

    torch.manual_seed(0)
    tp = _measure_layout(ParallelStrategy(dp=ctx.world_size // MEASURED_TP, tp=MEASURED_TP), repeats, dist.barrier)
    return {f"tp_{k}": v for k, v in tp.items()}


def case_measure_quick(ctx: Any) -> dict[str, float]:
    """One timed round (after the warm-up): ``calibrate --quick`` is for a first look and for tests,
    and three rounds cost it a minute and a half on a 2-core host."""
    return case_measure(ctx, repeats=1)


def case_measure_tp_quick(ctx: Any) -> dict[str, Any]:
    return case_measure_tp(ctx, repeats=1)


TP_LAUNCHES = 3


def measure_engine_overheads(world: int = 2, quick: bool = False, timeout_s: float = 600.0) -> dict[str, Any]:
    """The profile's framework fields (see :class:`realflow.planner.profile.DeviceProfile`),
    measured on ``world`` concurrent worker processes; each value (each curve point) the median
    over the ranks. With an even ``world`` also the tensor-parallel ones, as the mean over
    ``TP_LAUNCHES`` fresh launches (1 when ``quick``). Why several launches: a tp layer waits on
    the other rank at every collective, and a gloo all-reduce here takes ~0.3 ms or ~4 ms (a
    scheduler tick), in a mix that is set when the processes start: the same tp=2 decode timed
    178 ms in one launch and 235 ms in the next, each steady within its launch."""
    launches = [run_measure("case_measure_quick" if quick else "case_measure", world, timeout_s)]
    tp = []
    if world % MEASURED_TP == 0:
        tp = [run_measure("case_measure_tp_quick" if quick else "case_measure_tp", world, timeout_s)
              for _ in range(1 if quick else TP_LAUNCHES)]
    out = dict(launches[0])
    for k in (tp[0] if tp else {}):
        v = tp[0][k]
        if isinstance(v, tuple):
            out[k] = tuple((p[0], statistics.mean(t[k][i][1] for t in tp)) for i, p in enumerate(v))
        else:
            out[k] = statistics.mean(t[k] for t in tp)
    if tp:
        out["measured_tp"] = float(MEASURED_TP)
    return out


def run_measure(case: str, world: int, timeout_s: float) -> dict[str, Any]:
    """One launch of ``case`` on ``world`` fresh processes; each value the median over the ranks."""
    from parallel.testing import run_cases

    res = run_cases([f"parallel.overheads:{case}"], world_size=world, timeout=timeout_s)[case]
    if not res.ok:
        raise RuntimeError(f"engine cost measurement ({case}) on {world} processes failed: {res.error[-2000:]}")
    ranks = list(res.data.values())
    out: dict[str, Any] = {}
    for k, v in ranks[0].items():
        if isinstance(v, (list, tuple)):  # a curve, as JSON lists from the ranks
            out[k] = tuple((float(p[0]), statistics.median(float(r[k][i][1]) for r in ranks)) for i, p in enumerate(v))
        else:
            out[k] = statistics.median(float(r[k]) for r in ranks)
    return out


if __name__ == "__main__":
    print(measure_engine_overheads())
