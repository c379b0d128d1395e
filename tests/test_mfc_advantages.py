"""Advantage estimators on packed sequences: hand-computed cases and naive per-sequence loops.

Tolerances: hand-computed cases 1e-6 (float32 inputs); random cases against a float64
Python loop 1e-9 (float64 inputs).
"""
import math
import random

import pytest
import torch

from mfc.advantages import (discounted_returns, gae, grpo_advantages, normalize, reinforce_pp_advantages,
                            rloo_advantages, segment_discounted_cumsum, segment_ids, seq_to_token,
                            token_group_ids)

T = torch.tensor


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- hand-computed


def test_gae_hand_computed_finished_and_truncated():
    rewards = T([0., 0., 1., 0., 2.])
    values = T([.5, .5, .5, 1., 1.])
    # seq 0 finished (next value 0 after its end); seq 1 truncated, bootstrapped with 3
    adv, ret = gae(rewards, values, [3, 2], 1.0, 1.0, done=T([True, False]), bootstrap_values=T([9., 3.]))
    # seq0: delta = [0, 0, 0.5] -> adv [.5, .5, .5]; seq1: delta = [0, 2 + 3 - 1] -> adv [4, 4]
    close(adv, [.5, .5, .5, 4., 4.])
    close(ret, [1., 1., 1., 5., 5.])
    adv, ret = gae(rewards[:3], values[:3], [3], gamma=0.5, lam=0.5)
    # delta = [-.25, -.25, .5]; a1 = -.25 + .25 * .5; a0 = -.25 + .25 * a1
    close(adv, [-0.28125, -0.125, 0.5])
    close(ret, [0.21875, 0.375, 1.0])


def test_gae_needs_bootstrap_for_truncated():
    with pytest.raises(ValueError, match="bootstrap_values"):
        gae(T([0., 1.]), T([0., 0.]), [2], done=T([False]))
    with pytest.raises(ValueError, match="sums to 3"):
        gae(T([0., 1.]), T([0., 0.]), [3])


def test_grpo_and_dr_grpo_hand_computed():
    r = T([1., 0., 0., 1., 1., 1., 5.])
    a = grpo_advantages(r, [4, 2, 1])
    s = 0.5 / math.sqrt(1 / 3)  # unbiased std of [1,0,0,1] is sqrt(1/3)
    close(a, [s, -s, -s, s, 0., 0., 0.], 1e-5)
    close(grpo_advantages(r, [4, 2, 1], scale_by_std=False), [.5, -.5, -.5, .5, 0., 0., 0.])
    close(grpo_advantages(r, [4, 2, 1], unbiased_std=False), [1, -1, -1, 1, 0, 0, 0], 1e-5)
    tok = grpo_advantages(r, [4, 2, 1], scale_by_std=False, seqlens=[1, 2, 1, 1, 1, 1, 3])
    close(tok, [.5, -.5, -.5, -.5, .5, 0., 0., 0., 0., 0.])


def test_rloo_hand_computed():
    r = T([1., 0., 0., 1., 1., 3., 7.])
    # r_i - mean of the others: 1 - 1/3, 0 - 2/3; [1, 3] -> -2, 2; a group of one -> 0
    close(rloo_advantages(r, [4, 2, 1]), [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2., 2., 0.])


def test_reinforce_pp_hand_computed():
    adv, ret = reinforce_pp_advantages(T([0., 0., 1., 0., 2.]), [3, 2], gamma=1.0)
    close(ret, [1., 1., 1., 2., 2.])
    std = math.sqrt(0.24)  # returns mean 1.4, population variance 0.24
    close(adv, [-.4 / std] * 3 + [.6 / std] * 2, 1e-5)
    _, ret = reinforce_pp_advantages(T([1., 1., 1.]), [3], gamma=0.5)
    close(ret, [1.75, 1.5, 1.])


def test_normalize_modes_hand_computed():
    x = T([1., 2., 3., 10., 100.])
    m = T([1, 1, 1, 1, 0]).bool()
    close(normalize(x, m, "batch", scale_by_std=False), [-3., -2., -1., 6., 0.])
    close(normalize(x, m, "batch"), T([-3., -2., -1., 6., 0.]) / math.sqrt(12.5), 1e-5)
    gid = T([0, 0, 1, 1, 1])
    close(normalize(x, m, "group", scale_by_std=False, group_ids=gid), [-.5, .5, -3.5, 3.5, 0.])
    close(normalize(x, m, "group", group_ids=gid), [-1., 1., -1., 1., 0.], 1e-5)
    close(normalize(x, m, "none"), [1., 2., 3., 10., 0.])
    # a dp_sum that pretends another rank holds the same data: the result must not change
    close(normalize(x, m, "batch", dp_sum=lambda v: [2 * a for a in v]), normalize(x, m, "batch"))
    with pytest.raises(ValueError, match="unknown mode 'batchh'"):
        normalize(x, m, "batchh")


def test_segment_helpers():
    assert segment_ids([2, 0, 1]).tolist() == [0, 0, 2]
    assert seq_to_token(T([7, 8, 9]), [1, 0, 2]).tolist() == [7, 9, 9]
    close(segment_discounted_cumsum(T([1., 1., 1., 1.]), T([.5, .5, 2., 2.]), [2, 2]), [1.5, 1., 3., 1.])


# ----------------------------------------------------------------------------- naive references


def _random_packed(seed, n_seq=13, max_len=40):
    rng = random.Random(seed)
    lens = [rng.randint(0 if i % 5 == 3 else 1, max_len) for i in range(n_seq)]
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return lens, torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def _naive_gae(r, v, lens, gamma, lam, done, boot):
    adv, ret, s = [], [], 0
    for i, n in enumerate(lens):
        a_seq, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            nv = float(v[s + t + 1]) if t + 1 < n else (0.0 if done[i] else float(boot[i]))
            delta = float(r[s + t]) + gamma * nv - float(v[s + t])
            last = delta + gamma * lam * last
            a_seq[t] = last
        adv += a_seq
        ret += [a + float(v[s + t]) for t, a in enumerate(a_seq)]
        s += n
    return adv, ret


@pytest.mark.parametrize("seed,gamma,lam", [(0, 1.0, 1.0), (1, 0.99, 0.95), (2, 0.9, 0.0), (3, 0.0, 0.7)])
def test_gae_matches_naive_loop(seed, gamma, lam):
    lens, r, v = _random_packed(seed)
    g = torch.Generator().manual_seed(seed + 100)
    done = torch.rand(len(lens), generator=g) < 0.5
    boot = torch.randn(len(lens), generator=g, dtype=torch.float64)
    adv, ret = gae(r, v, lens, gamma, lam, done=done, bootstrap_values=boot)
    ref_adv, ref_ret = _naive_gae(r, v, lens, gamma, lam, done.tolist(), boot.tolist())
    close(adv, ref_adv, 1e-9)
    close(ret, ref_ret, 1e-9)


def test_discounted_cumsum_long_sequence_does_not_underflow():
    # gamma**t underflows float64 after ~70k tokens at 0.99; the scan never forms it
    lens = [20000, 3, 1]
    x = torch.randn(sum(lens), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = discounted_returns(x, lens, 0.97)
    ref, s = [], 0
    for n in lens:
        acc, seq = 0.0, []
        for t in reversed(range(n)):
            acc = float(x[s + t]) + 0.97 * acc
            seq.append(acc)
        ref += seq[::-1]
        s += n
    assert torch.isfinite(out).all()
    close(out, ref, 1e-9)


def _groups(n_seq, seed):
    rng, sizes = random.Random(seed), []
    while sum(sizes) < n_seq:
        sizes.append(min(rng.randint(1, 5), n_seq - sum(sizes)))
    return sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_estimators_match_naive_loop(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (40,), generator=g).double()
    sizes = _groups(40, seed)
    grpo, dr, rloo, s = [], [], [], 0
    for k in sizes:
        grp = r[s:s + k].tolist()
        mean = sum(grp) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (k - 1)) if k > 1 else 0.0
        for i, x in enumerate(grp):
            grpo.append((x - mean) / (std + 1e-6) if k > 1 else 0.0)
            dr.append(x - mean)
            rloo.append(x - (sum(grp) - x) / (k - 1) if k > 1 else 0.0)
        s += k
    close(grpo_advantages(r, sizes), grpo, 1e-9)
    close(grpo_advantages(r, sizes, scale_by_std=False), dr, 1e-9)
    close(rloo_advantages(r, sizes), rloo, 1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_and_group_normalize_match_naive(seed):
    lens, r, _ = _random_packed(seed)
    gamma = 0.9
    ret_ref, s = [], 0
    for n in lens:
        acc, seq = 0.0, []
        for t in reversed(range(n)):
            acc = float(r[s + t]) + gamma * acc
            seq.append(acc)
        ret_ref += seq[::-1]
        s += n
    mask = torch.rand(len(ret_ref), generator=torch.Generator().manual_seed(seed)) < 0.8
    vals = [x for x, m in zip(ret_ref, mask.tolist()) if m]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / len(vals))
    adv, ret = reinforce_pp_advantages(r, lens, gamma, mask=mask)
    close(ret, ret_ref, 1e-9)
    close(adv, [(x - mean) / (std + 1e-8) if m else 0.0 for x, m in zip(ret_ref, mask.tolist())], 1e-9)

    # group normalisation: groups of consecutive sequences, stats over masked tokens only
    sizes = _groups(len(lens), seed)
    seq_group = [gi for gi, k in enumerate(sizes) for _ in range(k)]
    gid = seq_to_token(torch.tensor(seq_group), lens)
    assert torch.equal(gid, token_group_ids(sizes, lens))
    out = normalize(r, mask, "group", group_ids=gid)
    for gi in range(len(sizes)):
        sel = [(float(x), bool(m)) for x, m, g_ in zip(r, mask, gid.tolist()) if g_ == gi]
        xs = [x for x, m in sel if m]
        if not xs:
            continue
        mu = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))
        got = out[gid == gi]
        close(got, [(x - mu) / (sd + 1e-8) if m else 0.0 for x, m in sel], 1e-9)
