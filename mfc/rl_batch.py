"""Turn a generated RL batch into per-token training tensors (advantages, returns, masks).

Conventions (shared with the generation and inference MFCs): a sequence is prompt +
response, packed; a per-token key ``x`` is aligned with ``packed_input_ids`` and
``x[t]`` belongs to the *action* of predicting token ``t + 1`` (so ``packed_logprobs[t]
= log pi(ids[t+1] | ids[..t])``, zero where there is no response token to predict).
Action positions are therefore ``t`` with ``prompt_mask[t + 1] == 0`` inside the
sequence. Everything RL-specific (reward shaping, advantages, normalisation) runs on
the action positions only, as response-only packed tensors with one length per
sequence, and is scattered back to full positions for the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mfc.advantages import discounted_returns, gae, seq_to_token
from mfc.images import has_images, image_data, sequence_images
from mfc.kl import KLControlConfig, kl_estimate, make_kl_controller, shape_rewards
from mfc.normalization import normalize
from mfc.ppo_config import ESTIMATORS, AdvantageConfig, KLConfig  # noqa: F401  (importable from here too)
from mfc.ppo_functional import ppo_minibatches
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.engine import LossFn, TrainEngine, runs_pad_free
from realflow.api.images import IMAGES_EXTRA
from realflow.api.keys import (INPUT_IDS, LOGPROBS, NO_EOS, PROMPT_MASK, REF_LOGPROBS, REWARDS,  # noqa: F401
                               ROUTED_EXPERTS, VALUES)

#: what the engine reports of a train step's work, logged as is: tokens and FLOPs, useful and
#: computed (padding, fillers, shared prefixes: parallel/flops.py)
WORK_KEYS = ("n_tokens", "n_computed_tokens", "flops_useful", "flops_computed")


def overlong_punishment(resp_lens: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per sequence: 0 up to ``max_new_tokens - buffer`` tokens,
    then falling linearly to ``-penalty`` at ``max_new_tokens`` (and beyond)."""
    start = max_new_tokens - buffer
    over = (resp_lens.to(torch.float64) - start).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1.0)


@dataclass
class RLTensors:
    """Per-token tensors over the full packed sequences of a local batch."""

    seqlens: list[int]  # per sequence (groups flattened)
    action_mask: torch.Tensor  # bool [T]
    old_logprobs: torch.Tensor  # [T]
    advantages: torch.Tensor  # [T], 0 off-action
    returns: torch.Tensor  # [T], 0 off-action (critic target)
    old_values: Optional[torch.Tensor]  # [T] or None
    stats: dict[str, float]


def flat_seqlens(batch: SequenceBatch, key: str = INPUT_IDS) -> list[int]:
    return [n for lens in batch.seqlens[key] for n in lens]


def action_mask(ids: torch.Tensor, prompt_mask: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """True at positions that predict a response token of the same sequence."""
    ends = torch.cumsum(torch.tensor(seqlens, dtype=torch.long), 0) - 1
    nxt_is_resp = ~torch.roll(prompt_mask.bool(), -1)
    nxt_is_resp[ends] = False
    return nxt_is_resp


class KLPenalty:
    """The KL coefficient of the reward penalty, fixed or adapted after every step.

    Actor and critic each hold one; both see the same batches and statistics, so their
    coefficients stay equal without talking to each other.
    """

    def __init__(self, cfg: KLConfig) -> None:
        self.ctl = make_kl_controller(KLControlConfig(cfg.kl_ctl, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon))

    @property
    def value(self) -> float:
        return self.ctl.value

    def rl_tensors(self, batch: SequenceBatch, cfg: AdvantageConfig,
                   dp_sum: Callable[[list[float]], list[float]], max_new_tokens: int = 0) -> tuple["RLTensors", float]:
        """:func:`compute_rl_tensors` at the current coefficient, then adapt it; returns (tensors, coef used)."""
        coef = self.value
        t = compute_rl_tensors(batch, cfg, dp_sum=dp_sum, kl_coef=coef, max_new_tokens=max_new_tokens)
        self.update(t.stats, dp_sum)
        return t, coef

    def update(self, stats: dict[str, float], dp_sum: Callable[[list[float]], list[float]]) -> float:
        """Feed the step's mean per-sequence KL (summed over dp ranks); returns the new coefficient."""
        if "kl_ref_sum" in stats:
            kl_sum, n_seqs = dp_sum([stats["kl_ref_sum"], stats["n_seqs"]])
            self.ctl.update(kl_sum / max(n_seqs, 1.0), int(n_seqs))
        return self.ctl.value


def compute_rl_tensors(batch: SequenceBatch, cfg: AdvantageConfig,
                       dp_sum: Optional[Callable[[list[float]], list[float]]] = None,
                       kl_coef: Optional[float] = None, max_new_tokens: int = 0) -> RLTensors:
    """Rewards -> (shaped token rewards) -> advantages and returns, for this dp rank's batch.

    ``kl_coef`` overrides ``cfg.kl_coef`` (an adaptive controller's current value);
    ``max_new_tokens``: the generation's length limit (DAPO's overlong punishment measures
    against it)."""
    kl_coef = cfg.kl_coef if kl_coef is None else kl_coef
    ids = batch.data[INPUT_IDS]
    lens = flat_seqlens(batch)
    act = action_mask(ids, batch.data[PROMPT_MASK], lens)
    resp_lens = [int(x) for x in torch.segment_reduce(act.float(), "sum", lengths=torch.tensor(lens)).tolist()]
    if any(n == 0 for n in resp_lens):
        raise ValueError("a sequence has no response token (empty generation); nothing to train on")
    group_sizes = [len(g) for g in batch.seqlens[INPUT_IDS]]
    scores = batch.data[REWARDS].float().reshape(-1)
    if scores.shape[0] != len(lens):
        raise ValueError(f"{REWARDS}: {scores.shape[0]} values for {len(lens)} sequences (one per sequence)")
    no_eos = batch.data[NO_EOS].bool().reshape(-1) if NO_EOS in batch.data else torch.zeros(len(lens), dtype=torch.bool)
    old_lp = batch.data[LOGPROBS].float()
    a_old = old_lp[act]
    kl = None
    stats: dict[str, float] = {"score_sum": float(scores.sum()), "n_seqs": float(len(lens)),
                               "n_truncated": float(no_eos.sum()), "n_action_tokens": float(act.sum()),
                               "n_prompt_tokens": float(sum(lens) - act.sum()),
                               "response_len_max": float(max(resp_lens, default=0)),
                               # -log p of the sampled tokens: a Monte-Carlo estimate of the policy's entropy
                               "neg_logprob_sum": float(-a_old.sum())}
    if REF_LOGPROBS in batch.data:
        kl = kl_estimate(a_old, batch.data[REF_LOGPROBS].float()[act], cfg.kl_estimator_used(),
                         value_clamp=cfg.kl_clamp)
        stats["kl_ref_sum"] = float(kl.sum())
    if cfg.kl_in == "loss":  # the actor's loss carries it (with its gradient): no penalty in the reward
        kl_coef = 0.0
    buffer = cfg.overlong_buffer(max_new_tokens)
    if buffer:
        pun = overlong_punishment(torch.tensor(resp_lens), max_new_tokens, buffer, cfg.overlong_penalty).to(scores.dtype)
        stats["overlong_penalty_sum"] = float(-pun.sum())
        scores = scores + pun
    seq_gid = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
    scores = (scores + cfg.reward_bias) * cfg.reward_scale  # clip((r + bias) * scale), then normalise
    if cfg.reward_clip is not None:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    reward_norm = cfg.reward_norm_used()
    if not reward_norm.is_identity:
        scores = normalize(scores.double(), reward_norm, seq_gid, dp_sum=dp_sum).to(scores.dtype)
    values = batch.data[VALUES].float() if VALUES in batch.data else None
    if cfg.estimator in ("gae", "reinforce++"):
        tok_r = shape_rewards(scores, resp_lens, kl, kl_coef)
        if cfg.estimator == "gae":
            if values is None:
                raise ValueError("estimator 'gae' needs critic values (key 'values'); use grpo/rloo/reinforce++")
            ends = torch.cumsum(torch.tensor(lens), 0) - 1  # value after the last token: bootstrap
            adv, ret = gae(tok_r, values[act], resp_lens, cfg.gamma, cfg.lam, done=~no_eos,
                           bootstrap_values=values[ends])
        else:
            # the return-to-go; its normalisation over the global batch is adv_norm's (below)
            ret = discounted_returns(tok_r, resp_lens, cfg.gamma)
            adv = ret.clone()
    else:  # outcome estimators: the (normalised) sequence reward on each of its tokens
        adv = seq_to_token(scores.float(), resp_lens)
        if kl is not None and kl_coef:
            adv = adv - kl_coef * kl  # KL in the reward, per token (AReaL's way for critic-free runs)
        ret = adv.clone()
    if not cfg.adv_norm.is_identity:
        gid = torch.repeat_interleave(seq_gid, torch.tensor(resp_lens))
        adv = normalize(adv, cfg.adv_norm, gid, dp_sum=dp_sum)
    full_adv = torch.zeros_like(old_lp)
    full_ret = torch.zeros_like(old_lp)
    full_adv[act] = adv.float()
    full_ret[act] = ret.float()
    if cfg.mask_truncated and bool(no_eos.any()):
        seq_of_tok = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        act = act & ~no_eos[seq_of_tok]
    stats["adv_sum"] = float(adv.sum())
    return RLTensors(lens, act, old_lp, full_adv, full_ret, values, stats)


def with_token_keys(batch: SequenceBatch, t: RLTensors,
                    extra: Optional[dict[str, torch.Tensor]] = None) -> SequenceBatch:
    """``batch`` plus the per-token training tensors as keys aligned with ``packed_input_ids``
    (``extra``: more per-token tensors to carry into the micro-batches, e.g. proximal logprobs)."""
    lens = batch.seqlens[INPUT_IDS]
    data = {INPUT_IDS: batch.data[INPUT_IDS], "_mask": t.action_mask.float(), "_old_lp": t.old_logprobs,
            "_adv": t.advantages, "_ret": t.returns, **(extra or {})}
    if t.old_values is not None:
        data["_old_v"] = t.old_values
    seqlens = {k: lens for k in data}
    img_lens, img_data = image_data(batch)  # a VL prompt's images travel with its sample
    seqlens.update(img_lens)
    data.update(img_data)
    return SequenceBatch(list(batch.ids), seqlens, data)


@dataclass
class PPOUpdates:
    """What :func:`run_ppo_updates` did: stats summed over optimizer steps, and the first step's."""

    totals: dict[str, float]
    n_updates: int
    first: dict[str, float]


def run_ppo_updates(engine: TrainEngine, batch: SequenceBatch, t: RLTensors, mb_spec: MicroBatchSpec, *, epochs: int,
                    n_minibatches: int, seed: int, step: int,
                    micro_batch: Callable[[SequenceBatch, list[int]], dict],
                    loss_fn: LossFn, weight_fn: Callable[[Any], float],
                    extra_keys: Optional[dict[str, torch.Tensor]] = None) -> PPOUpdates:
    """``epochs`` x ``n_minibatches`` optimizer steps over ``batch`` with its training tensors ``t``.

    Mini-batches are sample-disjoint and reshuffled per epoch (seeded by ``seed``/``step``);
    ``micro_batch(mb, seqlens)`` builds each micro-batch's loss inputs from the keys of
    :func:`with_token_keys` (``_mask``, ``_old_lp``, ``_adv``, ``_ret``, ``_old_v``).
    """
    tb = with_token_keys(batch, t, extra_keys)
    totals: dict[str, float] = {}
    first: dict[str, float] = {}
    n = 0
    packed = runs_pad_free(engine)  # pad-free micro-batches: as few as the token budget allows
    for _, _, mini in ppo_minibatches(tb, epochs, n_minibatches, seed, step):
        mbs, ids = [], []
        for mb in mini.micro_batches(mb_spec, packed=packed):
            lens = flat_seqlens(mb)
            extra = micro_batch(mb, lens)
            if ROUTED_EXPERTS in mb.data and isinstance(extra, dict):  # MoE routing replay, for the engine
                extra[ROUTED_EXPERTS] = mb.data[ROUTED_EXPERTS]
            if has_images(mb) and isinstance(extra, dict):  # VL prompts: each sequence's images
                extra[IMAGES_EXTRA] = sequence_images(mb)
            mbs.append((mb.data[INPUT_IDS], lens, extra))
            ids.append(mb.ids)
        st = engine.train_batch(mbs, loss_fn, weight_fn, sample_ids=ids)
        first = first or dict(st)
        n += 1
        for k, v in st.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return PPOUpdates(totals, n, first)
