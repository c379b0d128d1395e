"""The engine's non-finite checks on a real 2-rank gloo group, in d2 and t2 (parallel.nonfinite).

A micro-batch whose loss is NaN (a loss hook multiplies it by NaN), a loss that is finite but
whose gradient is NaN, and an optimizer that overflows (an infinite learning rate set on the
live optimizer) each meet the check they should: in ``skip`` mode the parameters, the
optimizer states and the learning-rate schedule stay bit for bit what they were; in ``stop``
mode exactly one rank raises, naming the micro-batch and its samples; more consecutive skips
than allowed stop; a good step in between resets the count.
"""
from __future__ import annotations

import os

import pytest

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
LAYOUTS = {"d2": (2, 1, 1), "t2": (1, 2, 1)}
CASES = ["case_setup"] + [f"case_{name}" for name in LAYOUTS]


def case_setup(ctx):
    import torch.distributed as dist

    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "lm"), "qwen2", seed=5, **TINY)
    dist.barrier()


def _batch(dp_rank: int, poison: str = ""):
    """Two micro-batches of this dp rank; ``poison``: "loss" / "grad" in the second one of dp rank 0."""
    import torch

    g = torch.Generator().manual_seed(11 + dp_rank)
    out, ids = [], []
    for k in range(2):
        lens = [5, 9]
        tokens = torch.randint(0, TINY["vocab_size"], (sum(lens),), generator=g)
        bad = poison if (dp_rank == 0 and k == 1) else ""
        out.append((tokens, lens, {"targets": torch.roll(tokens, -1), "poison": bad}))
        ids.append([f"r{dp_rank}-mb{k}-s{j}" for j in range(len(lens))])
    return out, ids


def _loss(out, extra):
    import torch

    class NanGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    lp = out.logprobs(extra["targets"])
    if extra["poison"] == "grad":
        lp = NanGrad.apply(lp)
    loss = -lp.sum()
    if extra["poison"] == "loss":
        loss = loss * float("nan")
    return loss, {}


def _snapshot(eng):
    """Every tensor a skipped step must leave alone: parameters, Adam states, the schedule."""
    from parallel.nonfinite import suboptimizers

    snap = {f"p:{n}": p.detach().clone() for n, p in eng.module.named_parameters()}
    for i, opt in enumerate(suboptimizers(eng.optimizer)):
        for j, (param, state) in enumerate(opt.optimizer.state.items()):
            for k, v in state.items():
                snap[f"s{i}:{j}:{k}"] = v.detach().clone() if hasattr(v, "clone") else v
    snap["lr_steps"] = eng.scheduler.num_steps
    return snap


def _same(a, b) -> list[str]:
    import torch

    diff = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if hasattr(x, "shape") and not torch.equal(x, y) or not hasattr(x, "shape") and x != y:
            diff.append(k)
    return diff


def _run(ctx, layout):
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.backend import NonFiniteError

    dp, tp, pp = layout
    groups = build_model_groups([0, 1], ParallelStrategy(dp=dp, tp=tp, pp=pp))
    path = os.path.join(ctx.tmpdir, "lm")
    eng = MegatronEngine(AutoConfig.from_pretrained(path), groups, path,
                         EngineOptimizerConfig(lr=1e-3, total_train_steps=20, gradient_clipping=1.0), seed=1)
    res = {}

    def step(poison=""):
        mbs, ids = _batch(groups.dp_rank, poison)
        try:
            return eng.train_batch(mbs, _loss, lambda extra: 14.0, sample_ids=ids), None
        except NonFiniteError as e:
            return None, str(e)

    good, err = step()
    assert err is None and good["nonfinite_skipped"] == 0.0 and good["update_successful"] == 1.0

    for poison in ("loss", "grad"):
        eng.configure_nonfinite("skip", 3)
        before = _snapshot(eng)
        st, err = step(poison)
        assert err is None and st["nonfinite_skipped"] == 1.0 and st["update_successful"] == 0.0, (poison, st, err)
        assert not _same(before, _snapshot(eng)), (poison, _same(before, _snapshot(eng)))  # bit for bit
        eng.configure_nonfinite("stop", 3)
        st, err = step(poison)
        res[f"stop_{poison}"] = err
        assert (err is None) == (st is not None)
        assert not _same(before, _snapshot(eng))
    # skips in a row: the count is of consecutive steps, a good step resets it
    eng.configure_nonfinite("skip", 1)
    assert step("loss")[1] is None
    assert step()[0]["nonfinite_skipped"] == 0.0
    assert step("loss")[1] is None
    st, err = step("loss")
    res["too_many"] = err
    # an optimizer that overflows: the update is in, so this stops in any mode
    eng.configure_nonfinite("skip", 3)
    for group in eng.optimizer.param_groups:
        group["lr"] = float("inf")
    res["params"] = step()[1]
    return res


def case_d2(ctx):
    return _run(ctx, LAYOUTS["d2"])


def case_t2(ctx):
    return _run(ctx, LAYOUTS["t2"])


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=2, timeout=300,
                     pythonpath=[os.path.dirname(os.path.abspath(__file__))])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nonfinite_steps_change_nothing_and_one_rank_names_the_micro_batch(results, layout):
    assert results["case_setup"].ok, results["case_setup"].error
    res = results[f"case_{layout}"]
    assert res.ok, res.error
    by_rank = res.data
    # stop: exactly one rank reports, the output rank of the replica that holds the bad micro-batch
    loss_reports = [r for r in by_rank.values() if r["stop_loss"]]
    assert len(loss_reports) == 1, by_rank
    msg = loss_reports[0]["stop_loss"]
    assert "non-finite loss (nan) in micro-batch 1 of data-parallel rank 0" in msg, msg
    assert "samples ['r0-mb1-s0', 'r0-mb1-s1']" in msg and "the update was not applied" in msg, msg
    grad_reports = [r["stop_grad"] for r in by_rank.values() if r["stop_grad"]]
    assert len(grad_reports) == 1 and "non-finite gradient norm (nan) after the data-parallel reduction" \
        in grad_reports[0], by_rank
    too_many = [r["too_many"] for r in by_rank.values() if r["too_many"]]
    assert len(too_many) == 1 and "2 consecutive steps skipped > max_nonfinite_skips=1" in too_many[0], by_rank
    # every rank checks its own parameters after the update
    assert all("parameters not finite after an update" in r["params"] for r in by_rank.values()), by_rank
