"""Pad-free micro-batches: the sequences of a micro-batch concatenated, megatron's THD form.

The padded path (:mod:`parallel.packing`) right-pads every micro-batch to ``[B, S]``; every
linear layer, norm and the LM head then run on ``B * S`` rows of which only ``sum(seqlens)``
are real (about a fifth is padding on RL batches, whose lengths vary a lot). Here a
micro-batch is ONE row ``[1, T]`` of its concatenated tokens, with megatron's
:class:`PackedSeqParams` (``qkv_format="thd"``, ``cu_seqlens``) telling rotary embeddings to
restart at each sequence start and the core attention
(:class:`parallel.attention.SDPACoreAttention`) to attend within each sequence only.

Padding survives only where a shape is imposed: sequence parallelism splits the token axis
over tp (``T`` a multiple of tp), and pipeline stages exchange ONE activation shape per
schedule (every micro-batch of a pp > 1 step has the same ``T``). The filler goes at the END
as a dummy segment of its own (it attends to itself only; its outputs are dropped through the
``valid`` mask, the same contract as the padded path).

What the path needs from the model (:func:`resolve_pad_free`): our SDPA core attention (megatron's
local ``DotProductAttention`` refuses THD; TransformerEngine's would need its varlen kernels, not
tested here); those keep the padded path under ``auto``. MoE models run pad-free
(:mod:`parallel.moe_step` takes the row's sequence ends) unless an expert capacity drops tokens
(then which ones depends on the layout); vision-language models too (:mod:`parallel.vision_step`
lays out each segment's M-RoPE positions and image rows).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from parallel.packing import PaddedBatch
from parallel.shared_prefix import SharedPlan, shared_row
from realflow.api.model_options import PAD_FREE_MODES

__all__ = ["packed_seqs_type", "pack_micro_batch", "pad_free_batches", "resolve_pad_free", "PAD_FREE_MODES"]


@functools.lru_cache(maxsize=None)
def packed_seqs_type() -> type:
    """``PackedSeqs``: megatron's THD parameters plus the segment lengths as Python ints (read once
    per layer by the core attention: no device -> host sync per layer on a GPU). Defined on first
    use: importing megatron costs seconds, and the modules that import this one (the engine, the
    experiments' registrations) must stay cheap to import for the command line."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class PackedSeqs(PackedSeqParams):
        segments: tuple[int, ...] = field(default=())
        # per segment: () or, for a shared-prefix segment, (p, r_1, ..., r_n) (parallel/shared_prefix.py)
        trees: tuple[tuple[int, ...], ...] = field(default=())
        # [row tokens] explicit positions when a segment's do not restart at 0 per segment
        positions: Optional[torch.Tensor] = None

    return PackedSeqs


def pack_micro_batch(input_ids: torch.Tensor, seqlens: list[int], total: int,
                     shared: Optional[SharedPlan] = None) -> PaddedBatch:
    """``[T]`` packed tokens -> a ``[1, total]`` row: the sequences back to back, then a filler
    segment of ``total - T`` tokens (none when equal). ``valid`` is False on the filler only;
    positions restart at 0 at each segment start.

    ``shared`` (:mod:`parallel.shared_prefix`): the plan's groups become one segment each, their
    prefix once; the batch's ``expand`` maps the micro-batch's tokens to the row."""
    expand, trees, positions = None, (), None
    if shared is not None and shared.shares:
        input_ids, positions, seqlens, rows = shared_row(input_ids, shared)
        expand, trees = rows.expand.to(input_ids.device), rows.trees
    real = int(sum(seqlens))
    if total < real:
        raise ValueError(f"pack_micro_batch: total={total} < {real} tokens in the micro-batch")
    segs = [int(n) for n in seqlens] + ([total - real] if total > real else [])
    dev = input_ids.device
    ids = torch.zeros(1, total, dtype=input_ids.dtype, device=dev)
    ids[0, :real] = input_ids
    lens = torch.tensor(segs, dtype=torch.int32)
    cu = torch.zeros(len(segs) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    # built on the host, moved once: position = index - its segment's start
    pos = (torch.arange(total) - torch.repeat_interleave(cu[:-1].long(), lens.long()))[None]
    if positions is not None:
        pos[0, :real] = positions
        trees = tuple(trees) + (((),) if total > real else ())
    pos = pos.to(dev)
    valid = torch.zeros(1, total, dtype=torch.bool, device=dev)
    valid[0, :real] = True
    cu = cu.to(dev)
    longest = max(segs)
    params = packed_seqs_type()(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                    max_seqlen_kv=longest, segments=tuple(segs), trees=trees,
                                    positions=None if positions is None else pos[0])
    return PaddedBatch(ids, pos, valid, packed=params, expand=expand)


def pad_free_batches(token_counts: list[int], multiple: int, common: bool) -> tuple[list[int], int]:
    """The row length of each micro-batch and the schedule's ``seq_length``: its own token count
    rounded up to ``multiple`` (sequence parallelism), or with ``common`` (pp > 1) the largest one
    for all."""
    def round_up(n: int) -> int:
        return -(-n // multiple) * multiple

    longest = round_up(max(token_counts))
    totals = [longest if common else round_up(n) for n in token_counts]
    return totals, longest


def resolve_pad_free(mode: str, module: torch.nn.Module, *, moe: Optional[Any], vision: Optional[Any]) -> bool:
    """``training.pad_free`` -> whether this model's micro-batches run pad-free.

    ``auto``: pad-free where supported (see the module docstring), padded elsewhere; ``on`` where
    unsupported: a one-line ValueError naming the reason; ``off``: always padded.
    """
    if mode not in PAD_FREE_MODES:
        raise ValueError(f"training.pad_free={mode!r} must be one of {', '.join(PAD_FREE_MODES)}")
    if mode == "off":
        return False
    reason = unsupported_reason(module, moe=moe, vision=vision)
    if reason and mode == "on":
        raise ValueError(f"training.pad_free=on is not supported here: {reason}; "
                         f"use training.pad_free=auto (padded for this model) or off")
    return not reason


def unsupported_reason(module: torch.nn.Module, *, moe: Optional[Any], vision: Optional[Any]) -> str:
    """Why this model cannot run pad-free ('' when it can)."""
    from parallel.attention import SDPACoreAttention

    if moe is not None and getattr(module.config, "moe_expert_capacity_factor", None) is not None:
        return "an MoE model with an expert capacity (which tokens are dropped depends on the batch's layout)"
    cores = [m.core_attention for m in module.modules() if hasattr(m, "core_attention")]
    if any(not isinstance(c, SDPACoreAttention) for c in cores):
        kind = type(next(c for c in cores if not isinstance(c, SDPACoreAttention))).__name__
        return f"the core attention is {kind}, not SDPACoreAttention (build with attention='sdpa', without TE)"
    if getattr(module.config, "context_parallel_size", 1) != 1:
        return "context parallelism"
    return ""
