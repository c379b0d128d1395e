"""Batched token sampling with one uniform number per sampled row.

Why inverse-CDF sampling with a per-request uniform (instead of
``torch.multinomial``): a request's draws come from its own seeded stream, so
its output depends on its seed alone, not on which other requests share the
batch, and one uniform per token is far cheaper than per-row generators.

Order of the warpers (as transformers): temperature, then top-k, then top-p on
the renormalised top-k distribution (the most likely token is always kept).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SampleBatch", "sample"]


@dataclass
class SampleBatch:
    """Per-row settings of one step (lists of length B)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    uniform: list[float]  # one draw in [0, 1) per row (ignored for greedy rows)


def sample(logits: torch.Tensor, b: SampleBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` fp32 -> (tokens [B], raw logprobs [B], sampling logprobs [B]).

    Raw logprobs are of the unmodified distribution; sampling logprobs of the
    distribution the token was drawn from (0 for greedy rows).
    """
    B, V = logits.shape
    logp = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1)
    proc = torch.zeros(B, dtype=torch.float32, device=logits.device)
    rows = [i for i in range(B) if b.temperature[i] > 0.0 and b.top_k[i] != 1]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([b.temperature[i] for i in rows], device=logits.device)
        u = torch.tensor([b.uniform[i] for i in rows], device=logits.device, dtype=torch.float64)
        scaled = logits[idx] / temp[:, None]
        ks = [b.top_k[i] for i in rows]
        ps = [b.top_p[i] for i in rows]
        if any(k > 0 for k in ks) or any(p < 1.0 for p in ps):
            scaled, order = scaled.sort(dim=-1, descending=True)
        else:
            order = None
        probs = torch.softmax(scaled, dim=-1)
        if order is not None:
            if any(k > 0 for k in ks):
                kk = torch.tensor([k if k > 0 else V for k in ks], device=logits.device)
                probs = probs * (torch.arange(V, device=logits.device)[None, :] < kk[:, None])
                probs = probs / probs.sum(-1, keepdim=True)
            if any(p < 1.0 for p in ps):
                pp = torch.tensor(ps, device=logits.device)
                before = probs.cumsum(-1) - probs  # mass of the more likely tokens
                probs = probs * (before < pp[:, None])
        cdf = probs.double().cumsum(-1)
        total = cdf[:, -1]
        choice = torch.searchsorted(cdf, (u * total).unsqueeze(-1), right=True).squeeze(-1)
        choice = choice.clamp_(max=V - 1)
        chosen_p = probs.gather(1, choice[:, None]).squeeze(1).double() / total
        tok = choice if order is None else order.gather(1, choice[:, None]).squeeze(1)
        tokens[idx] = tok
        proc[idx] = chosen_p.log().float()
    raw = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, raw, proc
