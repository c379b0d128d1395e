"""Each megatron-core feature realflow uses, on CPU + gloo through parallel.cpu_compat.

One 2-rank gloo group runs all cases (see parallel.testing); every test below
checks one case.  References are computed with plain torch in the same process.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from parallel.testing import run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 2
CASES = ["case_gptmodel_forward", "case_rng_seeding", "case_ddp_grad_average",
         "case_distributed_optimizer_step", "case_grad_clipping", "case_lr_scheduler",
         "case_pipeline_p2p", "case_vocab_parallel_logprobs"]
# Covered end to end in tests/test_parallel_layouts.py (8 ranks, every layout vs
# transformers): the 1F1B pipeline schedule, sequence parallelism (tp > 1), tied
# embeddings across pipeline stages, distributed HF save/load.


# --------------------------------------------------------------------------- helpers


def _setup(ctx, dp: int = 2):
    from parallel.cpu_compat import apply_cpu_compat, cpu_compat_applied
    from parallel.groups import ParallelStrategy, build_model_groups

    apply_cpu_compat()
    apply_cpu_compat()  # idempotent
    assert cpu_compat_applied()
    if "groups" not in ctx.cache:
        ctx.cache["groups"] = build_model_groups(list(range(dp)), ParallelStrategy(dp, 1, 1))
    return ctx.cache["groups"]


def _tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _model(ctx, seed: int = 3):
    from parallel.mcore_globals import seed_megatron_rng
    from parallel.model import build_gpt_model

    groups = _setup(ctx)
    seed_megatron_rng(seed, groups.tp_rank)
    model, arch = build_gpt_model(_tiny_config(), groups)
    return model, arch


def _batches(n: int = 2, b: int = 2, s: int = 6, vocab: int = 100):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (b, s), generator=g) for _ in range(n)]


def _loss(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, None)
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean().neg()


def _ref_avg_grads(ref, batches):
    """Gradient of the mean over dp ranks' losses (what DDP must produce)."""
    ref.zero_grad()
    for ids in batches:
        (_loss(ref, ids) / len(batches)).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _ddp(model, groups, distributed_optimizer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                        use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(model.config, cfg, model, pg_collection=groups.pg_collection)


def _megatron_optimizer(ddp, groups, **kw):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(use_distributed_optimizer=True, params_dtype=torch.float32, **kw)
    return get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False,
                                  pg_collection=groups.pg_collection)


def _backward_my_batch(ctx, ddp, batches):
    ddp.zero_grad_buffer()
    _loss(ddp, batches[ctx.rank]).backward()
    ddp.finish_grad_sync()


# --------------------------------------------------------------------------- cases


def case_gptmodel_forward(ctx):
    model, arch = _model(ctx)
    assert all(p.device.type == "cpu" for p in model.parameters())
    ids = _batches(1)[0]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        out = model(ids, pos, None)
        assert out.shape == (2, 6, arch.padded_vocab_size) and torch.isfinite(out).all()
        later = ids.clone()
        later[:, 4:] = (later[:, 4:] + 1) % 100  # causal: earlier positions must not change
        out2 = model(later, pos, None)
    assert torch.equal(out[:, :4], out2[:, :4]) and not torch.equal(out[:, 4:], out2[:, 4:])
    assert model.rotary_pos_emb.inv_freq.device.type == "cpu"


def case_rng_seeding(ctx):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    _setup(ctx)
    model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    # megatron seeds "the CUDA generator" (= the CPU generator here) with the seed...
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(123)))
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():  # ...and the tp stream with seed + 2718 + tp_rank
        inside = torch.rand(3)
    assert torch.equal(before, torch.get_rng_state()), "fork must restore the outer RNG state"
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(123 + 2718)))
    with get_cuda_rng_tracker().fork():  # the tracked stream advances, it does not restart
        assert not torch.equal(torch.rand(3), inside)
    # Same seed on every rank -> identical random init of replicated params.
    model, _ = _model(ctx, seed=5)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi)
    model2, _ = _model(ctx, seed=6)
    assert not torch.equal(flat, torch.cat([p.detach().flatten() for p in model2.parameters()]))


def case_ddp_grad_average(ctx):
    groups = _setup(ctx)
    model, _ = _model(ctx)
    ref, _ = _model(ctx)  # same seed: an identical plain copy
    batches = _batches(WORLD)
    expected = _ref_avg_grads(ref, batches)
    ddp = _ddp(model, groups, distributed_optimizer=False)
    _backward_my_batch(ctx, ddp, batches)  # each rank its own batch; all-reduce averages
    for name, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.main_grad, expected[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def case_distributed_optimizer_step(ctx):
    from parallel.optim import EngineOptimizerConfig, build_optimizer

    groups = _setup(ctx)
    model, _ = _model(ctx)
    ref, _ = _model(ctx)  # same seed: an identical plain copy
    batches = _batches(WORLD)
    ddp = _ddp(model, groups, distributed_optimizer=True)
    cfg = EngineOptimizerConfig(lr=1e-2, weight_decay=0.1, beta2=0.999, warmup_steps_proportion=0.0,
                                lr_scheduler_type="constant", min_lr_ratio=0.0, gradient_clipping=0.0,
                                total_train_steps=5)
    opt, sched = build_optimizer(cfg, ddp, groups.pg_collection, torch.float32)
    # megatron: no weight decay on biases and 1-D (norm) params
    decay = [p for n, p in ref.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in ref.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    for _ in range(2):
        _ref_avg_grads(ref, batches)
        ref_opt.step()
        opt.zero_grad()
        _backward_my_batch(ctx, ddp, batches)
        ok, _, _ = opt.step()
        sched.step(increment=1)
        assert ok
    # Optimizer state is sharded over dp: this rank holds about half of it.
    n_state = sum(s["exp_avg"].numel() for o in opt.chained_optimizers
                  for s in o.optimizer.state.values())
    n_params = sum(p.numel() for p in model.parameters())
    assert n_state < 0.75 * n_params, (n_state, n_params)
    ref_params = dict(ref.named_parameters())
    for name, p in ddp.module.named_parameters():  # all-gathered full params on every rank
        torch.testing.assert_close(p, ref_params[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def case_grad_clipping(ctx):
    groups = _setup(ctx)
    model, _ = _model(ctx)
    ref, _ = _model(ctx)  # same seed: an identical plain copy
    batches = _batches(WORLD)
    grads = _ref_avg_grads(ref, batches)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    ddp = _ddp(model, groups, distributed_optimizer=True)
    max_norm = norm / 4
    # DistributedOptimizer only takes Adam; with a huge eps the first Adam update is
    # lr * g / (|g| + eps), i.e. proportional to the (clipped) gradient itself.
    lr, eps = 1.0, 1e3
    opt = _megatron_optimizer(ddp, groups, lr=lr, weight_decay=0.0, adam_eps=eps,
                              clip_grad=max_norm)
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    _backward_my_batch(ctx, ddp, batches)
    ok, grad_norm, _ = opt.step()
    assert ok and abs(grad_norm - norm) < 1e-5 * norm, (grad_norm, norm)
    coeff = max_norm / (norm + 1e-6)
    for name, p in ddp.module.named_parameters():
        g = coeff * grads[name]
        torch.testing.assert_close(before[name] - p.detach(), lr * g / (g.abs() + eps),
                                   atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def case_lr_scheduler(ctx):
    from parallel.optim import EngineOptimizerConfig, build_optimizer

    groups = _setup(ctx)
    model, _ = _model(ctx)
    ddp = _ddp(model, groups, distributed_optimizer=True)
    lr, total, warm, lo = 1e-3, 10, 2, 1e-4
    for style in ("cosine", "linear", "constant"):
        cfg = EngineOptimizerConfig(lr=lr, warmup_steps_proportion=0.2, lr_scheduler_type=style,
                              min_lr_ratio=0.1, total_train_steps=total)
        opt, sched = build_optimizer(cfg, ddp, groups.pg_collection, torch.float32)
        got = []
        for _ in range(total + 1):
            got.append(opt.param_groups[0]["lr"])
            sched.step(increment=1)
        for k, value in enumerate(got):
            if k <= warm:
                want = lr * k / warm
            elif style == "constant":
                want = lr
            else:
                frac = (k - warm) / (total - warm)
                coeff = 0.5 * (math.cos(math.pi * frac) + 1) if style == "cosine" else 1 - frac
                want = lo + (lr - lo) * coeff
            assert abs(value - want) < 1e-12, (style, k, value, want)
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        EngineOptimizerConfig(lr_scheduler_type="exp")


def case_pipeline_p2p(ctx):
    """megatron's P2PCommunicator (batched isend/irecv on gloo, CPU buffers): activations
    forward, gradients backward, between the two stages of a pp = 2 group."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.model_config import transformer_config_from_hf

    _setup(ctx)
    g = build_model_groups([1, 0], ParallelStrategy(pp=2))  # rank 1 is the first stage
    cfg = transformer_config_from_hf(_tiny_config(), pipeline_model_parallel_size=2)
    comm = P2PCommunicator(pp_group=g.pp_group, config=cfg)
    shape = (3, 2, 32)
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    if g.is_first_stage:
        comm.send_forward(x, is_last_stage=False)
        grad = comm.recv_backward(shape, is_last_stage=False)
        assert grad.device.type == "cpu" and torch.equal(grad, -2 * x)
    else:
        got = comm.recv_forward(shape, is_first_stage=False)
        assert got.device.type == "cpu" and got.requires_grad and torch.equal(got, x)
        comm.send_backward(-2 * got.detach(), is_first_stage=False)


def case_vocab_parallel_logprobs(ctx):
    """Distributed log-softmax over a tp = 2 group == full-vocab torch, values AND
    gradients, with megatron's padded vocab columns masked out."""
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.outputs import vocab_parallel_argmax, vocab_parallel_logprobs

    _setup(ctx)
    g = build_model_groups([0, 1], ParallelStrategy(tp=2))
    vocab, padded, n = 100, 128, 7  # columns 100..127 are padding (rank 1's tail)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(n, padded, generator=gen) * 3
    full[:, vocab:] = 50.0  # padding must not leak into the softmax
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[0] = 70  # a target in rank 1's shard
    w1, w2 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    ref = full[:, :vocab].clone().requires_grad_(True)
    logp = torch.log_softmax(ref / 0.7, -1)
    ref_lp = logp.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    (w1 * ref_lp + w2 * ref_ent).sum().backward()

    half = padded // 2
    shard = full[:, ctx.rank * half:(ctx.rank + 1) * half].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(shard, targets, g.tp_group, ctx.rank * half, vocab,
                                      temperature=0.7, entropy=True)
    (w1 * lp + w2 * ent).sum().backward()  # the replicated loss, as in training
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    want_grad = torch.zeros(n, padded)
    want_grad[:, :vocab] = ref.grad
    torch.testing.assert_close(shard.grad, want_grad[:, ctx.rank * half:(ctx.rank + 1) * half],
                               atol=1e-6, rtol=0)
    assert torch.equal(vocab_parallel_argmax(shard.detach(), g.tp_group, ctx.rank * half, vocab),
                       full[:, :vocab].argmax(-1))


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=150,
                     pythonpath=[__file__.rsplit("/", 1)[0]])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
def test_megatron_feature_on_cpu(results, case):
    assert results[case].ok, results[case].error


# --------------------------------------------------------------------------- import


def test_megatron_is_imported_without_the_compile_stack_and_wandb_stays_importable():
    """A CPU process imports megatron-core without TorchDynamo/Inductor (~3.5 s per process),
    megatron's fusers are off, ``torch.compile`` is the real one again, and ``import wandb``
    afterwards (realflow's own W&B logging) loads the real package."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from parallel.cpu_compat import import_megatron_core\n"
        "import_megatron_core(); import_megatron_core()\n"
        "import megatron.core.models.gpt.gpt_model, megatron.core.optimizer, megatron.core.distributed\n"
        "from megatron.core import jit\n"
        "assert 'torch._dynamo' not in sys.modules and 'torch._inductor' not in sys.modules\n"
        "assert jit.jit_fuser(len) is len, jit.jit_fuser\n"
        "assert torch.compile is real\n"
        "import wandb\n"
        "assert wandb is not None and hasattr(wandb, 'init'), wandb\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
