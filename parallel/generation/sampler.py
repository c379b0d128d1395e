"""Batched token sampling with one uniform number per sampled row.

Why inverse-CDF sampling with a per-request uniform (instead of
``torch.multinomial``): a request's draws come from its own seeded stream, so
its output depends on its seed alone, not on which other requests share the
batch, and one uniform per token is far cheaper than per-row generators.

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

__all__ = ["SampleBatch", "sample"]


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


def sample(logits: torch.Tensor, b: Optional[SampleBatch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` fp32 -> (tokens [B], raw logprobs [B], sampling logprobs [B]).

    ``b=None``: every row is greedy.  Raw logprobs are of the unmodified
    distribution; sampling logprobs of the distribution the token was drawn
    from (0 for greedy rows).
    """
    B, V = logits.shape
    logp = torch.log_softmax(logits, dim=-1)
    proc = torch.zeros(B, dtype=torch.float32, device=logits.device)
    if b is None:
        tokens = logits.argmax(-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1), proc
    tokens = logits.argmax(-1) if b.rows is not None else None
    scaled = (logits if b.rows is None else logits[b.rows]) / b.temperature[:, None]
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
    chosen_p = probs.gather(1, choice[:, None]).squeeze(1).double() / total
    tok = choice
    if b.rows is None:
        tokens, proc = tok, chosen_p.log().float()
    else:
        tokens[b.rows] = tok
        proc[b.rows] = chosen_p.log().float()
    raw = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, raw, proc
