"""Advantage estimators over PACKED sequences (one 1D tensor, sequences back to back).

Layout: every function takes per-token tensors of the *response* (action) tokens,
concatenated over all sequences, plus ``seqlens`` (the length of each sequence,
in order).  Per-sequence scalars (one outcome reward per response) are 1D tensors
of length ``len(seqlens)``; groups (the ``n`` responses to one prompt, i.e. one
sample of a :class:`~realflow.api.batch.SequenceBatch`) are given by
``group_sizes`` (number of consecutive sequences per group).

Why a segmented scan: discounted sums run backwards inside each sequence and must
not leak across sequence boundaries.  :func:`segment_discounted_cumsum` solves the
affine recurrence ``y[t] = x[t] + a[t] * y[t+1]`` for all sequences at once with a
Hillis-Steele doubling scan: ``ceil(log2(max seqlen))`` vectorised steps, no Python
loop over tokens or sequences.  ``a`` is forced to 0 at each sequence end, which
cuts the recurrence there exactly (products through a 0 stay 0).  Unlike the
``gamma**-t`` rescaling trick it cannot underflow or overflow on long sequences.
Work is done in float64 and cast back to the input dtype.

GAE bootstrapping: the value after a sequence's last token is 0 when the sequence
*finished* (emitted EOS: the episode ended) and ``bootstrap_values[i]`` when it was
*truncated* (cut by ``max_new_tokens``: the episode would have continued, so the
critic's estimate of the remaining return stands in for it).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = [
    "as_seqlens", "segment_ids", "seq_to_token", "token_group_ids", "segment_sum", "segment_discounted_cumsum",
    "gae", "discounted_returns", "grpo_advantages", "rloo_advantages", "reinforce_pp_advantages",
    "normalize", "DpSum",
]

# Sums a list of floats over the data-parallel group (e.g. ``model.module.dp_sum``), so
# "batch" statistics are over the global batch and not only this rank's shard.
DpSum = Callable[[list[float]], list[float]]


def as_seqlens(seqlens: Sequence[int] | torch.Tensor, total: int | None = None,
               what: str = "seqlens") -> torch.Tensor:
    """``seqlens`` as a long tensor, checked (non-negative; sums to ``total`` if given)."""
    t = torch.as_tensor(seqlens, dtype=torch.long).reshape(-1)
    if (t < 0).any():
        raise ValueError(f"{what} has a negative length: {t.tolist()}")
    if total is not None and int(t.sum()) != total:
        raise ValueError(f"{what} sums to {int(t.sum())} but the packed tensor has {total} entries")
    return t


def segment_ids(seqlens: Sequence[int] | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """For each token, the index of its sequence: ``[2, 1] -> [0, 0, 1]``."""
    lens = as_seqlens(seqlens)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens.to(device))


def seq_to_token(per_seq: torch.Tensor, seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Broadcast one value per sequence to every token of that sequence."""
    lens = as_seqlens(seqlens)
    if per_seq.shape[0] != len(lens):
        raise ValueError(f"{per_seq.shape[0]} per-sequence values for {len(lens)} sequences")
    return torch.repeat_interleave(per_seq, lens.to(per_seq.device), dim=0)


def token_group_ids(group_sizes: Sequence[int] | torch.Tensor,
                    seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """For each token, the index of its group (for ``normalize(mode="group")``).

    ``group_sizes``: sequences per group, e.g. ``[len(l) for l in batch.seqlens[key]]``.
    """
    lens = as_seqlens(seqlens)
    return seq_to_token(segment_ids(as_seqlens(group_sizes, len(lens), what="group_sizes")), lens)


def segment_sum(x: torch.Tensor, seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per-sequence sum of a packed tensor (empty sequences sum to 0)."""
    lens = as_seqlens(seqlens, x.shape[0])
    out = torch.zeros(len(lens), dtype=x.dtype, device=x.device)
    return out.index_add_(0, segment_ids(lens, x.device), x)


def _check_packed(name: str, x: torch.Tensor, n: int) -> None:
    if x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{name} must be a 1D packed tensor of {n} entries, got shape {tuple(x.shape)}")


def segment_discounted_cumsum(x: torch.Tensor, discount: float | torch.Tensor,
                              seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``y[t] = x[t] + discount * y[t+1]`` inside each sequence, ``y[last] = x[last]``.

    ``discount`` is a scalar or a per-token tensor (the factor linking ``t`` to ``t+1``).
    See the module docstring for the scan.
    """
    lens = as_seqlens(seqlens, x.shape[0])
    n = x.shape[0]
    _check_packed("x", x, n)
    if n == 0:
        return x.clone()
    b = x.to(torch.float64).clone()
    if isinstance(discount, torch.Tensor):
        _check_packed("discount", discount, n)
        a = discount.to(device=x.device, dtype=torch.float64).clone()
    else:
        a = torch.full((n,), float(discount), dtype=torch.float64, device=x.device)
    ends = torch.cumsum(lens, 0)[lens > 0] - 1
    a[ends.to(x.device)] = 0.0
    d, longest = 1, int(lens.max())
    while d < longest:
        # compose (a[t], b[t]) with (a[t+d], b[t+d]); beyond the end the composition is the identity
        b[:-d] = b[:-d] + a[:-d] * b[d:]
        a[:-d] = a[:-d] * a[d:]
        a[-d:] = 0.0
        d *= 2
    return b.to(x.dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, seqlens: Sequence[int] | torch.Tensor,
        gamma: float = 1.0, lam: float = 1.0, done: torch.Tensor | None = None,
        bootstrap_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over packed sequences -> (advantages, returns).

    ``rewards[t]``/``values[t]``: reward for and value of the state before response token
    ``t``. ``done[i]`` (default all True): sequence ``i`` finished, so the value after its
    last token is 0; otherwise ``bootstrap_values[i]`` is used (required then).
    ``returns = advantages + values`` (the critic's regression target).
    """
    n = rewards.shape[0]
    lens = as_seqlens(seqlens, n)
    _check_packed("rewards", rewards, n)
    _check_packed("values", values, n)
    n_seq = len(lens)
    if done is None:
        done = torch.ones(n_seq, dtype=torch.bool, device=rewards.device)
    if done.shape != (n_seq,):
        raise ValueError(f"done must have one entry per sequence ({n_seq}), got shape {tuple(done.shape)}")
    done = done.to(device=rewards.device, dtype=torch.bool)
    if bootstrap_values is None:
        if not bool(done.all()):
            raise ValueError("gae: some sequences are truncated (done=False) but no bootstrap_values given")
        bootstrap_values = torch.zeros(n_seq, dtype=values.dtype, device=values.device)
    if bootstrap_values.shape != (n_seq,):
        raise ValueError(f"bootstrap_values must have one entry per sequence ({n_seq}), "
                         f"got shape {tuple(bootstrap_values.shape)}")
    v = values.detach().to(torch.float64)
    next_v = torch.roll(v, -1) if n else v
    nonempty = lens > 0
    ends = (torch.cumsum(lens, 0) - 1)[nonempty].to(v.device)
    last = torch.where(done, torch.zeros_like(bootstrap_values), bootstrap_values.detach())
    next_v[ends] = last[nonempty.to(last.device)].to(torch.float64)
    delta = rewards.to(torch.float64) + gamma * next_v - v
    adv = segment_discounted_cumsum(delta, gamma * lam, lens)
    return adv.to(rewards.dtype), (adv + v).to(rewards.dtype)


def discounted_returns(rewards: torch.Tensor, seqlens: Sequence[int] | torch.Tensor,
                       gamma: float = 1.0) -> torch.Tensor:
    """Per-token discounted return-to-go inside each sequence (no bootstrap)."""
    return segment_discounted_cumsum(rewards, gamma, seqlens)


def _group_index(group_sizes: Sequence[int] | torch.Tensor, n_seq: int, device) -> torch.Tensor:
    sizes = as_seqlens(group_sizes, n_seq, what="group_sizes")
    return segment_ids(sizes, device), sizes.to(device)


def _group_mean_std(r: torch.Tensor, gid: torch.Tensor, sizes: torch.Tensor,
                    unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence mean and std of its group (std of a one-member group is 0)."""
    n_g = len(sizes)
    cnt = sizes.to(torch.float64).clamp(min=1)
    mean = torch.zeros(n_g, dtype=torch.float64, device=r.device).index_add_(0, gid, r) / cnt
    dev2 = (r - mean[gid]) ** 2
    ss = torch.zeros(n_g, dtype=torch.float64, device=r.device).index_add_(0, gid, dev2)
    denom = (cnt - 1).clamp(min=1) if unbiased else cnt
    std = torch.where(sizes > 1, (ss / denom).sqrt(), torch.zeros_like(ss))
    return mean[gid], std[gid]


def grpo_advantages(rewards: torch.Tensor, group_sizes: Sequence[int] | torch.Tensor,
                    eps: float = 1e-6, scale_by_std: bool = True, unbiased_std: bool = True,
                    seqlens: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)`` per sequence.

    ``rewards``: one scalar per sequence; ``group_sizes``: sequences per group (consecutive).
    ``scale_by_std=False`` gives Dr. GRPO (no division by std). A group of one has no
    comparison and gets advantage 0. With ``seqlens`` the result is broadcast to tokens.
    """
    r = rewards.detach().to(torch.float64)
    gid, sizes = _group_index(group_sizes, r.shape[0], r.device)
    mean, std = _group_mean_std(r, gid, sizes, unbiased_std)
    adv = r - mean
    if scale_by_std:
        adv = adv / (std + eps)
    adv = adv.to(rewards.dtype)
    return adv if seqlens is None else seq_to_token(adv, seqlens)


def rloo_advantages(rewards: torch.Tensor, group_sizes: Sequence[int] | torch.Tensor,
                    seqlens: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` inside each group (a group of one gets 0)."""
    r = rewards.detach().to(torch.float64)
    gid, sizes = _group_index(group_sizes, r.shape[0], r.device)
    total = torch.zeros(len(sizes), dtype=torch.float64, device=r.device).index_add_(0, gid, r)
    k = sizes.to(torch.float64)[gid]
    others = (total[gid] - r) / (k - 1).clamp(min=1)
    adv = torch.where(k > 1, r - others, torch.zeros_like(r)).to(rewards.dtype)
    return adv if seqlens is None else seq_to_token(adv, seqlens)


def normalize(x: torch.Tensor, mask: torch.Tensor | None = None, mode: str = "batch",
              scale_by_std: bool = True, eps: float = 1e-8,
              group_ids: torch.Tensor | None = None, dp_sum: DpSum | None = None) -> torch.Tensor:
    """Normalise a packed tensor over the masked entries: ``(x - mean) / (std + eps)``.

    ``mode``: ``"none"``, ``"batch"`` (one mean/std over all masked entries, over the
    global batch when ``dp_sum`` is given), ``"group"`` (per ``group_ids[t]``).
    ``scale_by_std=False`` only subtracts the mean. Unmasked entries come back as 0.
    The std is the population std. A shorthand for :func:`mfc.normalization.normalize`.
    """
    from mfc.normalization import NormConfig, normalize as normalize_by

    if mode not in ("none", "batch", "group"):
        raise ValueError(f"normalize: unknown mode {mode!r} (known: 'none', 'batch', 'group')")
    cfg = NormConfig(mean_level=mode, std_level=mode if scale_by_std else "none", std_unbiased=False, eps=eps)
    return normalize_by(x, cfg, group_ids, mask, dp_sum if mode == "batch" else None)


def reinforce_pp_advantages(token_rewards: torch.Tensor, seqlens: Sequence[int] | torch.Tensor,
                            gamma: float = 1.0, mask: torch.Tensor | None = None,
                            scale_by_std: bool = True, eps: float = 1e-8,
                            dp_sum: DpSum | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, normalised over the global batch.

    ``token_rewards`` usually holds the KL penalty on every token plus the outcome
    reward on the last one (:func:`mfc.kl.shape_rewards`). Returns (advantages, returns).
    """
    returns = discounted_returns(token_rewards, seqlens, gamma)
    return normalize(returns, mask, "batch", scale_by_std, eps, dp_sum=dp_sum), returns
