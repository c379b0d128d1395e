"""A group's shared prompt computed once (``training.shared_prefix``) == every sample computing it,
on a real 2-rank gloo group, pad-free rows both ways.

The batch is GRPO-shaped: groups of 4, 1 and 3 samples behind prompts of 12, 20 and 9 tokens,
responses of 1..15 tokens, one sample fully masked, and a token budget that cuts a group across
two micro-batches. For d1, d2, t2 (sequence parallel) and p2 (1F1B):

* actor log-probs and entropy (the reference's log-probs are the same call), critic values:
  shared on vs off within TOL relative (fp32);
* one train step (actor and critic): loss, grad norm, gradients (dp = 1) and the parameter update
  within TOL; ``n_computed_tokens`` smaller by the prompts not recomputed.

The transform sits below every loss (the last stage maps the row back to the batch's own token
order before a loss sees it), so the loss here -- log-probs and entropy of every token under a
mask -- stands for every preset's.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases
from test_parallel_pad_free import _opt_cfg, _rel, critic_loss, lm_loss, step_errors, weight

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 2
TOL = 1e-5  # max |on - off| / max |off|, fp32
LAYOUTS = {"d1": (1, 1, 1), "d2": (2, 1, 1), "t2": (1, 2, 1), "p2": (1, 1, 2)}
GROUPS = [(12, [5, 1, 15, 7]), (20, [9]), (9, [3, 11, 2])]  # (prompt length, response lengths)
MASKED = 2  # this sample's loss mask is all zeros
MB_TOKENS = 80  # the first group spans two micro-batches
CASES = ["case_setup"] + [f"case_{name}" for name in LAYOUTS] + ["case_on_refused"]


def _batch():
    """(packed ids, seqlens, response mask) of the whole batch, groups in order."""
    g = torch.Generator().manual_seed(21)
    seqs, masks = [], []
    for p, rs in GROUPS:
        prompt = torch.randint(0, 150, (p,), generator=g)
        for r in rs:
            seqs.append(torch.cat([prompt, torch.randint(0, 150, (r,), generator=g)]))
            m = torch.zeros(p + r)
            m[p - 1:p + r - 1] = 1.0  # the response tokens' predictions
            masks.append(m if len(masks) != MASKED else torch.zeros(p + r))
    return seqs, masks


def _micro_batches(dp: int, dp_rank: int, critic: bool):
    """This dp rank's micro-batches: (ids, lens, (target, mask)); dp = 2 splits the batch in two
    contiguous halves (groups whole, but for one)."""
    seqs, masks = _batch()
    half = (len(seqs) + 1) // 2
    idx = list(range(len(seqs))) if dp == 1 else list(range(half) if dp_rank == 0 else range(half, len(seqs)))
    parts, cur, acc = [], [], 0
    for i in idx:
        if cur and acc + len(seqs[i]) > MB_TOKENS:
            parts.append(cur)
            cur, acc = [], 0
        cur.append(i)
        acc += len(seqs[i])
    parts.append(cur)
    out = []
    for part in parts:
        cat = torch.cat([seqs[i] for i in part])
        lens = [len(seqs[i]) for i in part]
        if critic:
            target = cat.float() / 150 - 0.5
        else:
            target = torch.cat([torch.cat([seqs[i][1:], seqs[i][:1]]) for i in part])
        out.append((cat, lens, (target, torch.cat([masks[i] for i in part]))))
    return out


def _engine(ctx, layout, name, shared, critic=False, attention="sdpa"):
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
                          attention=attention, training=TrainingMemoryConfig(
                              pad_free="on" if attention == "sdpa" else "auto", shared_prefix=shared))


def _run(ctx, layout, critic):
    name = "critic" if critic else "lm"
    seqs, _ = _batch()
    ids, lens = torch.cat(seqs), [len(s) for s in seqs]
    res = {}
    for mode in ("off", "on"):
        eng = _engine(ctx, layout, name, mode, critic=critic)
        if eng is None:
            continue
        assert eng.shared_prefix == mode
        r = res[mode] = {}
        if critic:
            r["values"] = eng.values(ids, lens, MB_TOKENS)
        else:
            both = eng.logprobs(ids, lens, MB_TOKENS, with_entropy=True)
            r["logprobs"], r["entropy"] = both if both is not None else (None, None)
        before = eng.full_hf_state()
        r["stats"] = eng.train_batch(_micro_batches(layout[0], eng.groups.dp_rank, critic),
                                     critic_loss if critic else lm_loss, weight)
        if layout[0] == 1:
            r["grads"] = eng.full_hf_grads()
        after = eng.full_hf_state()
        if after is not None:
            r["update"] = {k: after[k] - before[k] for k in after}
        r["output_rank"] = eng.is_output_rank
    return res or None


def _compare(res, critic):
    off, on = res["off"], res["on"]
    errs = {}
    for k in ("values",) if critic else ("logprobs", "entropy"):
        if off["output_rank"]:
            errs[k] = _rel(on[k], off[k])
    so, sn = off["stats"], on["stats"]
    for k in ("loss", "grad_norm"):
        errs[k] = abs(sn[k] - so[k]) / abs(so[k])
    assert sn["n_tokens"] == so["n_tokens"]
    assert sn["n_computed_tokens"] < so["n_computed_tokens"], (sn, so)  # prompts not recomputed
    assert sn["flops_useful"] == so["flops_useful"] and sn["flops_computed"] < so["flops_computed"] <= \
        so["flops_useful"] * 1.1, (sn, so)  # (off: pad-free, only the p2 filler beyond useful)
    errs.update(step_errors(off, on))
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"shared prefix != recomputed beyond {TOL}: {bad}"
    return {"errors": errs, "computed": [so["n_computed_tokens"], sn["n_computed_tokens"]]}


def _case(ctx, name):
    out = {}
    for critic in (False, True):
        res = _run(ctx, LAYOUTS[name], critic)
        if res is not None:
            out["critic" if critic else "actor"] = _compare(res, critic)
    return out


def case_setup(ctx):
    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "lm"), "qwen2", seed=3, tie_word_embeddings=True)
        make_tiny_hf(os.path.join(ctx.tmpdir, "critic"), "qwen2", seed=4, critic=True, tie_word_embeddings=False)
    dist.barrier()


def case_d1(ctx):
    return _case(ctx, "d1")


def case_d2(ctx):
    return _case(ctx, "d2")


def case_t2(ctx):
    return _case(ctx, "t2")


def case_p2(ctx):
    return _case(ctx, "p2")


def case_on_refused(ctx):
    """``on`` where the model cannot share (megatron's attention: padded rows) and ``on`` for a
    batch with nothing to share: one-line errors; ``auto`` on that batch computes every token."""
    msgs = []
    try:
        _engine(ctx, (1, 1, 1), "lm", "on", attention="megatron")
    except ValueError as e:
        msgs.append(str(e))
    eng = _engine(ctx, (1, 1, 1), "lm", "on")
    if eng is None:
        return None
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.tensor([7]), torch.randint(0, 150, (9,), generator=g), torch.tensor([8]),
                     torch.randint(0, 150, (9,), generator=g)])  # two sequences differing at the start
    batch = [(ids, [10, 10], (torch.roll(ids, -1), torch.ones(20)))]
    try:
        eng.train_batch(batch, lm_loss, weight)
    except ValueError as e:
        msgs.append(str(e))
    assert len(msgs) == 2 and all("\n" not in m and "training.shared_prefix=on" in m for m in msgs), msgs
    assert "pad_free" in msgs[0] and "share their first" in msgs[1], msgs
    auto = _engine(ctx, (1, 1, 1), "lm", "auto")
    stats = auto.train_batch(batch, lm_loss, weight)
    assert stats["n_computed_tokens"] == stats["n_tokens"] == 20 and stats["flops_useful"] == stats["flops_computed"]
    return {"messages": msgs}


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=300,
                     pythonpath=[os.path.dirname(__file__)])


@pytest.mark.parametrize("case", CASES)
def test_shared_prefix(results, case):
    r = results[case]
    assert r.ok, r.error


def test_plan_groups_runs_with_a_common_prefix_and_maps_tokens_back():
    from parallel.shared_prefix import plan_shared, shared_row, tree_mask

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12] + [5, 5]
                       + [1, 2, 3, 4, 5, 6, 7, 8, 0])
    plan = plan_shared(ids, [10, 11, 2, 9])
    # the first two share 9 tokens; the last shares 8 with the first but is not next to it
    assert plan.groups == ((0, 2, 9), (2, 3, 0), (3, 4, 0)) and plan.computed == 32 - 9
    row, pos, segs, rows = shared_row(ids, plan)
    assert row.tolist()[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert pos.tolist()[:12] == list(range(10)) + [9, 10]  # both responses continue at 9
    assert segs == [12, 2, 9] and rows.trees == ((9, 1, 2), (), ())
    assert torch.equal(row[rows.expand], ids)  # every token reads its own row
    masks = tree_mask((2, 1, 3))
    assert masks[1].tolist() == [[False, False, False, True, True], [False, False, False, False, True],
                                 [False] * 5]
    assert plan_shared(ids[:20], [10, 10], min_prefix=10).groups == ((0, 1, 0), (1, 2, 0))
    # a group of three behind a 7-token prompt, the first two also agreeing on a response token,
    # then a sequence sharing only 2 tokens with them: the run that saves most wins
    a, b = [9, 9, 1, 2, 3, 4, 5], [9, 9, 7, 7]
    seqs = [a + [6, 1], a + [6, 2], a + [8, 3], b + [1, 2, 3, 4, 5]]
    plan = plan_shared(torch.tensor(sum(seqs, [])), [len(x) for x in seqs], min_prefix=2)
    assert plan.groups == ((0, 3, 7), (3, 4, 0)), plan.groups


def test_shared_prefix_option_checked():
    from realflow.api.model_options import TrainingMemoryConfig

    assert TrainingMemoryConfig().shared_prefix == "auto"
    with pytest.raises(ValueError, match="training.shared_prefix='yes' must be one of auto, on, off"):
        TrainingMemoryConfig(shared_prefix="yes")


def test_flops_count_every_matmul_weight_and_causal_pair(tmp_path):
    """Per token: 2 FLOPs per weight of every linear layer and the LM head of a real HF model;
    attention pairs: causal per sequence, a shared segment's branches over the prefix and themselves."""
    from parallel.flops import TokenFlops, causal_pairs, row_pairs

    _, model = make_tiny_hf(str(tmp_path), "qwen2", seed=1, tie_word_embeddings=False)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    flops = TokenFlops.from_hf(cfg)
    assert flops.per_token == 2.0 * weights
    assert flops.per_pair == 4.0 * cfg.num_hidden_layers * cfg.hidden_size  # heads * head_dim
    assert causal_pairs(3) == 6 and row_pairs([3, 2]) == 6 + 3
    # [P=2 | R1=1 | R2=3]: P 3 pairs, R1 2 + 1, R2 3 * 2 + 6
    assert row_pairs([6], [(2, 1, 3)]) == 3 + 3 + 12
    assert flops.train(10, 5) == 3 * (10 * flops.per_token + 5 * flops.per_pair)
