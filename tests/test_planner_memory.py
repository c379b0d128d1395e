"""The planner's memory estimate against the peak memory a real engine reaches (issue 19, item 6).

A 2-rank gloo group (parallel.testing) builds the same small Qwen2 model in several layouts
(d1, d2, t2, p2) and trains it on the batch an SFT step of the planned experiment gives each
rank. Every CPU allocation from before the engine is built until after two optimizer steps is
recorded by torch's profiler (``profile_memory``); the running sum of those allocations and
frees is the memory the engine holds, and its maximum the measured peak of that rank. The
simulator (:func:`simulate` on the same SFT experiment, model and sequence lengths) predicts
each device's peak from the backend's state estimate plus activations and logits. They must
agree within MEMORY_RTOL on every rank of every layout.
"""
from __future__ import annotations

import os

import pytest

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
BATCH, SEQ_LEN, MB_TOKENS = 16, 64, 256
LAYOUTS = {"d1": (1, 1, 1), "d2": (2, 1, 1), "t2": (1, 2, 1), "p2": (1, 1, 2)}
MEMORY_RTOL = 0.25
CASES = ["case_setup"] + [f"case_peak_{name}" for name in LAYOUTS]


def case_setup(ctx):
    import torch.distributed as dist

    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "lm"), "qwen2", seed=2, **MODEL)
    dist.barrier()


def _micro_batches(dp: int, dp_rank: int):
    """This dp rank's share of the SFT batch, packed into micro-batches of MB_TOKENS."""
    import torch

    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, MODEL["vocab_size"], (SEQ_LEN,), generator=g) for _ in range(BATCH)]
    mine = seqs[dp_rank::dp]
    per_mb = MB_TOKENS // SEQ_LEN
    out = []
    for i in range(0, len(mine), per_mb):
        chunk = mine[i:i + per_mb]
        ids = torch.cat(chunk)
        out.append((ids, [SEQ_LEN] * len(chunk), torch.roll(ids, -1)))
    return out


def _peak_bytes(prof) -> int:
    """The largest running total of the CPU allocations and frees the profiler recorded (one raw
    event each, bytes negative for a free), in time order."""
    from torch.autograd import DeviceType

    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def _measure(ctx, layout):
    import gc

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig

    dp, tp, pp = layout
    gc.collect()  # the previous layout's engine is freed now, not inside this one's record
    dist.barrier()
    groups = build_model_groups(list(range(dp * tp * pp)), ParallelStrategy(dp=dp, tp=tp, pp=pp))
    if not groups.is_member:
        return None
    path = os.path.join(ctx.tmpdir, "lm")
    opt = EngineOptimizerConfig(lr=1e-4, total_train_steps=10)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        eng = MegatronEngine(AutoConfig.from_pretrained(path), groups, path, opt, seed=1)

        def loss(out, extra):
            return -out.logprobs(extra).sum(), {}

        for _ in range(2):
            eng.train_batch(_micro_batches(dp, groups.dp_rank), loss, lambda extra: float(extra.numel()))
    peak = _peak_bytes(prof)
    del eng
    return {"peak": peak}


def case_peak_d1(ctx):
    return _measure(ctx, LAYOUTS["d1"])


def case_peak_d2(ctx):
    return _measure(ctx, LAYOUTS["d2"])


def case_peak_t2(ctx):
    return _measure(ctx, LAYOUTS["t2"])


def case_peak_p2(ctx):
    return _measure(ctx, LAYOUTS["p2"])


@pytest.fixture(scope="module")
def measured():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=2, timeout=600,
                     pythonpath=[os.path.dirname(os.path.abspath(__file__))])


def _predicted(tmp_path, layout: str) -> dict[int, float]:
    import json

    from realflow.config.cli import import_modules, parse_overrides
    from realflow.api.experiment import experiment_registry
    from realflow.planner.cluster import cluster_from_dict
    from realflow.planner.simulate import Workload, simulate

    import_modules(["experiments", "parallel.backend"])
    setup = parse_overrides(experiment_registry.get("sft"), [f"fileroot={tmp_path}", f"batch_size={BATCH}",
                                                             f"max_tokens_per_mb={MB_TOKENS}"]).setup()
    cfg = json.loads(json.dumps({"model_type": "qwen2", **MODEL}))
    dp, tp, pp = LAYOUTS[layout]
    cluster = cluster_from_dict({"nodes": 1, "devices_per_node": dp * tp * pp, "device": "cpu-example", "name": "test"})
    pred = simulate(setup, cluster, {"default": cfg}, Workload(seq_len=SEQ_LEN), layout)
    return {w: b for w, b in pred.peak_bytes.items() if b > 0}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_memory_estimate_matches_the_measured_peak(measured, tmp_path, layout):
    assert measured["case_setup"].ok, measured["case_setup"].error
    res = measured[f"case_peak_{layout}"]
    assert res.ok, res.error
    predicted = _predicted(tmp_path, layout)
    got = {r: d["peak"] for r, d in res.data.items() if d is not None}
    assert sorted(got) == sorted(predicted), (got, predicted)
    for rank, peak in got.items():
        err = (predicted[rank] - peak) / peak
        print(f"{layout} rank {rank}: measured {peak / 2**20:.1f} MiB, predicted {predicted[rank] / 2**20:.1f} MiB "
              f"({err:+.0%})")
        assert abs(err) <= MEMORY_RTOL, (layout, rank, peak, predicted[rank])
