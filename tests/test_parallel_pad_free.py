"""Pad-free micro-batches (``training.pad_free``) == the padded path, on a real 2-rank gloo group.

For d1, d2, t2 (sequence parallel: the filler to a multiple of tp) and p2 (1F1B: one common
row length, the filler to the longest micro-batch), with lengths 1..37 in several micro-batches:

* actor log-probs and entropy, critic values: pad-free on vs off within TOL relative (fp32);
* one train step (actor and critic): loss, grad norm, gradients (dp = 1) and the parameter
  update (every layout) within TOL relative;
* ``n_computed_tokens``: the real token count pad-free without filler (d1), the padded count off;
* an MoE model (routing replay, load-balancing loss) in d1 and t2: log-probs, the train step and its
  routing statistics;
* a vision-language model (Qwen2.5-VL: M-RoPE positions, image features) in d1, t2 and p2: logits
  and the train step;
* ``training.pad_free=on`` on an unsupported model (megatron's attention) is a one-line error,
  ``auto`` falls back to padding there.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 2
TOL = 1e-5  # max |on - off| / max |off|, fp32
LAYOUTS = {"d1": (1, 1, 1), "d2": (2, 1, 1), "t2": (1, 2, 1), "p2": (1, 1, 2)}
LENS = [1, 37, 3, 20, 2, 11, 5, 29, 1, 14]  # very different lengths, two of length 1
MB_TOKENS = 40  # several micro-batches per pass
MOE = dict(vocab_size=150, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, max_position_embeddings=128)
MOE_LAYOUTS = {"moe_d1": (1, 1, 1), "moe_t2": (1, 2, 1)}
VL_LAYOUTS = {"vl_d1": (1, 1, 1), "vl_t2": (1, 2, 1), "vl_p2": (1, 1, 2)}
CASES = (["case_setup"] + [f"case_{name}" for name in LAYOUTS] + [f"case_{name}" for name in MOE_LAYOUTS]
         + [f"case_{name}" for name in VL_LAYOUTS] + ["case_unsupported"])


def _ids():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 150, (sum(LENS),), generator=g)


def _micro_batches(dp: int, dp_rank: int, critic: bool):
    """This dp rank's micro-batches of the step: (ids, lens, (targets, mask)), 2-3 sequences each."""
    ids = _ids()
    offs = [0]
    for n in LENS:
        offs.append(offs[-1] + n)
    seqs = [ids[offs[i]:offs[i + 1]] for i in range(len(LENS))]
    mine = seqs[dp_rank::dp]
    groups = [mine[i:i + 2] for i in range(0, len(mine), 2)] if dp == 1 else [mine[:3], mine[3:]]
    out = []
    for grp in groups:
        cat = torch.cat(grp)
        lens = [len(s) for s in grp]
        if critic:
            target = cat.float() / 150 - 0.5
        else:
            target = torch.cat([torch.cat([s[1:], s[:1]]) for s in grp])
        mask = torch.ones(len(cat))
        mask[torch.tensor(lens).cumsum(0) - 1] = 0.0
        out.append((cat, lens, (target, mask)))
    return out


def lm_loss(out, extra):
    targets, mask = extra
    logp, ent = out.logprobs_and_entropy(targets)
    return -(mask * (logp + 0.01 * ent)).sum(), {}


def critic_loss(out, extra):
    returns, mask = extra
    return (mask * (out.values() - returns) ** 2).sum(), {}


def weight(extra):
    return float(extra[1].sum()) or 1.0


def _opt_cfg():
    from parallel.optim import EngineOptimizerConfig

    # eps = 1: Adam's first update is ~lr * g (linear in the gradient), so a tiny gradient's
    # last-bit difference is not amplified to a full lr step; no clipping, no decay
    return EngineOptimizerConfig(lr=0.1, weight_decay=0.0, eps=1.0, warmup_steps_proportion=0.0,
                                 lr_scheduler_type="constant", min_lr_ratio=0.0, gradient_clipping=0.0,
                                 total_train_steps=2)


def _engine(ctx, layout, name, pad_free, critic=False, attention="sdpa"):
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from realflow.api.model_options import TrainingMemoryConfig

    dp, tp, pp = layout
    groups = build_model_groups(list(range(dp * tp * pp)), ParallelStrategy(dp=dp, tp=tp, pp=pp))
    if not groups.is_member:
        return None
    path = os.path.join(ctx.tmpdir, name)
    return MegatronEngine(AutoConfig.from_pretrained(path), groups, path, _opt_cfg(), seed=1, critic=critic,
                          attention=attention, training=TrainingMemoryConfig(pad_free=pad_free))


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _run(ctx, layout, critic):
    """Everything one engine computes (outputs, step stats, gradients, update), off then on."""
    name = "critic" if critic else "lm"
    res = {}
    for mode in ("off", "on"):
        eng = _engine(ctx, layout, name, mode, critic=critic)  # every rank: new groups are world-collective
        if eng is None:
            continue
        assert eng.pad_free == (mode == "on")
        r = res[mode] = {}
        ids = _ids()
        if critic:
            r["values"] = eng.values(ids, LENS, MB_TOKENS)
        else:
            both = eng.logprobs(ids, LENS, MB_TOKENS, with_entropy=True)
            r["logprobs"], r["entropy"] = both if both is not None else (None, None)
        before = eng.full_hf_state()
        mbs = _micro_batches(layout[0], eng.groups.dp_rank, critic)
        r["stats"] = eng.train_batch(mbs, critic_loss if critic else lm_loss, weight)
        if layout[0] == 1:
            r["grads"] = eng.full_hf_grads()
        after = eng.full_hf_state()
        if after is not None:
            r["update"] = {k: after[k] - before[k] for k in after}
        r["output_rank"] = eng.is_output_rank
    return res or None


def step_errors(off, on):
    """Relative max errors of the gradients (when taken) and the parameter update, on vs off."""
    errs = {}
    for key in ("grads", "update"):
        if on.get(key) is not None:
            scale = max(t.abs().max().item() for t in off[key].values())
            errs[key] = max((on[key][n] - t).abs().max().item() for n, t in off[key].items()) / scale
    return errs


def _compare(res, layout, critic):
    off, on = res["off"], res["on"]
    errs = {}
    for k in ("values",) if critic else ("logprobs", "entropy"):
        if off["output_rank"]:
            errs[k] = _rel(on[k], off[k])
    so, sn = off["stats"], on["stats"]
    for k in ("loss", "grad_norm"):
        errs[k] = abs(sn[k] - so[k]) / abs(so[k])
    assert sn["n_tokens"] == so["n_tokens"] == sum(LENS)
    assert so["n_computed_tokens"] > so["n_tokens"]  # these batches pad
    assert sn["n_tokens"] <= sn["n_computed_tokens"] < so["n_computed_tokens"]
    if layout == (1, 1, 1):
        assert sn["n_computed_tokens"] == sn["n_tokens"], sn  # no filler without sp / pp
    errs.update(step_errors(off, on))
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"pad-free != padded beyond {TOL}: {bad}"
    return {"errors": errs, "computed": [so["n_computed_tokens"], sn["n_computed_tokens"]]}


def _case(ctx, name):
    layout = LAYOUTS[name]
    out = {}
    for critic in (False, True):
        res = _run(ctx, layout, critic)
        if res is not None:
            out["critic" if critic else "actor"] = _compare(res, layout, critic)
    return out


def case_setup(ctx):
    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "lm"), "qwen2", seed=3, tie_word_embeddings=True)
        make_tiny_hf(os.path.join(ctx.tmpdir, "critic"), "qwen2", seed=4, critic=True, tie_word_embeddings=False)
        make_tiny_hf(os.path.join(ctx.tmpdir, "moe"), "qwen3_moe", seed=5, **MOE)
        from test_parallel_vl import MODEL as VL

        make_tiny_hf(os.path.join(ctx.tmpdir, "vl"), seed=6, **VL)
    dist.barrier()


def case_d1(ctx):
    return _case(ctx, "d1")


def case_d2(ctx):
    return _case(ctx, "d2")


def case_t2(ctx):
    return _case(ctx, "t2")


def case_p2(ctx):
    return _case(ctx, "p2")


def _routes():
    """Replayed experts [tokens, layers, k] (2 of 8, distinct); every 5th token keeps its router's choice."""
    g = torch.Generator().manual_seed(12)
    r = torch.rand(sum(LENS), MOE["num_hidden_layers"], 8, generator=g).argsort(-1)[..., :2].sort(-1).values
    r[::5] = -1
    return r


def _moe_case(ctx, name):
    from realflow.api.keys import ROUTED_EXPERTS

    layout = MOE_LAYOUTS[name]
    res = {}
    for mode in ("off", "on"):
        eng = _engine(ctx, layout, "moe", mode)
        if eng is None:
            continue
        assert eng.pad_free == (mode == "on")
        r = res[mode] = {}
        ids, routes = _ids(), _routes()
        r["logprobs"] = eng.logprobs(ids, LENS, MB_TOKENS, routed_experts=routes)
        mbs, off = [], 0
        for cat, lens, (targets, mask) in _micro_batches(1, 0, False):
            mbs.append((cat, lens, {"targets": targets, "mask": mask, ROUTED_EXPERTS: routes[off:off + len(cat)]}))
            off += len(cat)
        r["stats"] = eng.train_batch(mbs, lambda out, ex: lm_loss(out, (ex["targets"], ex["mask"])),
                                     lambda ex: float(ex["mask"].sum()))
        r["grads"] = eng.full_hf_grads()
        r["output_rank"] = eng.is_output_rank
    if not res:
        return None
    errs = {}
    if res["off"]["output_rank"]:
        errs["logprobs"] = _rel(res["on"]["logprobs"], res["off"]["logprobs"])
    so, sn = res["off"]["stats"], res["on"]["stats"]
    assert so["moe/replayed_tokens"] == sn["moe/replayed_tokens"] > 0, (so, sn)
    for k in ("loss", "grad_norm", "moe/aux_loss", "moe/expert_load", "moe/replay_mismatch"):
        errs[k] = abs(sn[k] - so[k]) / max(abs(so[k]), 1e-30)
    if res["on"]["grads"] is not None:
        go, gn = res["off"]["grads"], res["on"]["grads"]
        scale = max(g.abs().max().item() for g in go.values())
        errs["grads"] = max((gn[n] - g).abs().max().item() for n, g in go.items()) / scale
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"MoE pad-free != padded beyond {TOL}: {bad}"
    return {"errors": errs, "computed": [so["n_computed_tokens"], sn["n_computed_tokens"]]}


def case_moe_d1(ctx):
    return _moe_case(ctx, "moe_d1")


def case_moe_t2(ctx):
    return _moe_case(ctx, "moe_t2")


def _vl_case(ctx, name):
    """Sequences mixing text, one and two images (test_parallel_vl's samples): two micro-batches."""
    import test_parallel_vl as vl

    layout = VL_LAYOUTS[name]
    samples = vl._samples()
    ids = torch.cat([i for i, _ in samples])
    lens = [len(i) for i, _ in samples]
    images = [im for _, im in samples]
    res = {}
    for mode in ("off", "on"):
        eng = _engine(ctx, layout, "vl", mode)
        if eng is None:
            continue
        assert eng.pad_free == (mode == "on")
        r = res[mode] = {"logits": eng.forward(ids, lens, 48, images=images)}
        r["stats"] = eng.train_batch([vl._micro_batch(samples[:3]), vl._micro_batch(samples[3:])],
                                     vl.nll_loss, vl.nll_weight)
        r["grads"] = eng.full_hf_grads()
    if not res:
        return None
    errs = {}
    if res["off"]["logits"] is not None:
        errs["logits"] = _rel(res["on"]["logits"], res["off"]["logits"])
    for k in ("loss", "grad_norm"):
        errs[k] = abs(res["on"]["stats"][k] - res["off"]["stats"][k]) / abs(res["off"]["stats"][k])
    if res["on"]["grads"] is not None:
        go, gn = res["off"]["grads"], res["on"]["grads"]
        scale = max(g.abs().max().item() for g in go.values())
        errs["grads"] = max((gn[n] - g).abs().max().item() for n, g in go.items()) / scale
        errs["visual_grads"] = max((gn[n] - g).abs().max().item() for n, g in go.items()
                                   if n.startswith("visual.")) / scale
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"VL pad-free != padded beyond {TOL}: {bad}"
    return {"errors": errs, "computed": [res["off"]["stats"]["n_computed_tokens"],
                                         res["on"]["stats"]["n_computed_tokens"]]}


def case_vl_d1(ctx):
    return _vl_case(ctx, "vl_d1")


def case_vl_t2(ctx):
    return _vl_case(ctx, "vl_t2")


def case_vl_p2(ctx):
    return _vl_case(ctx, "vl_p2")


def case_unsupported(ctx):
    msg = None
    try:
        eng = _engine(ctx, (1, 1, 1), "lm", "on", attention="megatron")
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and "training.pad_free=on" in msg and "DotProductAttention" in msg, msg
    else:
        assert eng is None, "pad_free=on with megatron's attention did not raise"
    eng = _engine(ctx, (1, 1, 1), "lm", "auto", attention="megatron")
    if eng is None:
        return None
    assert not eng.pad_free and msg is not None
    stats = eng.train_batch(_micro_batches(1, 0, False), lm_loss, weight)
    assert stats["n_computed_tokens"] > stats["n_tokens"]
    return {"message": msg}


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=300,
                     pythonpath=[os.path.dirname(__file__)])


@pytest.mark.parametrize("case", CASES)
def test_pad_free(results, case):
    r = results[case]
    assert r.ok, r.error


def test_pad_free_option_checked():
    from realflow.api.model_options import TrainingMemoryConfig

    assert TrainingMemoryConfig().pad_free == "auto"
    with pytest.raises(ValueError, match="training.pad_free='yes' must be one of auto, on, off"):
        TrainingMemoryConfig(pad_free="yes")


def test_packed_row_layout():
    from parallel.packed_batch import pack_micro_batch, pad_free_batches

    pb = pack_micro_batch(torch.arange(1, 11), [1, 4, 5], 13)
    assert pb.input_ids.tolist() == [list(range(1, 11)) + [0, 0, 0]]
    assert pb.position_ids.tolist() == [[0, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]]  # restart per sequence
    assert pb.valid.tolist() == [[True] * 10 + [False] * 3]  # the filler segment is dropped
    assert pb.packed.cu_seqlens_q.tolist() == [0, 1, 5, 10, 13] and pb.packed.max_seqlen_q == 5
    assert pad_free_batches([7, 10, 3], 2, common=False) == ([8, 10, 4], 10)  # sp: a multiple of tp
    assert pad_free_batches([7, 10, 3], 1, common=True) == ([10, 10, 10], 10)  # pp: one shape
    with pytest.raises(ValueError, match="total=9 < 10 tokens"):
        pack_micro_batch(torch.arange(10), [10], 9)
