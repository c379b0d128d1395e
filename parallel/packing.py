"""Packed variable-length sequences <-> right-padded [B, S] batches.

realflow moves sequences packed (one 1-D tensor + lengths).  Megatron's local
attention on CPU has no packed (THD) support, so without our SDPA attention's pad-free path
(:mod:`parallel.packed_batch`) each micro-batch is padded to
[B, S] and run with a causal mask: with right padding a real token never
attends to a pad (pads come after it), so the result is exact.  Outputs are
unpacked back to [total_tokens, ...] in the original order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["PaddedBatch", "pad_packed", "unpad", "split_by_token_budget", "check_packed", "sequence_ends"]


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [B, S] int64, right padded
    position_ids: torch.Tensor  # [B, S] int64, 0..len-1 then 0 on pads
    valid: torch.Tensor  # [B, S] bool, True on real tokens
    packed: Optional[Any] = None  # pad-free rows ([1, T]): megatron's PackedSeqParams (parallel/packed_batch.py)
    # a shared-prefix row (parallel/shared_prefix.py): [micro-batch tokens] -> the row position each reads
    expand: Optional[torch.Tensor] = None


def check_packed(input_ids: torch.Tensor, seqlens: list[int], what: str = "input_ids") -> None:
    """One-line errors for malformed packed inputs."""
    if input_ids.dim() != 1:
        raise ValueError(f"{what} must be 1-D packed tokens, got shape {list(input_ids.shape)}")
    if any(int(n) <= 0 for n in seqlens):
        raise ValueError(f"seqlens must be positive, got {list(seqlens)}")
    if sum(int(n) for n in seqlens) != input_ids.numel():
        raise ValueError(f"sum(seqlens)={sum(seqlens)} != {what}.numel()={input_ids.numel()}")


def pad_packed(input_ids: torch.Tensor, seqlens: list[int], pad_id: int = 0, *,
               seq_len: Optional[int] = None, batch: Optional[int] = None) -> PaddedBatch:
    """[T] packed tokens -> right-padded [B, S] batch.

    ``B``/``S`` default to ``len(seqlens)`` / ``max(seqlens)``.  Pipeline stages
    exchange activations of ONE fixed shape per schedule, so the engine may ask
    for a larger common ``[batch, seq_len]``: extra rows are all padding (their
    outputs are dropped), extra columns are right padding.
    """
    lens = torch.as_tensor(seqlens, dtype=torch.long)
    b, s = len(seqlens), int(lens.max())
    if seq_len is not None:
        if seq_len < s:
            raise ValueError(f"pad_packed: seq_len={seq_len} < longest sequence {s}")
        s = seq_len
    if batch is not None:
        if batch < b:
            raise ValueError(f"pad_packed: batch={batch} < number of sequences {b}")
        lens = torch.cat([lens, lens.new_zeros(batch - b)])
        b = batch
    ar = torch.arange(s).unsqueeze(0)
    valid = ar < lens.unsqueeze(1)
    ids = torch.full((b, s), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    valid = valid.to(input_ids.device)
    ids[valid] = input_ids
    pos = torch.where(valid, ar.to(input_ids.device), torch.zeros_like(ar).to(input_ids.device))
    return PaddedBatch(ids, pos, valid)


def sequence_ends(pb: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` of every sequence's last token in ``pb``: one per non-empty row when
    padded; the end of every segment of the row when pad-free (the filler's end included: it is
    not a real token, so whatever marks it is masked anyway)."""
    if pb.packed is not None:
        ends = pb.packed.cu_seqlens_q[1:].to(device=pb.valid.device, dtype=torch.long) - 1
        return torch.zeros_like(ends), ends
    lengths = pb.valid.sum(1)
    rows = torch.nonzero(lengths > 0).flatten()
    return rows, lengths[rows] - 1


def unpad(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> [T, ...] keeping real tokens in packed order."""
    return x[valid]


def split_by_token_budget(seqlens: list[int], max_tokens: Optional[int]) -> list[tuple[int, int]]:
    """Greedy contiguous split of sequences into [start, end) runs under a token budget.

    A sequence longer than the budget gets a micro-batch of its own.
    """
    if not seqlens:
        return []
    if max_tokens is None:
        return [(0, len(seqlens))]
    out, start, acc = [], 0, 0
    for i, n in enumerate(seqlens):
        if i > start and acc + n > max_tokens:
            out.append((start, i))
            start, acc = i, 0
        acc += n
    out.append((start, len(seqlens)))
    return out
