"""The gap between the generator's and the trainer's log-probs: measured, and corrected.

Why: the log-prob a generation engine reports for a token it sampled is not exactly the
trainer's for the same token and weights (kernels, precision, batch shapes, MoE routing, stale
weight copies). Every RL step logs the gap (:func:`gap_stats`) and, when asked, corrects the
loss for it (:func:`correction_weights`).

**The ratio.** ``rho = pi_train_old / pi_gen`` per response token, where ``pi_gen`` is the
behaviour log-prob the generator reported and ``pi_train_old`` the trainer's own log-prob of the
same token before it updates: the proximal policy of decoupled PPO. Synchronous runs get it from
a recompute pass (``ppo.recompute_logprobs``, on by itself with a correction), asynchronous runs
from ``actor_inf`` at the trainer's current version. So the same ratio is the decoupled
objective's behaviour weight: in a synchronous run it is the mismatch alone; in an asynchronous
one it is the mismatch times the staleness (the trainer has no logits of older versions), and
the step stats split the gap by version offset so the two can be told apart.

**The corrections** (``ppo.mismatch_correction``; C = ``ppo.mismatch_cap``):

* ``tis``: token weight ``min(rho, C)`` (truncated importance sampling);
* ``mis``: tokens with ``rho`` outside ``[1/C, C]`` leave the loss, the rest keep weight ``rho``;
* ``icepop``: tokens with ``rho`` outside ``[icepop_low, icepop_high]`` leave the loss (IcePop,
  defaults 0.5 and 5), the rest keep weight ``rho``;
* ``seq-tis`` / ``seq-mis``: the same with the sequence's geometric mean
  ``exp(mean over its tokens of log rho)`` for every token of the sequence (a masked sequence
  leaves the loss whole).

Then the decoupled cap (``behav_imp_weight_cap``, truncate or mask) bounds what is left: it is
itself a token-level TIS with C = 5, so a correction with tighter bounds decides.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from mfc.advantages import as_seqlens, segment_sum
from realflow.base.stats import DECADE_EDGES

if TYPE_CHECKING:
    from mfc.ppo_config import LossConfig

__all__ = ["CORRECTIONS", "HIST_EDGES", "MAX_STALENESS", "correction_weights", "gap_stats", "gap_means"]

CORRECTIONS = ("none", "tis", "mis", "icepop", "seq-tis", "seq-mis")
#: |delta log p| histogram bins: [0, 1e-6), [1e-6, 1e-5), ..., [1, 10), [10, inf) (TensorBoard draws
#: ``mismatch/hist_<i>`` as one histogram per step: realflow.base.stats.decade_histograms)
HIST_EDGES = DECADE_EDGES
#: version offsets reported one by one; older tokens share the last bucket
MAX_STALENESS = 4
PREFIX = "mismatch/"


def _bounds(cfg: "LossConfig") -> tuple[float, float]:
    if cfg.mismatch_correction == "icepop":
        return cfg.icepop_low, cfg.icepop_high
    return 1.0 / cfg.mismatch_cap, cfg.mismatch_cap


def correction_weights(log_rho: torch.Tensor, mask: torch.Tensor, cfg: "LossConfig",
                       seqlens: Optional[Sequence[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  dict[str, float]]:
    """(per-token weight, the mask without the tokens the correction drops, summed stats).

    ``log_rho = log pi_train_old - log pi_gen`` per token (no gradient flows through it).
    With ``mismatch_correction='none'`` the weight is ``rho`` and nothing is dropped.
    """
    corr = cfg.mismatch_correction
    lr = log_rho.detach().float()
    if corr.startswith("seq-"):
        if seqlens is None:
            raise ValueError(f"mismatch_correction={corr!r} needs seqlens")
        lens = as_seqlens(seqlens, lr.shape[0])
        m = mask.float()
        per_seq = segment_sum(lr * m, lens) / segment_sum(m, lens).clamp(min=1)
        lr = torch.repeat_interleave(per_seq, lens.to(per_seq.device))
    rho = torch.exp(lr)
    keep = mask.bool()
    changed = torch.zeros_like(keep)
    if corr in ("tis", "seq-tis"):
        changed = (rho > cfg.mismatch_cap) & keep
        rho = rho.clamp(max=cfg.mismatch_cap)
    elif corr in ("mis", "seq-mis", "icepop"):
        lo, hi = _bounds(cfg)
        changed = ((rho < lo) | (rho > hi)) & keep
        keep = keep & ~changed
    stats = {"mismatch_corrected_tokens": float(changed.sum())} if corr != "none" else {}
    return rho, keep, stats


# ---- measurement ---------------------------------------------------------------------------------


def gap_stats(train_lp: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor,
              staleness: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Summed statistics of ``delta = log pi_train - log pi_gen`` over the masked tokens.

    Sums and counts add over micro-batches and data-parallel ranks; keys ending in ``_max`` are
    maxima (the engine reduces them with max). :func:`gap_means` turns them into the logged
    means. ``staleness`` (per token, trainer version minus the token's version) splits the mean
    |delta| by version offset: offset 0 is the pure mismatch.
    """
    m = mask.bool()
    d = (train_lp.detach().float() - gen_lp.detach().float())[m]
    a = d.abs()
    out = {PREFIX + "tokens": float(d.numel()),
           PREFIX + "abs_sum": float(a.sum()),
           PREFIX + "abs_max": float(a.max()) if d.numel() else 0.0,
           # k3 estimate of KL(pi_gen || pi_train) from tokens sampled by the generator
           PREFIX + "k3_sum": float((torch.expm1(d) - d).sum()),
           PREFIX + "over_0.1_tokens": float((a > 0.1).sum()),
           PREFIX + "over_1_tokens": float((a > 1.0).sum())}
    edges = torch.tensor(HIST_EDGES, dtype=a.dtype)
    counts = torch.bincount(torch.bucketize(a, edges, right=True), minlength=len(HIST_EDGES) + 1)
    for i, c in enumerate(counts.tolist()):
        out[f"{PREFIX}hist_{i}_tokens"] = float(c)
    if staleness is not None:
        s = staleness[m].clamp(min=0, max=MAX_STALENESS)
        for k in range(MAX_STALENESS + 1):
            sel = s == k
            out[f"{PREFIX}v{k}_tokens"] = float(sel.sum())
            out[f"{PREFIX}v{k}_abs_sum"] = float(a[sel].sum())
    return out


def gap_means(sums: dict[str, float]) -> dict[str, float]:
    """The logged per-step values from :func:`gap_stats`' (reduced) sums.

    ``mismatch/abs_mean``, ``abs_max``, ``k3`` (mean), ``frac_over_0.1``, ``frac_over_1``,
    ``hist_<i>`` (share of tokens per bin), ``v<k>_abs_mean`` (per version offset, where any
    token has it) and ``tokens`` (how many were measured).
    """
    n = sums.get(PREFIX + "tokens", 0.0)
    if n <= 0:
        return {}
    out = {PREFIX + "tokens": n,
           PREFIX + "abs_mean": sums[PREFIX + "abs_sum"] / n,
           PREFIX + "abs_max": sums[PREFIX + "abs_max"],
           PREFIX + "k3": sums[PREFIX + "k3_sum"] / n,
           PREFIX + "frac_over_0.1": sums[PREFIX + "over_0.1_tokens"] / n,
           PREFIX + "frac_over_1": sums[PREFIX + "over_1_tokens"] / n}
    for i in range(len(HIST_EDGES) + 1):
        out[f"{PREFIX}hist_{i}"] = sums.get(f"{PREFIX}hist_{i}_tokens", 0.0) / n
    for k in range(MAX_STALENESS + 1):
        nk = sums.get(f"{PREFIX}v{k}_tokens", 0.0)
        if nk > 0:
            out[f"{PREFIX}v{k}_abs_mean"] = sums[f"{PREFIX}v{k}_abs_sum"] / nk
            out[f"{PREFIX}v{k}_frac"] = nk / n
    return out
