"""PPO-family losses, KL estimators and controllers against per-token reference formulas.

Tolerance 1e-5 (float32 losses vs float64 Python references).
"""
import math
import random

import pytest
import torch

from mfc.kl import AdaptiveKLController, KLControlConfig, kl_estimate, make_kl_controller, shape_rewards
from mfc.losses import (aggregate, aggregation_weight, entropy_from_logits, mean_stats,
                        ppo_actor_loss, token_logprobs, value_loss)
from mfc.ppo_config import LossConfig
from mfc.ppo_functional import mask_truncated, minibatch_indices, ppo_minibatches, split_minibatches
from realflow.api.batch import SequenceBatch

T = torch.tensor


def _inputs(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(n, generator=g) * 3
    prox = behav + 0.3 * torch.randn(n, generator=g)
    logp = prox + 0.4 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < 0.85
    return logp, prox, behav, adv, mask


def _ref_token_loss(lp, prox, behav, a, eps_lo, eps_hi, dual, cap, cap_mode):
    """Per-token decoupled PPO loss and whether the token stays in the loss."""
    r = math.exp(lp - prox)
    loss = max(-a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi))
    if dual is not None and a < 0:
        loss = min(loss, -a * dual)
    w = math.exp(prox - behav)
    keep = True
    if cap is not None and w > cap:
        if cap_mode == "mask":
            keep = False
        else:
            w = cap
    return loss * w, keep


CASES = [
    dict(),
    dict(eps_clip=0.1, eps_clip_high=0.3),
    dict(dual_clip=3.0),
    dict(behav_imp_weight_cap=1.3),
    dict(behav_imp_weight_cap=1.3, behav_cap_mode="mask", dual_clip=2.0),
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("decoupled", [False, True])
def test_actor_loss_matches_per_token_reference(kw, decoupled):
    logp, prox, behav, adv, mask = _inputs(len(kw) + 10 * decoupled)
    cfg = LossConfig(**kw)
    prox_in = prox if decoupled else None
    loss, st = ppo_actor_loss(logp, behav, adv, mask, cfg, prox_logprobs=prox_in)
    p = prox if decoupled else behav
    total, n = 0.0, 0
    for i in range(len(logp)):
        hi = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
        lt, keep = _ref_token_loss(float(logp[i]), float(p[i]), float(behav[i]), float(adv[i]), cfg.eps_clip,
                                   hi, cfg.dual_clip, cfg.behav_imp_weight_cap, cfg.behav_cap_mode)
        if mask[i] and keep:
            total += lt
            n += 1
    assert loss.item() == pytest.approx(total, abs=1e-4)
    assert st["n_loss_tokens"] == n
    assert aggregation_weight(mask, None) == float(mask.sum())


def test_clip_and_dual_clip_hand_computed():
    logp = torch.log(T([1.5, 0.5, 1.5, 5.0, 1.0]))  # ratios (old logprobs 0)
    old = torch.zeros(5)
    adv = T([1.0, -1.0, -1.0, -1.0, 2.0])
    mask = torch.ones(5, dtype=torch.bool)
    loss, st = ppo_actor_loss(logp, old, adv, mask, LossConfig(eps_clip=0.2))
    # per token: max(-A r, -A clip(r)) = [-1.2, 0.8, 1.5, 5.0, -2.0]
    assert loss.item() == pytest.approx(-1.2 + 0.8 + 1.5 + 5.0 - 2.0, abs=1e-5)
    assert st["clipped_tokens"] == 2  # tokens 0 and 1 use the clipped term
    loss, st = ppo_actor_loss(logp, old, adv, mask, LossConfig(eps_clip=0.2, dual_clip=3.0))
    # dual clip bounds the negative-advantage loss at -3A = 3: token 3 goes 5.0 -> 3.0
    assert loss.item() == pytest.approx(-1.2 + 0.8 + 1.5 + 3.0 - 2.0, abs=1e-5)
    assert st["dual_clipped_tokens"] == 1


def test_decoupled_reduces_to_ppo_when_prox_equals_behaviour_and_gradients_agree():
    logp, _, behav, adv, mask = _inputs(3)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    cfg = LossConfig(dual_clip=3.0, behav_imp_weight_cap=5.0)
    la, sa = ppo_actor_loss(a, behav, adv, mask, cfg)
    lb, sb = ppo_actor_loss(b, behav, adv, mask, cfg, prox_logprobs=behav.clone())
    la.backward()
    lb.backward()
    assert la.item() == lb.item() and sa == sb
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert sa["behav_imp_weight_sum"] == pytest.approx(sa["n_loss_tokens"], abs=1e-5)


def test_decoupled_gradient_is_behaviour_weighted_ratio_gradient():
    # unclipped region: d/dlogp of -A * w * exp(logp - prox) is -A * w * ratio
    prox = T([-1.0, -2.0])
    behav = T([-1.5, -1.8])
    logp = (prox + T([0.05, -0.05])).requires_grad_(True)
    adv = T([1.0, -2.0])
    loss, _ = ppo_actor_loss(logp, behav, adv, torch.ones(2, dtype=torch.bool), LossConfig(), prox_logprobs=prox)
    loss.backward()
    expect = -adv * torch.exp(prox - behav) * torch.exp(logp.detach() - prox)
    torch.testing.assert_close(logp.grad, expect, atol=1e-6, rtol=0)


def test_aggregation_modes_hand_computed():
    per = T([1., 2., 3., 4., 5., 6.])
    mask = T([1, 1, 0, 1, 1, 1]).bool()
    lens = [3, 1, 2]
    assert aggregate(per, mask, lens, "token-mean").item() == pytest.approx(18.0)
    assert aggregation_weight(mask, lens, "token-mean") == 5.0
    # seq means: (1+2)/2, 4/1, (5+6)/2 -> sum 1.5 + 4 + 5.5 over 3 sequences
    assert aggregate(per, mask, lens, "seq-mean-token-mean").item() == pytest.approx(11.0)
    assert aggregation_weight(mask, lens, "seq-mean-token-mean") == 3.0
    assert aggregate(per, mask, lens, "seq-mean-token-sum").item() == pytest.approx(18.0)
    assert aggregate(per, mask, lens, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(4.5)
    # a fully masked sequence does not count as a sequence
    m2 = T([1, 1, 1, 0, 1, 1]).bool()
    assert aggregation_weight(m2, lens, "seq-mean-token-sum") == 2.0
    with pytest.raises(ValueError, match="unknown loss aggregation 'tokenmean'"):
        aggregate(per, mask, lens, "tokenmean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(per, mask, lens, "seq-mean-token-sum-norm")


def test_aggregation_is_independent_of_micro_batch_split():
    """sum(loss sums) / sum(weights) over two halves equals the whole batch's mean."""
    g = torch.Generator().manual_seed(0)
    lens = [3, 5, 2, 7, 1, 4]
    per = torch.randn(sum(lens), generator=g)
    mask = torch.rand(sum(lens), generator=g) < 0.7
    cut = sum(lens[:3])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        whole = aggregate(per, mask, lens, mode) / aggregation_weight(mask, lens, mode)
        parts = [(per[:cut], mask[:cut], lens[:3]), (per[cut:], mask[cut:], lens[3:])]
        num = sum(aggregate(p, m, ln, mode) for p, m, ln in parts)
        den = sum(aggregation_weight(m, ln, mode) for _, m, ln in parts)
        assert (num / den).item() == pytest.approx(whole.item(), abs=1e-6), mode


def test_entropy_bonus_and_logprob_helpers():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 11, generator=g)
    targets = torch.randint(0, 11, (6,), generator=g)
    lp = token_logprobs(logits, targets)
    ref = [math.log(math.exp(logits[i, targets[i]]) / logits[i].exp().sum()) for i in range(6)]
    torch.testing.assert_close(lp, T(ref), atol=1e-5, rtol=0)
    p = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(entropy_from_logits(logits, 0.7), -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
    ent = entropy_from_logits(logits)
    mask = torch.ones(6, dtype=torch.bool)
    base, _ = ppo_actor_loss(lp, lp, torch.ones(6), mask, LossConfig())
    with_ent, st = ppo_actor_loss(lp, lp, torch.ones(6), mask, LossConfig(entropy_coef=0.01), entropy=ent)
    assert with_ent.item() == pytest.approx(base.item() - 0.01 * ent.sum().item(), abs=1e-5)
    assert st["entropy_sum"] == pytest.approx(ent.sum().item(), abs=1e-4)


def test_value_loss_matches_reference():
    g = torch.Generator().manual_seed(4)
    v, old, ret = torch.randn(50, generator=g), torch.randn(50, generator=g), torch.randn(50, generator=g)
    mask = torch.rand(50, generator=g) < 0.8
    loss, st = value_loss(v, old, ret, mask, eps_clip=0.2)
    total, clipped = 0.0, 0
    for i in range(50):
        if not mask[i]:
            continue
        vc = float(old[i]) + min(max(float(v[i] - old[i]), -0.2), 0.2)
        a, b = (float(v[i]) - float(ret[i])) ** 2, (vc - float(ret[i])) ** 2
        total += 0.5 * max(a, b)
        clipped += abs(float(v[i] - old[i])) > 0.2 and b > a
    assert loss.item() == pytest.approx(total, abs=1e-4)
    assert st["value_clipped_tokens"] == clipped > 0
    unclipped, _ = value_loss(v, old, ret, mask, eps_clip=None)
    assert unclipped.item() == pytest.approx(0.5 * float((((v - ret) ** 2) * mask).sum()), abs=1e-4)
    # hand case: v=2, old=0, R=3 -> unclipped 0.5, clipped (0.2-3)^2/2 = 3.92 wins
    assert value_loss(T([2.]), T([0.]), T([3.]), T([True]))[0].item() == pytest.approx(3.92, abs=1e-5)


def test_mean_stats():
    assert mean_stats({"n_loss_tokens": 4.0, "clipped_tokens": 1.0, "approx_kl_sum": 2.0, "x": 3.0}) == \
        {"n_loss_tokens": 4.0, "clipped_frac": 0.25, "approx_kl": 0.5, "x": 3.0}


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed_and_unbiased():
    lp, ref = T([0.0, -1.0]), T([-0.5, -1.0])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), T([0.5, 0.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), T([0.125, 0.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), T([math.exp(-0.5) - 1 + 0.5, 0.0]))
    torch.testing.assert_close(kl_estimate(T([3.0]), T([0.0]), "k1", clamp=1.0), T([1.0]))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(lp, ref, "k4")
    # Monte Carlo: samples from p, KL(p||q) for two categoricals; k1 and k3 are unbiased
    p, q = T([0.5, 0.3, 0.2]), T([0.2, 0.3, 0.5])
    true = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200000, replacement=True, generator=torch.Generator().manual_seed(0))
    for est in ("k1", "k3"):
        assert kl_estimate(p.log()[x], q.log()[x], est).mean().item() == pytest.approx(true, abs=0.01)
    assert (kl_estimate(p.log()[x], q.log()[x], "k3") >= 0).all()


def test_kl_controllers():
    fixed = make_kl_controller(KLControlConfig("fixed", 0.1))
    assert fixed.update(100.0, 64) == 0.1
    c = make_kl_controller(KLControlConfig("adaptive", coef=0.2, target=6.0, horizon=10000))
    assert isinstance(c, AdaptiveKLController)
    assert c.update(12.0, 1000) == pytest.approx(0.2 * (1 + 0.2 * 0.1))      # error clipped at +0.2
    v = c.value
    assert c.update(5.4, 1000) == pytest.approx(v * (1 - 0.1 * 0.1))           # error -0.1
    assert c.update(6.0, 1000) == pytest.approx(v * (1 - 0.1 * 0.1))           # on target: unchanged
    state = c.state_dict()
    d = make_kl_controller(KLControlConfig("adaptive", coef=0.2))
    d.load_state_dict(state)
    assert d.value == c.value
    with pytest.raises(ValueError, match="kind must be 'fixed' or 'adaptive'"):
        KLControlConfig("adaptve")


def test_shape_rewards_puts_score_on_last_token_and_kl_everywhere():
    kl = T([0.1, 0.2, 0.3, 0.4, 0.5])
    out = shape_rewards(T([1.0, -2.0]), [3, 2], kl=kl, kl_coef=0.5, mask=T([1, 1, 1, 0, 1]).bool())
    torch.testing.assert_close(out, T([-0.05, -0.1, 1.0 - 0.15, 0.0, -2.0 - 0.25]))
    out = shape_rewards(T([4.0, -4.0]), [1, 1], score_clip=3.0, score_bias=-1.0, score_scale=2.0)
    torch.testing.assert_close(out, T([3.0, -3.0]))
    with pytest.raises(ValueError, match=r"sequence\(s\) \[1\] are empty"):
        shape_rewards(T([1.0, 1.0]), [2, 0])


# ----------------------------------------------------------------------------- schedule helpers


def test_mask_truncated():
    m = mask_truncated(torch.ones(6, dtype=torch.bool), [2, 3, 1], T([False, True, False]))
    assert m.tolist() == [True, True, False, False, False, True]
    with pytest.raises(ValueError, match="one flag per sequence"):
        mask_truncated(torch.ones(6, dtype=torch.bool), [2, 3, 1], T([False]))


def test_minibatches_split_by_samples_seeded_and_cover_everything():
    lens = [[random.Random(i).randint(1, 5) for _ in range(2)] for i in range(10)]
    batch = SequenceBatch.from_samples(
        [f"s{i}" for i in range(10)],
        {"x": [[torch.full((n,), i) for n in ln] for i, ln in enumerate(lens)]})
    parts = minibatch_indices(10, 3, seed=1, step=2, epoch=0)
    assert sorted(p for part in parts for p in part) == list(range(10))
    assert sorted(len(p) for p in parts) == [3, 3, 4]
    assert parts == minibatch_indices(10, 3, seed=1, step=2, epoch=0)
    assert parts != minibatch_indices(10, 3, seed=1, step=2, epoch=1)
    assert minibatch_indices(4, 2, shuffle=False) == [[0, 1], [2, 3]]
    mbs = split_minibatches(batch, 3, seed=1, step=2)
    assert [mb.ids for mb in mbs] == [[f"s{i}" for i in part] for part in parts]
    for mb in mbs:  # every sample keeps its whole group and its values
        for j, sid in enumerate(mb.ids):
            i = int(sid[1:])
            assert mb.seqlens["x"][j] == lens[i]
            assert all((t == i).all() for t in mb.sequences("x", j))
    sched = list(ppo_minibatches(batch, ppo_epochs=2, n_minibatches=2, seed=1))
    assert [(e, i) for e, i, _ in sched] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="cannot split 10 samples into 11"):
        split_minibatches(batch, 11)
