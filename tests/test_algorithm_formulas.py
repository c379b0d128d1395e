"""Every preset (``algorithm=...``) against its paper's objective, written out again here.

The reference below is plain torch with per-sample Python loops and no realflow helper: each
algorithm's advantages from the rewards (group statistics by hand), its per-token or
per-sequence surrogate, its aggregation. realflow's side is the real path: the experiment
config with ``algorithm=NAME`` -> the actor interface it builds -> ``compute_rl_tensors`` and
``ppo_actor_loss`` on a packed batch, divided by the global loss weight as the engine does.
The batch has groups of 4, 4, 1 and 3 responses (a group of one; a group whose rewards are all
equal), prompts and responses of mixed lengths, truncated responses (cut at max_new_tokens,
also the ones the overlong punishment hits) and new log-probs far outside the clip range.
Loss and gradient (w.r.t. every token's new log-prob) agree with the reference in d1, and in d2
(two real gloo ranks, half the groups each, batch statistics summed over ranks) equal d1.

The train-inference mismatch corrections (``ppo.mismatch_correction``: TIS, MIS, IcePop and their
sequence-level forms) on GRPO, with trainer-side old log-probs that put ratios outside every band.

Beyond the presets: the KL penalty at its default estimator in the loss (``ppo.kl_in=loss``: k3,
verl's low_var_kl) and in the reward (k1), and LitePPO's batch std of the raw rewards
(``ppo.reward_norm.std_of=raw``) beside its default (of the group-centred rewards).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from parallel.testing import run_cases

MODULE = __name__.rsplit(".", 1)[-1]
MAX_NEW = 8
GROUPS = [4, 4, 1, 3]
#: train-inference mismatch corrections (ppo.mismatch_correction) on GRPO, with the trainer's old log-probs
CORRECTIONS = {"grpo_tis": "tis", "grpo_mis": "mis", "grpo_icepop": "icepop", "grpo_seq_tis": "seq-tis",
               "grpo_seq_mis": "seq-mis"}
ALGORITHMS = ["ppo", "grpo", "dr_grpo", "lite_ppo", "rloo", "reinforce_pp", "dapo", "gspo", "sapo", "grpo_kl_loss",
              "grpo_kl_reward", "lite_ppo_raw_std", *CORRECTIONS]
#: the cases that are a preset plus keys (each key at its default otherwise)
VARIANTS = {"grpo_kl_loss": ["algorithm=grpo", "ppo.kl_coef=0.1", "ppo.kl_in=loss"],
            "grpo_kl_reward": ["algorithm=grpo", "ppo.kl_coef=0.1"],
            "lite_ppo_raw_std": ["algorithm=lite_ppo", "ppo.reward_norm.std_of=raw"],
            **{k: ["algorithm=grpo", f"ppo.mismatch_correction={v}"] for k, v in CORRECTIONS.items()}}
# realflow computes advantages and the loss in fp32 (the reference in fp64): a few ulps of fp32
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


# --------------------------------------------------------------------------- the batch


def sequences() -> list[list[dict]]:
    """Per group, per response: prompt/response lengths, reward, truncation, old/new/ref log-probs, values."""
    g = torch.Generator().manual_seed(3)
    out = []
    for gi, size in enumerate(GROUPS):
        p = 2 + gi
        group = []
        for j in range(size):
            L = int(torch.randint(1, MAX_NEW + 1, (1,), generator=g))
            if gi == 0 and j == 0:
                L = MAX_NEW  # truncated: hit by the overlong punishment, bootstrapped by GAE
            reward = 1.0 if gi == 1 else float(torch.randint(0, 2, (1,), generator=g))  # group 1: all equal
            old = -0.1 - 2.9 * torch.rand(L, generator=g, dtype=torch.float64)
            # ratios far outside the clip range, and (every second response) within GSPO's narrow one
            noise = 0.8 if j % 2 == 0 else 1e-5
            new = old + noise * torch.randn(L, generator=g, dtype=torch.float64)
            group.append({"p": p, "L": L, "reward": reward, "truncated": L == MAX_NEW, "old": old, "new": new,
                          "ref": old - 0.3 * torch.rand(L, generator=g, dtype=torch.float64),
                          "values": torch.randn(p + L, generator=g, dtype=torch.float64)})
        out.append(group)
    # the trainer's own old log-probs (the proximal policy of the corrections): the generator's plus a
    # mismatch that puts some ratios outside every correction's band (drawn apart: the rest is unchanged)
    g2 = torch.Generator().manual_seed(5)
    for group in out:
        for j, s in enumerate(group):
            s["prox"] = s["old"] + (0.9 if j % 2 == 0 else 0.05) * torch.randn(s["L"], generator=g2,
                                                                                  dtype=torch.float64)
    return out


def packed(groups: list[list[dict]]):
    """(SequenceBatch, new log-probs aligned with packed positions) the way the generate MFC packs them."""
    from realflow.api.batch import SequenceBatch

    data = {k: [] for k in ("packed_input_ids", "prompt_mask", "packed_logprobs", "rewards", "seq_no_eos_mask",
                            "values", "packed_ref_logprobs")}
    new = []
    for group in groups:
        for k in data:
            data[k].append([])
        for s in group:
            n = s["p"] + s["L"]
            lp, nw, ref = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
            a = slice(s["p"] - 1, n - 1)  # position t predicts token t + 1
            lp[a], nw[a], ref[a] = s["old"], s["new"], s["ref"]
            data["packed_input_ids"][-1].append(torch.arange(n) % 7 + 1)
            data["prompt_mask"][-1].append(torch.tensor([1] * s["p"] + [0] * s["L"], dtype=torch.bool))
            data["packed_logprobs"][-1].append(lp)
            data["packed_ref_logprobs"][-1].append(ref)
            data["rewards"][-1].append(torch.tensor([s["reward"]]))
            data["seq_no_eos_mask"][-1].append(torch.tensor([float(s["truncated"])]))
            data["values"][-1].append(s["values"])
            new.append(nw)
    ids = [f"g{i}" for i in range(len(groups))]
    return SequenceBatch.from_samples(ids, data), torch.cat(new)


# --------------------------------------------------------------------------- the reference


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased; 0 for one value
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def reference(alg: str, groups: list[list[dict]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, the per-sequence new log-prob leaves) of ``alg``'s objective, negated."""
    seqs = [s for group in groups for s in group]
    leaves = [s["new"].clone().requires_grad_(True) for s in seqs]
    rewards = [[s["reward"] for s in group] for group in groups]
    if alg == "dapo":  # soft overlong punishment on the reward, before the group statistics
        buf = round(0.25 * MAX_NEW)
        rewards = [[r - min(max(s["L"] - (MAX_NEW - buf), 0) / buf, 1.0) for r, s in zip(rs, group)]
                   for rs, group in zip(rewards, groups)]
    adv: list[list[float]] = []  # per sequence: one value per response token
    every = [r for rs in rewards for r in rs]
    centred = [r - _mean(rs) for rs in rewards for r in rs]  # each reward minus its group's mean
    for rs, group in zip(rewards, groups):
        for i, (r, s) in enumerate(zip(rs, group)):
            if alg in ("grpo", "dapo", "gspo", "sapo", "grpo_kl_loss", *CORRECTIONS):
                a = (r - _mean(rs)) / (_std(rs) + 1e-6)
            elif alg == "grpo_kl_reward":  # - beta * k1(pi_old || pi_ref) on each token, clamped at 10
                a0 = (r - _mean(rs)) / (_std(rs) + 1e-6)
                adv.append([a0 - 0.1 * max(min(float(o - f), 10.0), -10.0) for o, f in zip(s["old"], s["ref"])])
                continue
            elif alg == "dr_grpo":
                a = r - _mean(rs)
            elif alg == "lite_ppo":  # the batch std of the group-centred rewards (AReaL, ROLL)
                a = (r - _mean(rs)) / (_std(centred) + 1e-6)
            elif alg == "lite_ppo_raw_std":  # the batch std of the rewards themselves
                a = (r - _mean(rs)) / (_std(every) + 1e-6)
            elif alg == "rloo":
                others = rs[:i] + rs[i + 1:]
                a = r - _mean(others) if others else 0.0
            else:
                a = None
            adv.append([a] * s["L"] if a is not None else None)
    if alg == "reinforce_pp":  # return-to-go (gamma 1, no KL) = the reward on every token, batch-normalised
        flat = [s["reward"] for s in seqs for _ in range(s["L"])]
        m, sd = _mean(flat), _std(flat)
        adv = [[(s["reward"] - m) / (sd + 1e-5)] * s["L"] for s in seqs]
    if alg == "ppo":  # GAE with gamma = lam = 1: R - V(t) (+ V after the last token if truncated), batch-normalised
        raw = []
        for s in seqs:
            v = s["values"]
            boot = float(v[s["p"] + s["L"] - 1]) if s["truncated"] else 0.0
            raw.append([s["reward"] + boot - float(v[s["p"] - 1 + k]) for k in range(s["L"])])
        flat = [x for r in raw for x in r]
        m, sd = _mean(flat), _std(flat)
        adv = [[(x - m) / (sd + 1e-5) for x in r] for r in raw]
    if alg in CORRECTIONS:
        return _corrected_reference(CORRECTIONS[alg], seqs, leaves, adv), leaves
    eps_lo, eps_hi = {"gspo": (3e-4, 4e-4), "dapo": (0.2, 0.28)}.get(alg, (0.2, 0.2))
    per_seq = []
    for s, lp, a in zip(seqs, leaves, adv):
        A = torch.tensor(a, dtype=torch.float64)
        if alg == "gspo":
            ratio = torch.exp((lp - s["old"]).mean())
            per_seq.append(-torch.minimum(ratio * A[0], ratio.clamp(1 - eps_lo, 1 + eps_hi) * A[0]))
            continue
        ratio = torch.exp(lp - s["old"])
        if alg == "sapo":
            tau = torch.where(A > 0, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.05, dtype=torch.float64))
            tok = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * A
        else:
            tok = -torch.minimum(ratio * A, ratio.clamp(1 - eps_lo, 1 + eps_hi) * A)
        if alg == "grpo_kl_loss":  # + beta * k3(pi || pi_ref), clamped at 10 (verl)
            d = s["ref"] - lp
            tok = tok + 0.1 * (torch.exp(d) - d - 1).clamp(-10, 10)
        per_seq.append(tok)
    if alg in ("grpo", "sapo", "grpo_kl_loss", "grpo_kl_reward"):  # 1/G sum_i 1/|o_i| sum_t
        loss = sum(t.mean() for t in per_seq) / len(per_seq)
    elif alg == "dr_grpo":  # 1/G sum_i 1/L_max sum_t
        loss = sum(t.sum() / MAX_NEW for t in per_seq) / len(per_seq)
    elif alg == "gspo":
        loss = sum(per_seq) / len(per_seq)
    else:  # token-level: all tokens of the batch alike
        loss = sum(t.sum() for t in per_seq) / sum(s["L"] for s in seqs)
    return loss, leaves


def _corrected_reference(corr: str, seqs, leaves, adv) -> torch.Tensor:
    """GRPO clipped against the trainer's old policy ``prox``, each token weighted by the corrected
    ``rho = pi_prox / pi_gen`` (then capped at behav_imp_weight_cap = 5) or dropped from the loss
    (a dropped token still counts in its sequence's length, as in IcePop's objective)."""
    per_seq = []
    for s, lp, a in zip(seqs, leaves, adv):
        A = torch.tensor(a, dtype=torch.float64)
        log_rho = s["prox"] - s["old"]
        if corr.startswith("seq-"):  # the geometric mean of the sequence's token ratios, on every token
            log_rho = torch.full_like(log_rho, float(log_rho.mean()))
        rho = torch.exp(log_rho)
        keep = torch.ones_like(rho)
        if corr in ("tis", "seq-tis"):
            w = torch.clamp(rho, max=2.0)
        else:
            lo, hi = (0.5, 5.0) if corr == "icepop" else (0.5, 2.0)
            keep = ((rho >= lo) & (rho <= hi)).double()
            w = rho
        w = torch.clamp(w, max=5.0)
        ratio = torch.exp(lp - s["prox"])
        tok = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A) * w * keep
        per_seq.append(tok.sum() / s["L"])
    return sum(per_seq) / len(per_seq)


# --------------------------------------------------------------------------- realflow


def _interface(alg: str):
    from realflow.config.cli import import_modules, parse_overrides
    from realflow.api.experiment import experiment_registry
    from realflow.api.interface import make_interface

    import_modules(["experiments"])
    exp = "ppo-math" if alg == "ppo" else "grpo-math"
    over = VARIANTS.get(alg, [f"algorithm={alg}"])
    cfg = parse_overrides(experiment_registry.get(exp), [*over, "fileroot=/nonexistent", f"ppo.max_new_tokens={MAX_NEW}",
                                                         "ppo.n_samples=4"])
    return make_interface("ppo_actor", **{**cfg.ppo.actor_args(), "seed": 1})


def realflow_loss(alg: str, groups, dp_sum=None):
    """(loss, grad w.r.t. the packed new log-probs) for this rank's ``groups``."""
    from mfc.losses import aggregation_weight, ppo_actor_loss
    from mfc.rl_batch import compute_rl_tensors

    actor = _interface(alg)
    batch, new = packed(groups)
    if alg != "ppo":
        batch = batch.select_keys([k for k in batch.seqlens if k != "values"])
    t = compute_rl_tensors(batch, actor.ppo, dp_sum, max_new_tokens=actor.max_new_tokens)
    lp = new.clone().requires_grad_(True)
    ref = batch.data["packed_ref_logprobs"].double() if actor.ppo.kl_loss_coef() else None
    prox = packed_prox(groups) if alg in CORRECTIONS else None
    loss_sum, _ = ppo_actor_loss(lp, t.old_logprobs.double(), t.advantages.double(), t.action_mask,
                                 actor.ppo, seqlens=t.seqlens, ref_logprobs=ref, prox_logprobs=prox)
    weight = aggregation_weight(t.action_mask, t.seqlens, actor.ppo.loss_agg)
    total = dp_sum([weight])[0] if dp_sum else weight
    loss = loss_sum / total
    loss.backward()
    full = dp_sum([float(loss)])[0] if dp_sum else float(loss)
    return full, lp.grad.detach()


def packed_prox(groups) -> torch.Tensor:
    """The trainer's old log-probs aligned with the packed positions (what actor_inf would give)."""
    out = []
    for group in groups:
        for s in group:
            x = torch.zeros(s["p"] + s["L"], dtype=torch.float64)
            x[s["p"] - 1:s["p"] + s["L"] - 1] = s["prox"]
            out.append(x)
    return torch.cat(out)


def _action_grads(groups, grad: torch.Tensor) -> list[torch.Tensor]:
    """Per sequence, the gradient at its action positions (to compare with the reference's leaves)."""
    out, off = [], 0
    for group in groups:
        for s in group:
            n = s["p"] + s["L"]
            out.append(grad[off + s["p"] - 1:off + n - 1])
            off += n
    return out


def case_d2(ctx):
    import torch.distributed as dist

    groups = sequences()
    mine = groups[:2] if ctx.rank == 0 else groups[2:]

    def dp_sum(values):
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    out = {}
    for alg in ALGORITHMS:
        loss, grad = realflow_loss(alg, mine, dp_sum)
        out[alg] = {"loss": loss, "grad": grad.tolist()}
    return out


@pytest.fixture(scope="module")
def d2():
    res = run_cases([f"{MODULE}:case_d2"], world_size=2, timeout=300,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])["case_d2"]
    assert res.ok, res.error
    return res.data


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_preset_equals_its_formula_in_d1_and_d2(alg, d2):
    groups = sequences()
    ref_loss, leaves = reference(alg, groups)
    ref_loss.backward()
    loss, grad = realflow_loss(alg, groups)
    assert loss == pytest.approx(float(ref_loss), rel=LOSS_RTOL, abs=1e-7), (loss, float(ref_loss))
    scale = max(float(leaf.grad.abs().max()) for leaf in leaves)
    for i, (g, leaf) in enumerate(zip(_action_grads(groups, grad), leaves)):
        assert torch.allclose(g.double(), leaf.grad, atol=GRAD_RTOL * scale, rtol=0), (alg, i, g, leaf.grad)
    assert float(grad.abs().sum()) > 0  # something trains (the clip does not swallow everything)
    # d2: each rank half the groups, statistics over both; the same loss, the same gradients
    assert d2[0][alg]["loss"] == pytest.approx(loss, rel=LOSS_RTOL) == d2[1][alg]["loss"]
    both = torch.tensor(d2[0][alg]["grad"] + d2[1][alg]["grad"], dtype=torch.float64)
    assert torch.allclose(both, grad.double(), atol=GRAD_RTOL * scale, rtol=0)


def test_edge_cases_have_the_formulas_values():
    """A group of one and an all-equal group carry zero advantage; a zero-length response is refused."""
    groups = sequences()
    from mfc.rl_batch import compute_rl_tensors

    actor = _interface("grpo")
    batch, _ = packed(groups)
    t = compute_rl_tensors(batch, actor.ppo)
    per_seq = _action_grads(groups, t.advantages.double())
    sizes = [len(g) for g in groups]
    all_equal = per_seq[sizes[0]:sizes[0] + sizes[1]]
    alone = per_seq[sizes[0] + sizes[1]]
    assert all(float(a.abs().max()) == 0.0 for a in all_equal) and float(alone.abs().max()) == 0.0
    groups[3][0]["L"] = 0
    groups[3][0]["old"] = groups[3][0]["new"] = groups[3][0]["ref"] = torch.zeros(0, dtype=torch.float64)
    bad, _ = packed(groups)
    with pytest.raises(ValueError, match="has no response token"):
        compute_rl_tensors(bad, actor.ppo)
