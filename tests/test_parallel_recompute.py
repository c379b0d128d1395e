"""Activation recompute (``training.gradient_checkpointing``) changes memory, not gradients.

ONE 4-rank gloo group (parallel.testing) builds the tiny Qwen2 model of the layout tests in
d1, t2, p2 and t2p2 three times: without recompute, with ``full`` (every layer re-run in the
backward) and with ``selective`` (the core attention -- our SDPACoreAttention -- re-run).
After one train step the gathered gradients and the loss of both recompute modes equal the
plain run's within GRAD_TOL (relative to the largest gradient).  Recompute must really happen:
the core attention's forward runs twice per layer and micro-batch with either mode, once
without.  With attention dropout on (d1, t2) the recomputed forward must draw the same dropout
masks, which exercises megatron's RNG tracker on CPU (parallel/cpu_compat.py).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 4
GRAD_TOL = 1e-6
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
LAYOUTS = {"d1": (1, 1, 1), "t2": (1, 2, 1), "p2": (1, 1, 2), "t2p2": (1, 2, 2)}
DROPOUT_LAYOUTS = ("d1", "t2")
MODES = ("full", "selective")
CASES = (["case_setup"] + [f"case_{tag}" for tag in LAYOUTS]
         + [f"case_{tag}_dropout" for tag in DROPOUT_LAYOUTS] + ["case_optimizer_offload_on_cpu"])


def _micro_batches():
    """Two micro-batches of uneven packed sequences (ids, seqlens, (targets, loss mask))."""
    g = torch.Generator().manual_seed(7)
    out = []
    for lens in ([9, 4], [13]):
        ids = torch.randint(0, TINY["vocab_size"], (sum(lens),), generator=g)
        targets = torch.roll(ids, -1)
        mask = (torch.rand(sum(lens), generator=g) < 0.9).float()
        out.append((ids, lens, (targets, mask)))
    return out


def _loss(out, extra):
    targets, mask = extra
    return -(mask * out.logprobs(targets)).sum(), {}


def _weight(extra):
    return float(extra[1].sum())


def case_setup(ctx):
    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "lm"), "qwen2", seed=3, tie_word_embeddings=True, **TINY)
    dist.barrier()


def _one_step(ctx, groups, mode, dropout):
    """(loss, gathered grads or None, core-attention forwards on this rank) after one step."""
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.model_options import TrainingMemoryConfig

    path = os.path.join(ctx.tmpdir, "lm")
    eng = MegatronEngine(AutoConfig.from_pretrained(path), groups, path,
                         EngineOptimizerConfig(lr=1e-3, total_train_steps=1), seed=1,
                         config_overrides={"attention_dropout": dropout},
                         training=TrainingMemoryConfig(gradient_checkpointing=mode))
    calls = [0]
    for layer in eng.module.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    stats = eng.train_batch(_micro_batches(), _loss, _weight)
    return stats["loss"], eng.full_hf_grads(), calls[0], len(eng.module.decoder.layers)


def _compare(ctx, tag, dropout=0.0):
    from parallel.groups import ParallelStrategy, build_model_groups

    dp, tp, pp = LAYOUTS[tag]
    # collective over the whole world (new process groups): built once, the engines reuse it
    groups = build_model_groups(list(range(dp * tp * pp)), ParallelStrategy(dp=dp, tp=tp, pp=pp))
    if not groups.is_member:
        return None
    loss0, grads0, calls0, layers = _one_step(ctx, groups, "none", dropout)
    n_mbs = len(_micro_batches())
    assert calls0 == layers * n_mbs, (calls0, layers)
    res = {}
    for mode in MODES:
        loss, grads, calls, _ = _one_step(ctx, groups, mode, dropout)
        assert calls == 2 * layers * n_mbs, f"{mode}: core attention ran {calls} times, expected a recompute"
        assert abs(loss - loss0) <= GRAD_TOL * abs(loss0), (mode, loss, loss0)
        if grads0 is not None:
            assert sorted(grads) == sorted(grads0)
            scale = max(g.abs().max().item() for g in grads0.values())
            res[mode] = max((grads[n] - g).abs().max().item() for n, g in grads0.items()) / scale
            assert res[mode] <= GRAD_TOL, (mode, res)
    return {f"{tag}{'_dropout' if dropout else ''}": res}


for _tag in LAYOUTS:
    globals()[f"case_{_tag}"] = (lambda t: lambda ctx: _compare(ctx, t))(_tag)
for _tag in DROPOUT_LAYOUTS:
    globals()[f"case_{_tag}_dropout"] = (lambda t: lambda ctx: _compare(ctx, t, dropout=0.2))(_tag)


def case_optimizer_offload_on_cpu(ctx):
    """``training.optimizer_offload`` (+ master weights) on a CPU host: accepted, nothing moves, the
    step is the plain one (the GPU path is exercised by benchmarks/device_check.sh)."""
    import logging

    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.model_options import TrainingMemoryConfig

    groups = build_model_groups([0], ParallelStrategy())
    if not groups.is_member:
        return None
    path = os.path.join(ctx.tmpdir, "lm")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("realflow.parallel").addHandler(handler)
    logging.getLogger("realflow.parallel").setLevel(logging.INFO)
    losses = []
    for training in (TrainingMemoryConfig(), TrainingMemoryConfig(optimizer_offload=True, offload_master_weights=True)):
        eng = MegatronEngine(AutoConfig.from_pretrained(path), groups, path,
                             EngineOptimizerConfig(lr=1e-3, total_train_steps=2), seed=1, training=training)
        losses.append([eng.train_batch(_micro_batches(), _loss, _weight)["loss"] for _ in range(2)])
        assert eng.offload is None
    assert losses[0] == losses[1], losses
    assert sum("optimizer_offload" in r.getMessage() for r in records) == 1, [r.getMessage() for r in records]


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=400,
                     pg_timeout=120, pythonpath=[os.path.dirname(__file__)])


@pytest.mark.timeout(460)
@pytest.mark.parametrize("case", CASES)
def test_recompute(results, case):
    print(f"{case}: {results[case].seconds:.1f}s {results[case].data.get(0)}")
    assert results[case].ok, results[case].error


def test_recompute_overrides_name_the_key():
    from parallel.model_config import recompute_overrides
    from realflow.api.model_options import TrainingMemoryConfig

    assert recompute_overrides("none") == {}
    assert recompute_overrides("full")["recompute_granularity"] == "full"
    assert recompute_overrides("selective")["recompute_modules"] == ["core_attn"]
    with pytest.raises(ValueError, match="training.gradient_checkpointing='partial'"):
        TrainingMemoryConfig(gradient_checkpointing="partial")
