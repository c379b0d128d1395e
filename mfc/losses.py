"""PPO-family losses on packed per-token tensors: actor (clipped, dual-clip, decoupled),
critic (clipped value loss), entropy, and loss aggregation.

Contract with the train engine (``parallel/engine.py``): a loss function returns a
SUM, and the engine divides the sum over all micro-batches and dp ranks by the
sum of the micro-batches' weights. :func:`aggregate` and :func:`aggregation_weight`
make that pair for each aggregation mode, so the result is the intended mean over
the GLOBAL batch, independent of how it is split:

* ``token-mean``: sum of token losses / number of loss tokens;
* ``seq-mean-token-mean``: mean over sequences of each sequence's token mean;
* ``seq-mean-token-sum``: mean over sequences of each sequence's token sum;
* ``seq-mean-token-sum-norm``: token sum / ``norm_len`` per sequence, mean over
  sequences (Dr. GRPO: a constant length normaliser, no per-sequence length bias).

Stats are sums too (``*_sum`` and counts), so they add over micro-batches and ranks;
:func:`mean_stats` turns them into means. ``n_loss_tokens`` counts the masked tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from mfc.advantages import as_seqlens, segment_sum
from mfc.kl import kl_estimate
from mfc.mismatch import correction_weights, gap_stats
from realflow.api.registry import Registry

if TYPE_CHECKING:  # the knobs import this module (its modes, its registry of policy losses)
    from mfc.ppo_config import LossConfig

__all__ = ["AGG_MODES", "IS_LEVELS", "policy_losses", "register_policy_loss", "aggregate", "aggregation_weight", "token_logprobs", "entropy_from_logits",
           "ppo_actor_loss", "value_loss", "mean_stats"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r} (known: {', '.join(AGG_MODES)})")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, seqlens: Sequence[int] | torch.Tensor | None,
              mode: str = "token-mean", norm_len: float | None = None) -> torch.Tensor:
    """The loss SUM of ``per_token`` (masked) for ``mode``; divide by :func:`aggregation_weight`."""
    _check_mode(mode)
    m = mask.to(per_token.dtype)
    if mode == "token-mean" or mode == "seq-mean-token-sum":
        return (per_token * m).sum()
    if seqlens is None:
        raise ValueError(f"loss aggregation {mode!r} needs seqlens")
    if mode == "seq-mean-token-sum-norm":
        if not norm_len or norm_len <= 0:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs norm_len > 0 "
                             "(e.g. max_new_tokens)")
        return (per_token * m).sum() / norm_len
    lens = as_seqlens(seqlens, per_token.shape[0])
    per_seq = segment_sum(per_token * m, lens)
    cnt = segment_sum(m.detach(), lens)
    return (per_seq / cnt.clamp(min=1)).sum()


def aggregation_weight(mask: torch.Tensor, seqlens: Sequence[int] | torch.Tensor | None,
                       mode: str = "token-mean") -> float:
    """The weight of a micro-batch for ``mode``: loss tokens, or sequences with >= 1 loss token."""
    _check_mode(mode)
    if mode == "token-mean":
        return float(mask.sum())
    if seqlens is None:
        raise ValueError(f"loss aggregation {mode!r} needs seqlens")
    lens = as_seqlens(seqlens, mask.shape[0])
    return float((segment_sum(mask.float(), lens) > 0).sum())


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target | context) per position from ``[T, V]`` logits (fp32), at ``temperature``
    (use the sampling temperature so ratios compare like with like)."""
    lg = logits.float()
    if temperature != 1.0:
        lg = lg / temperature
    return torch.log_softmax(lg, -1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution at every position of ``[T, V]`` logits."""
    lg = logits.float()
    if temperature != 1.0:
        lg = lg / temperature
    logp = torch.log_softmax(lg, -1)
    return -(logp.exp() * logp).sum(-1)


def _same_shape(**tensors: torch.Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have the same shape, got {shapes}")


def ppo_actor_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, cfg: LossConfig,
                   seqlens: Sequence[int] | torch.Tensor | None = None,
                   prox_logprobs: torch.Tensor | None = None,
                   entropy: torch.Tensor | None = None,
                   ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO policy loss (a SUM, see :func:`aggregate`) and summed stats.

    ``old_logprobs`` are the behaviour policy's (the generator's). With
    ``prox_logprobs`` this is the decoupled objective: the ratio ``pi/pi_prox`` is
    clipped and each token's loss is scaled by the (capped, constant) behaviour weight
    ``pi_prox/pi_behav``; without it, or with ``prox == old``, it is standard PPO.
    ``importance_sampling_level='sequence'`` (GSPO) uses for every token of a sequence the
    sequence ratio ``exp(mean of its tokens' log-ratios)``, clipped at the sequence level,
    its gradient reaching every token through the mean. ``policy_loss='sapo'`` replaces the
    clip by SAPO's soft gate ``(4 / tau) * sigmoid(tau * (ratio - 1))`` (``tau_pos`` where the
    advantage is positive, ``tau_neg`` elsewhere). ``entropy`` (per token, differentiable)
    adds ``-entropy_coef * entropy``; with ``kl_in='loss'`` and ``kl_coef > 0``, ``ref_logprobs``
    adds ``kl_coef * KL(pi || pi_ref)`` per token (estimator ``cfg.kl_estimator_used()``: k3 unless
    set). ``seq-mean-token-sum-norm`` divides by ``loss_agg_norm_len`` (the interface sets it to
    ``max_new_tokens`` when unset). ``mismatch_correction`` reweights or drops tokens by the
    behaviour ratio ``pi_prox / pi_behav`` (:func:`mfc.mismatch.correction_weights`) before the
    cap. The knobs are :class:`mfc.ppo_config.LossConfig`'s.
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                loss_mask=loss_mask, prox_logprobs=prox_logprobs, entropy=entropy, ref_logprobs=ref_logprobs)
    mask = loss_mask.bool()
    adv = advantages.detach().float()
    behav = old_logprobs.detach().float()
    prox = behav if prox_logprobs is None else prox_logprobs.detach().float()
    log_ratio = logprobs.float() - prox
    if cfg.importance_sampling_level == "sequence":
        if seqlens is None:
            raise ValueError("importance_sampling_level='sequence' needs seqlens")
        log_ratio = _sequence_mean(log_ratio, mask, seqlens)
    ratio = torch.exp(log_ratio)
    pg, clipped = policy_losses.get(cfg.policy_loss)(ratio, adv, cfg)
    clipped = clipped & mask
    dual = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (pg > bound) & mask
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    with torch.no_grad():
        # the behaviour weight pi_prox / pi_behav, after the mismatch correction (mfc.mismatch)
        all_tokens = mask
        behav_w, mask, corr_stats = correction_weights(prox - behav, mask, cfg, seqlens)
        capped = torch.zeros_like(mask)
        if cfg.behav_imp_weight_cap is not None:
            capped = (behav_w > cfg.behav_imp_weight_cap) & mask
            if cfg.behav_cap_mode == "mask":
                mask = mask & ~capped
            else:
                behav_w = behav_w.clamp(max=cfg.behav_imp_weight_cap)
    per_token = pg * behav_w
    if entropy is not None and cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy.float()
    kl = None
    kl_coef = cfg.kl_loss_coef()
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_in='loss' with kl_coef > 0 needs the reference model's logprobs")
        kl = kl_estimate(logprobs, ref_logprobs.detach(), cfg.kl_estimator_used(), value_clamp=cfg.kl_clamp)
        per_token = per_token + kl_coef * kl
    # a token the correction or the cap drops adds nothing, but still counts in the normaliser (as in
    # IcePop's objective; the micro-batch's weight counts it too): every aggregation treats it alike
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = aggregate(per_token, all_tokens, seqlens, cfg.loss_agg, cfg.loss_agg_norm_len)
    with torch.no_grad():
        m = mask.float()
        stats = {
            "n_loss_tokens": float(m.sum()),
            "clipped_tokens": float(clipped.sum()),
            "dual_clipped_tokens": float(dual.sum()),
            "behav_capped_tokens": float(capped.sum()),
            "pg_loss_sum": float((pg * m).sum()),
            "approx_kl_sum": float((-log_ratio * m).sum()),                 # k1 of pi_prox vs pi
            "approx_kl_k3_sum": float(((torch.expm1(log_ratio) - log_ratio) * m).sum()),
            "ratio_sum": float((ratio * m).sum()),
            "behav_imp_weight_sum": float((behav_w * m).sum()),
            "advantage_sum": float((adv * m).sum()),
            "entropy_sum": float((entropy.float() * m).sum()) if entropy is not None else 0.0,
        }
        if kl is not None:
            stats["kl_loss_sum"] = float((kl * m).sum())
        stats.update(corr_stats)
        # this policy against the generator's on the loss tokens: the mismatch, read from the first
        # update of a step (before it, the trained weights are the ones that generated)
        stats.update(gap_stats(logprobs, behav, loss_mask))
    return loss, stats


#: per-token policy-gradient losses: ``fn(ratio, advantages, cfg) -> (loss per token, clipped mask)``;
#: ``ppo.policy_loss=NAME`` picks one; a user package adds its own with ``@register_policy_loss``
policy_losses: Registry[Callable[[torch.Tensor, torch.Tensor, "LossConfig"],
                                 tuple[torch.Tensor, torch.Tensor]]] = Registry("policy loss")


def register_policy_loss(name: str):
    return policy_losses.register(name)


@register_policy_loss("clip")
def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: "LossConfig") -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: ``-min(ratio A, clip(ratio, 1 - eps_clip, 1 + eps_clip_high) A)``."""
    hi = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + hi)
    return torch.maximum(loss1, loss2), loss2 > loss1


@register_policy_loss("sapo")
def sapo_soft_gate(ratio: torch.Tensor, adv: torch.Tensor, cfg: "LossConfig") -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO: ``-(4 / tau) sigmoid(tau (ratio - 1)) A``, ``tau = sapo_tau_pos`` where ``A > 0``."""
    tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
    return -adv * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)), torch.zeros_like(adv, dtype=torch.bool)


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor, seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Each token gets the mean of ``x`` over its sequence's masked tokens (differentiable)."""
    lens = as_seqlens(seqlens, x.shape[0])
    m = mask.to(x.dtype)
    per_seq = segment_sum(x * m, lens) / segment_sum(m.detach(), lens).clamp(min=1)
    return torch.repeat_interleave(per_seq, lens.to(per_seq.device))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               loss_mask: torch.Tensor, eps_clip: float | None = 0.2,
               seqlens: Sequence[int] | torch.Tensor | None = None, agg: str = "token-mean",
               norm_len: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped critic loss: ``0.5 * max((v - R)^2, (v_clip - R)^2)`` with
    ``v_clip = old + clip(v - old, -eps, eps)`` (``eps_clip=None``: unclipped). A SUM."""
    _same_shape(values=values, old_values=old_values, returns=returns, loss_mask=loss_mask)
    mask = loss_mask.bool()
    v = values.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    l1 = (v - ret) ** 2
    if eps_clip is None:
        per_token, clipped = 0.5 * l1, torch.zeros_like(mask)
    else:
        v_clip = old + (v - old).clamp(-eps_clip, eps_clip)
        l2 = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(l1, l2)
        # the clipped branch is active only where the clip moved v (float rounding aside)
        clipped = ((v - old).abs() > eps_clip) & (l2 > l1) & mask
    loss = aggregate(per_token, mask, seqlens, agg, norm_len)
    with torch.no_grad():
        m = mask.float()
        stats = {
            "n_loss_tokens": float(m.sum()),
            "value_clipped_tokens": float(clipped.sum()),
            "value_loss_sum": float((per_token * m).sum()),
            "value_sum": float((v * m).sum()),
            "return_sum": float((ret * m).sum()),
            "value_abs_err_sum": float(((v - ret).abs() * m).sum()),
        }
    return loss, stats


def mean_stats(stats: dict[str, float], count_key: str = "n_loss_tokens") -> dict[str, float]:
    """``x_sum`` -> ``x`` (divided by ``count_key``), ``x_tokens`` -> ``x_frac``; others kept."""
    n = max(stats.get(count_key, 0.0), 1.0)
    out: dict[str, float] = {}
    for k, v in stats.items():
        if k.endswith("_sum"):
            out[k[:-4]] = v / n
        elif k.endswith("_tokens") and k != count_key:
            out[k[:-7] + "_frac"] = v / n
        else:
            out[k] = v
    return out
