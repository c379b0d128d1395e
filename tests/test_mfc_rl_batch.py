"""Generated RL batches -> per-token training tensors: positions, advantages, KL control."""
import pytest
import torch

from mfc.rl_batch import AdvantageConfig, KLPenalty, action_mask, compute_rl_tensors, with_token_keys
from realflow.api.batch import SequenceBatch


def _batch(rewards, with_values=False, with_ref=False):
    # 2 prompts x 2 responses; prompt lengths 2 and 3, response lengths vary
    seqs = [[([1, 2], [5, 6, 7]), ([1, 2], [8])], [([3, 4, 9], [5, 6]), ([3, 4, 9], [7, 7, 7])]]
    data = {"packed_input_ids": [], "prompt_mask": [], "packed_logprobs": [], "rewards": []}
    if with_values:
        data["values"] = []
    if with_ref:
        data["packed_ref_logprobs"] = []
    for g, (group, rs) in enumerate(zip(seqs, rewards)):
        for key in data:
            data[key].append([])
        for (p, r), rew in zip(group, rs):
            n = len(p) + len(r)
            data["packed_input_ids"][-1].append(torch.tensor(p + r))
            data["prompt_mask"][-1].append(torch.tensor([1] * len(p) + [0] * len(r), dtype=torch.bool))
            lp = torch.zeros(n)
            lp[len(p) - 1:n - 1] = -0.5
            data["packed_logprobs"][-1].append(lp)
            data["rewards"][-1].append(torch.tensor([float(rew)]))
            if with_values:
                data["values"][-1].append(torch.arange(n, dtype=torch.float32) / 10)
            if with_ref:
                data["packed_ref_logprobs"][-1].append(lp - 0.1)
    return SequenceBatch.from_samples(["a", "b"], data)


def test_action_positions_predict_response_tokens():
    ids = torch.tensor([1, 2, 5, 6, 7, 1, 2, 8])
    pm = torch.tensor([1, 1, 0, 0, 0, 1, 1, 0], dtype=torch.bool)
    assert action_mask(ids, pm, [5, 3]).tolist() == [False, True, True, True, False, False, True, False]


def test_grpo_advantages_land_on_each_response_token():
    b = _batch([[1.0, 0.0], [0.0, 0.0]])
    t = compute_rl_tensors(b, AdvantageConfig(estimator="grpo", adv_norm="none"))
    adv, act = t.advantages, t.action_mask
    # group a: rewards (1, 0) -> +-(0.5 / std) with unbiased std sqrt(0.5); group b: all equal -> 0
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert torch.allclose(adv[:5], torch.tensor([0, a, a, a, 0]), atol=1e-5)
    assert torch.allclose(adv[5:8], torch.tensor([0, -a, 0]), atol=1e-5)
    assert torch.all(adv[8:] == 0) and int(act.sum()) == 3 + 1 + 2 + 3
    tb = with_token_keys(b, t)
    assert tb.seqlens["_adv"] == b.seqlens["packed_input_ids"]


def test_gae_uses_values_at_action_positions_and_bootstraps_truncated():
    b = _batch([[1.0, 0.0], [0.5, 0.0]], with_values=True)
    t = compute_rl_tensors(b, AdvantageConfig(estimator="gae", adv_norm="none", gamma=1.0, lam=1.0))
    # finished sequence, gamma = lam = 1: advantage = final reward - value at the action position
    v = torch.arange(5, dtype=torch.float32) / 10
    assert torch.allclose(t.advantages[1:4], 1.0 - v[1:4])
    assert torch.allclose(t.returns[1:4], torch.ones(3))


def test_kl_penalty_shapes_rewards_and_adapts():
    b = _batch([[1.0, 1.0], [1.0, 1.0]], with_values=True, with_ref=True)
    fixed = compute_rl_tensors(b, AdvantageConfig(estimator="gae", adv_norm="none", kl_coef=0.0))
    pen = compute_rl_tensors(b, AdvantageConfig(estimator="gae", adv_norm="none", kl_coef=1.0))
    # k1 KL = old - ref = 0.1 per action token: the returns drop by 0.1 per remaining token
    assert torch.allclose(fixed.returns[1:4] - pen.returns[1:4], torch.tensor([0.3, 0.2, 0.1]), atol=1e-6)
    assert pen.stats["kl_ref_sum"] == pytest.approx(0.1 * 9)
    ctl = KLPenalty(AdvantageConfig(kl_coef=0.5, kl_ctl="adaptive", kl_target=0.01, kl_horizon=100))
    new = ctl.update(pen.stats, lambda xs: xs)  # per-sequence KL 0.225 >> target: coefficient grows
    assert new == pytest.approx(0.5 * (1 + 0.2 * 4 / 100))


def test_empty_response_is_an_error():
    b = _batch([[1.0, 0.0], [0.0, 0.0]])
    pm = b.data["prompt_mask"].clone()
    pm[5:8] = True  # second sequence of sample a: all prompt
    bad = SequenceBatch(b.ids, b.seqlens, {**b.data, "prompt_mask": pm})
    with pytest.raises(ValueError, match="no response token"):
        compute_rl_tensors(bad, AdvantageConfig(estimator="grpo"))
