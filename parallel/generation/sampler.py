"""Batched token sampling with one uniform number per sampled row.

Why inverse-CDF sampling with a per-request uniform (instead of
``torch.multinomial``): a request's draws come from its own seeded stream, so
its output depends on its seed alone, not on which other requests share the
batch, and one uniform per token is far cheaper than per-row generators.

The uniforms are counter-based (:func:`counter_uniform`): the ``t``-th draw of the
sample seeded ``s`` is a hash of ``(s, t)``, computed for every row of a step in a
few integer tensor ops.  So a sample's tokens depend on its seed and position
only (not on the batch, nor on a preemption and re-prefill in between), and a
step costs no Python per row (a ``random.Random`` per sample cost ~4 us to seed
and ~0.1 us a draw, ~5% of a default RL rollout on CPU).

Order of the warpers (as transformers): temperature, then top-k, then top-p on
the renormalised top-k distribution, then min-p (the most likely token is always
kept).  Min-p keeps the tokens whose probability is at least ``min_p`` times the
most likely one's (SGLang's and transformers' meaning); that ratio does not change
under renormalisation, so min-p keeps the same tokens wherever it sits in the
order: the result is the intersection of the three truncations, as in SGLang.

Any truncation makes the behaviour policy differ from the untruncated tempered
softmax a trainer recomputes; ``logprob_mode="sampling"`` reports the truncated,
renormalised probability (the exact behaviour probability).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SampleBatch", "sample", "counter_uniform", "split_seed"]

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' "lowbias32" family) on int64 values in
    [0, 2**32); both multipliers are under 2**31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def split_seed(seed: int) -> tuple[int, int]:
    """A seed's low and high 32-bit words (what :func:`counter_uniform` takes)."""
    return seed & _M32, (seed >> 32) & _M32


def counter_uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) (fp64, 53 random bits) of draw ``draw`` of the streams seeded
    ``(seed_hi << 32) + seed_lo``; int64 tensors of one shape (words in [0, 2**32))."""
    k = _hash32(seed_hi ^ _hash32((draw + 0x9E3779B9) & _M32))
    hi = _hash32(seed_lo ^ k)
    lo = _hash32(hi ^ _hash32(k ^ 0x85EBCA6B))
    return ((hi >> 5) * 67108864 + (lo >> 6)).double() * (1.0 / 9007199254740992.0)


@dataclass
class SampleBatch:
    """The rows of one step that sample (the others are greedy).

    ``rows`` index the logits' rows (``None``: every row samples); the other
    fields have one entry per sampled row.  Per-row settings arrive as tensors
    the engine keeps per KV slot, so a step builds no Python lists of settings.
    """

    rows: Optional[torch.Tensor]
    temperature: torch.Tensor  # [S] fp32, > 0
    top_k: torch.Tensor  # [S] long, 0 = off
    top_p: torch.Tensor  # [S] fp32, 1 = off
    min_p: torch.Tensor  # [S] fp32, 0 = off
    uniform: torch.Tensor  # [S] fp64 draws in [0, 1)
    truncate: bool  # some row has top-k, top-p or min-p
    tempered: bool = True  # some row's temperature is not 1 (False: the division is skipped, exact)
    # some row reports sampling logprobs (False: sample() returns None for them, saving ~6 ops)
    sampling_logprobs: bool = True


def sample(logits: torch.Tensor, b: Optional[SampleBatch]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``logits [B, V]`` fp32 -> (tokens [B], raw logprobs [B], sampling logprobs [B]).

    ``b=None``: every row is greedy.  Raw logprobs are of the unmodified
    distribution; sampling logprobs of the distribution the token was drawn
    from (0 for greedy rows; None when ``b.sampling_logprobs`` is False).
    """
    B, V = logits.shape
    logp = torch.log_softmax(logits, dim=-1)
    proc = torch.zeros(B, dtype=torch.float32, device=logits.device) if b is None or b.rows is not None else None
    if b is None:
        tokens = logits.argmax(-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1), proc
    tokens = logits.argmax(-1) if b.rows is not None else None
    scaled = logits if b.rows is None else logits[b.rows]
    if b.tempered:
        scaled = scaled / b.temperature[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if b.truncate:  # top-k / top-p / min-p in sorted order, then back to vocabulary order
        srt, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=logits.device)[None, :]
        k = torch.where(b.top_k > 0, b.top_k, V)
        kept = srt * (ranks < k[:, None])
        kept = kept / kept.sum(-1, keepdim=True)
        before = kept.cumsum(-1) - kept  # mass of the more likely tokens
        kept = kept * ((before < b.top_p[:, None]) | (b.top_p[:, None] >= 1.0))
        kept = kept * (srt >= b.min_p[:, None] * srt[:, :1])  # srt[:, :1]: the top probability
        truncating = (b.top_k > 0) | (b.top_p < 1.0) | (b.min_p > 0.0)
        # rows without a warper keep their probabilities bit for bit, so a row's draw never
        # depends on which other rows share the batch
        probs = torch.where(truncating[:, None], torch.zeros_like(probs).scatter_(1, order, kept), probs)
    # inverse CDF in vocabulary order for every row (the same uniform -> the same token)
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    choice = torch.searchsorted(cdf, (b.uniform * total).unsqueeze(-1), right=True).squeeze(-1)
    choice = choice.clamp_(max=V - 1)
    if b.rows is None:
        tokens = choice
    else:
        tokens[b.rows] = choice
    if b.sampling_logprobs:
        chosen = (probs.gather(1, choice[:, None]).squeeze(1).double() / total).log().float()
        if b.rows is None:
            proc = chosen
        else:
            proc[b.rows] = chosen
    else:
        proc = None
    raw = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, raw, proc
