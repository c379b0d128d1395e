"""Per-token outputs of the last pipeline stage, computed vocab-parallel over tp.

With tensor parallelism the LM head leaves logits split along the vocabulary:
tp rank ``r`` holds columns ``[r * Vp/tp, (r + 1) * Vp/tp)`` of the padded vocab
``Vp``.  Gathering full ``[tokens, vocab]`` logits costs ``tp`` times the memory
and traffic of what a loss needs, so log-probs, entropy and argmax are computed
here on the shards with a distributed log-sum-exp (three small all-reduces of
``[tokens]`` vectors over the tp group).

Autograd convention (megatron's): the loss is computed identically on every tp
rank, so a reduction's backward is the identity on each rank
(``reduce_from_tensor_model_parallel_region``), and the gradient each rank
back-propagates into its own vocab shard is exactly the shard of the full
gradient.  Padded vocab columns (``>= vocab_size``) are masked to ``-inf`` so they
never enter a softmax.

:class:`TokenOutputs` is what a ``train_batch`` loss callback receives.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["TokenOutputs", "vocab_parallel_logprobs", "vocab_parallel_argmax"]


def _tp_size(group: Any) -> int:
    return 1 if group is None else group.size()


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce sum over tp; backward is the identity (replicated loss)."""
    if _tp_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def _masked_shard(logits: torch.Tensor, vocab_start: int, vocab_size: int,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits / temperature with padded vocab columns at -inf; and that pad mask."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    cols = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
    pad = cols >= vocab_size
    if bool(pad.any()):
        z = z.masked_fill(pad, float("-inf"))
    return z, pad


def vocab_parallel_logprobs(logits: torch.Tensor, targets: Optional[torch.Tensor], group: Any,
                            vocab_start: int, vocab_size: int, *, temperature: float = 1.0,
                            entropy: bool = False
                            ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(log p(targets), entropy)`` per row of vocab-sharded ``logits [N, V/tp]``.

    Differentiable; either output may be skipped (``targets=None`` / ``entropy=False``).
    Every tp rank gets the same values.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if targets is not None and not entropy:  # the training loss's path: one [N, V/tp] tensor kept
        return _VocabParallelLogProb.apply(logits, targets, group, vocab_start, vocab_size, temperature), None
    z, pad = _masked_shard(logits, vocab_start, vocab_size, temperature)
    m = z.detach().max(-1).values
    if _tp_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    zs = z - m.unsqueeze(-1)  # the shift is a constant: gradients are unchanged
    e = zs.exp()  # 0 on padded columns
    s = _sum(e.sum(-1), group)
    log_s = s.log()
    logp = ent = None
    if targets is not None:
        n_local = z.shape[-1]
        local = targets.to(z.device) - vocab_start
        mine = (local >= 0) & (local < n_local)
        picked = zs.gather(-1, local.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        logp = _sum(picked, group) - log_s
    if entropy:
        # H = log S - E_p[zs]; padded columns contribute 0 (e = 0, zs set to 0)
        zs_safe = zs.masked_fill(pad, 0.0) if bool(pad.any()) else zs
        ent = log_s - _sum((e * zs_safe).sum(-1), group) / s
    return logp, ent


class _VocabParallelLogProb(torch.autograd.Function):
    """``log p(target)`` per row of vocab-sharded logits, keeping ONE ``[N, V/tp]`` fp32 tensor.

    Why not autograd over the ops above: it keeps ``exp(z)`` for the backward and the backward
    allocates three more tensors of the logits' size (the broadcast gradient, its product, the
    gather's scatter): at a vocabulary of 8k-150k this is the largest activation of a train step,
    and what recompute cannot drop. Here the forward turns one copy of the logits into the
    softmax in place and keeps it; the backward turns it into the gradient in place,
    ``g * (onehot(target) - p) / temperature`` (megatron's vocab-parallel cross entropy does the
    same). Each tp rank's gradient is its shard of the full gradient, as before.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Any, vocab_start: int,
                vocab_size: int, temperature: float) -> torch.Tensor:
        z = logits.float()
        z = z / temperature if temperature != 1.0 else (z.clone() if z is logits else z)
        n_local = z.shape[-1]
        pad = torch.arange(vocab_start, vocab_start + n_local, device=z.device) >= vocab_size
        if bool(pad.any()):
            z.masked_fill_(pad, float("-inf"))
        m = z.max(-1).values
        if _tp_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z.sub_(m.unsqueeze(-1))
        local = targets.to(z.device) - vocab_start
        mine = (local >= 0) & (local < n_local)
        local = local.clamp(0, n_local - 1)
        picked = torch.where(mine, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros((), device=z.device))
        p = z.exp_()
        s = p.sum(-1)
        if _tp_size(group) > 1:
            both = torch.stack([picked, s])
            dist.all_reduce(both, group=group)
            picked, s = both[0], both[1]
        p.div_(s.unsqueeze(-1))  # this rank's columns of the softmax
        ctx.save_for_backward(p, local, mine)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return picked - s.log()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        p, local, mine = ctx.saved_tensors
        g = grad.float()
        out = p.mul_(-g.unsqueeze(-1))
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, local] += torch.where(mine, g, torch.zeros((), device=g.device))
        if ctx.temperature != 1.0:
            out.div_(ctx.temperature)
        return out.to(ctx.dtype), None, None, None, None, None


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, group: Any, vocab_start: int,
                          vocab_size: int) -> torch.Tensor:
    """Global argmax (HF vocab ids) per row of vocab-sharded ``logits [N, V/tp]``.

    Ties resolve to the lowest id, like ``torch.argmax`` on the full row.
    """
    z, _ = _masked_shard(logits, vocab_start, vocab_size, 1.0)
    best, idx = z.max(-1)
    idx = idx + vocab_start
    tp = _tp_size(group)
    if tp == 1:
        return idx
    bests = [torch.empty_like(best) for _ in range(tp)]
    idxs = [torch.empty_like(idx) for _ in range(tp)]
    dist.all_gather(bests, best.contiguous(), group=group)
    dist.all_gather(idxs, idx.contiguous(), group=group)
    b, i = torch.stack(bests, -1), torch.stack(idxs, -1)
    # first rank holding the maximum = lowest vocab id among ties across shards
    winner = (b == b.max(-1, keepdim=True).values).float().argmax(-1)
    return i.gather(-1, winner.unsqueeze(-1)).squeeze(-1)


class TokenOutputs:
    """The model's outputs for the real (non-padding) tokens of one micro-batch.

    Rows are in packed order (sequence after sequence), ``n_tokens`` of them.
    Everything is differentiable unless noted, and collective over the tp group:
    every tp rank of the last pipeline stage must make the same calls (which a
    deterministic loss function does by construction).

    * LM: :meth:`logprobs`, :meth:`entropy`, :meth:`logprobs_and_entropy`,
      :meth:`argmax` (no grad) work on vocab shards; :meth:`logits` gathers the
      full ``[n_tokens, vocab_size]`` logits (tp times the memory: avoid in losses).
    * critic: :meth:`values` -> ``[n_tokens]``.
    """

    def __init__(self, raw: torch.Tensor, valid: torch.Tensor, tp_group: Any, vocab_start: int,
                 vocab_size: int, critic: bool) -> None:
        # [T, V/tp] logits or [T, 1] values (no copy when every row is a real token)
        self._raw = raw.reshape(-1, raw.shape[-1]) if bool(valid.all()) and valid.numel() * raw.shape[-1] == \
            raw.numel() else raw[valid]
        self._group = tp_group
        self._start = vocab_start
        self._vocab = vocab_size
        self.critic = critic

    @property
    def n_tokens(self) -> int:
        return int(self._raw.shape[0])

    def _lm(self, what: str) -> None:
        if self.critic:
            raise TypeError(f"TokenOutputs.{what}() on a critic model (use values())")

    def logprobs(self, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log p(targets[t] | prefix up to t)`` per token, fp32 ``[n_tokens]``."""
        self._lm("logprobs")
        self._check_targets(targets)
        return vocab_parallel_logprobs(self._raw, targets, self._group, self._start, self._vocab,
                                       temperature=temperature)[0]

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of the next-token distribution per token, fp32 ``[n_tokens]``."""
        self._lm("entropy")
        return vocab_parallel_logprobs(self._raw, None, self._group, self._start, self._vocab,
                                       temperature=temperature, entropy=True)[1]

    def logprobs_and_entropy(self, targets: torch.Tensor, temperature: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both at the cost of one distributed log-sum-exp."""
        self._lm("logprobs_and_entropy")
        self._check_targets(targets)
        lp, ent = vocab_parallel_logprobs(self._raw, targets, self._group, self._start,
                                          self._vocab, temperature=temperature, entropy=True)
        return lp, ent

    def argmax(self) -> torch.Tensor:
        """Greedy next token per position (HF vocab ids, int64, no grad)."""
        self._lm("argmax")
        return vocab_parallel_argmax(self._raw, self._group, self._start, self._vocab)

    def logits(self) -> torch.Tensor:
        """Full fp32 logits ``[n_tokens, vocab_size]`` (gathered over tp)."""
        self._lm("logits")
        z = self._raw
        if _tp_size(self._group) > 1:
            from megatron.core.tensor_parallel.mappings import (
                gather_from_tensor_model_parallel_region,
            )

            z = gather_from_tensor_model_parallel_region(z, group=self._group)
        return z[:, : self._vocab].float()

    def values(self) -> torch.Tensor:
        """Critic values per token, fp32 ``[n_tokens]``."""
        if not self.critic:
            raise TypeError("TokenOutputs.values() on an LM (built without critic=True)")
        return self._raw[:, 0].float()

    def _check_targets(self, targets: torch.Tensor) -> None:
        if targets.shape != (self.n_tokens,):
            raise ValueError(f"targets must have shape [{self.n_tokens}] (one per token), got "
                             f"{list(targets.shape)}")
