"""Packed micro-batches through megatron's forward(-backward) schedules, any (tp, pp).

Pipeline stages exchange activations point to point with ONE fixed shape per
schedule (megatron's ``tensor_shape = (seq_length, micro_batch_size, hidden)``),
so with pp > 1 every micro-batch is right-padded to the common ``[B, S]`` of the
step: ``S`` = the longest sequence, ``B`` = the most sequences in a micro-batch.
With pp == 1 each micro-batch keeps its own ``[b, s]`` (no p2p, less compute).
Under sequence parallelism (tp > 1) ``S`` is rounded up to a multiple of tp,
since activations between tp regions are split along the sequence.

Pad-free (``pad_free=True``, :mod:`parallel.packed_batch`): each micro-batch is instead one
``[1, T]`` row of its concatenated sequences (megatron's THD form); the padding left is a filler
at the end of the row, to a multiple of tp under sequence parallelism and to the step's largest
``T`` when pp > 1.  :attr:`ScheduleRunner.computed_tokens` counts the rows' tokens either way.

Every rank of a dp replica (all its tp and pp ranks) must pass the SAME
micro-batches: the first stage embeds the tokens, the last one computes the
outputs/loss, the middle ones only need the shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel.groups import ModelGroups
from parallel.flops import causal_pairs, row_pairs
from parallel.packed_batch import pack_micro_batch, pad_free_batches
from parallel.rotary import explicit_rotary_positions, positioned_ropes
from parallel.shared_prefix import MIN_SHARED_PREFIX, plan_shared
from parallel.packing import PaddedBatch, check_packed, pad_packed, split_by_token_budget

__all__ = ["MicroBatch", "split_packed", "next_token_targets", "ScheduleRunner",
           "share_from_last_stage"]

# callback(mb, valid, output, non_loss_data) on the last stage
OutputCallback = Callable[["MicroBatch", torch.Tensor, torch.Tensor], Any]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [T] packed
    seqlens: list[int]
    extra: Any = None
    routes: Optional[torch.Tensor] = None  # MoE routing replay: [T, layers, k] experts (-1: none)
    images: Optional[list[Any]] = None  # VL models: each sequence's ImageInputs (or None), in order


def split_packed(input_ids: torch.Tensor, seqlens: list[int],
                 max_tokens: Optional[int], routes: Optional[torch.Tensor] = None,
                 images: Optional[list[Any]] = None) -> list[MicroBatch]:
    """Checked packed batch -> contiguous micro-batches under a token budget (``routes``, packed
    like ``input_ids``, and ``images``, one entry per sequence, split the same way)."""
    seqlens = [int(n) for n in seqlens]
    check_packed(input_ids, seqlens)
    offs = [0]
    for n in seqlens:
        offs.append(offs[-1] + n)
    if images is not None and len(images) != len(seqlens):
        raise ValueError(f"images: {len(images)} entries for {len(seqlens)} sequences (one per sequence, None: none)")
    return [MicroBatch(input_ids[offs[a]:offs[b]], seqlens[a:b],
                       routes=None if routes is None else routes[offs[a]:offs[b]],
                       images=None if images is None else list(images[a:b]))
            for a, b in split_by_token_budget(seqlens, max_tokens)]


def next_token_targets(ids: torch.Tensor, seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``targets[t] = ids[t + 1]`` within each sequence; ``valid`` False (target 0) at ends."""
    targets = torch.roll(ids, -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[torch.tensor(seqlens, dtype=torch.long).cumsum(0) - 1] = False
    return torch.where(valid, targets, torch.zeros_like(targets)), valid


def share_from_last_stage(groups: ModelGroups, payload: Optional[dict]) -> dict:
    """The last stage's JSON-able ``payload``, on every stage of this rank's pipeline.

    Broadcast over the pp group as UTF-8 JSON bytes (length first): no pickle.
    """
    if groups.strategy.pp == 1:
        assert payload is not None
        return payload
    src = groups.rank_at(dp=groups.dp_rank, tp=groups.tp_rank, pp=groups.strategy.pp - 1)
    data = json.dumps(payload).encode() if groups.is_last_stage else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, src=src, group=groups.pp_group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=groups.pp_group)
    return json.loads(bytes(buf.tolist()).decode()) if not groups.is_last_stage else payload


class ScheduleRunner:
    """Runs micro-batches through megatron's schedule for one model's groups."""

    def __init__(self, groups: ModelGroups, config: Any, moe: Optional[Any] = None,
                 vision: Optional[Any] = None, pad_free: bool = False, shared_prefix: str = "off") -> None:
        """``moe``: the model's :class:`parallel.moe_step.MoEStep` (routing inputs in, aux loss and
        statistics out, around each micro-batch's forward); None for a dense model. ``vision``: a
        VL model's :class:`parallel.vision_step.VisionStep` (M-RoPE positions, image features).
        ``pad_free``: run micro-batches as concatenated rows (module docstring; the caller checked
        the model supports it, :func:`parallel.packed_batch.resolve_pad_free`). ``shared_prefix``:
        ``off``, ``auto`` (pad-free rows share the common prefixes of consecutive sequences,
        :mod:`parallel.shared_prefix`) or ``on`` (the same; a batch with nothing to share is an
        error)."""
        self.pad_free = bool(pad_free)
        self.shared_prefix = shared_prefix if self.pad_free else "off"
        self._ropes: Optional[tuple[int, list]] = None  # (id of the model, its positioned RoPE modules)
        self.computed_tokens = 0  # token rows the last run() computed (real + padding), this replica
        self.computed_pairs = 0  # causal (query, key) pairs its attention computed (parallel/flops.py)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.groups = groups
        self.config = config
        self.moe = moe
        self.vision = vision
        pp = groups.strategy.pp
        self._fwd_bwd = get_forward_backward_func(pp_size=pp, vp_size=None)
        self._p2p = None
        if pp > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self._p2p = P2PCommunicator(pp_group=groups.pp_group, config=config)

    def _pad(self, mbs: list[MicroBatch], device: torch.device) -> tuple[list[PaddedBatch], int, int]:
        tp = self.groups.strategy.tp
        multiple = tp if self.config.sequence_parallel else 1

        def round_up(n: int) -> int:
            return -(-n // multiple) * multiple

        common = self.groups.strategy.pp > 1
        s_all = round_up(max(max(mb.seqlens) for mb in mbs))
        b_all = max(len(mb.seqlens) for mb in mbs)
        padded = []
        for mb in mbs:
            s = s_all if common else round_up(max(mb.seqlens))
            b = b_all if common else len(mb.seqlens)
            padded.append(pad_packed(mb.input_ids.to(device), mb.seqlens, seq_len=s, batch=b))
        return padded, s_all, b_all

    def _pack(self, mbs: list[MicroBatch], device: torch.device) -> tuple[list[PaddedBatch], int, int]:
        multiple = self.groups.strategy.tp if self.config.sequence_parallel else 1
        plans = [None] * len(mbs)
        if self.shared_prefix != "off":
            plans = [plan_shared(mb.input_ids, mb.seqlens) for mb in mbs]
            if self.shared_prefix == "on" and not any(p.shares for p in plans):
                raise ValueError(f"training.shared_prefix=on, but no two consecutive sequences of this batch "
                                 f"share their first {MIN_SHARED_PREFIX} tokens (no sample groups): use "
                                 f"training.shared_prefix=auto or off")
        counts = [p.computed if p is not None else sum(mb.seqlens) for p, mb in zip(plans, mbs)]
        totals, seq = pad_free_batches(counts, multiple, common=self.groups.strategy.pp > 1)
        return [pack_micro_batch(mb.input_ids.to(device), mb.seqlens, n, p)
                for mb, n, p in zip(mbs, totals, plans)], seq, 1

    def run(self, model: torch.nn.Module, mbs: list[MicroBatch], on_output: OutputCallback,
            forward_only: bool, device: torch.device,
            aux_scale_of: Optional[Callable[[int], float]] = None) -> list[Any]:
        """Schedule ``mbs``; ``on_output(mb, valid, output, non_loss_data)`` runs on the
        last stage per micro-batch: forward-only -> its return values are collected
        (returned in order on the last stage, ``[]`` elsewhere); training -> it must
        return ``(loss, {})`` and the schedule back-propagates ``loss / len(mbs)``.
        ``aux_scale_of(i)``: micro-batch i's weight in the objective (an MoE model's
        load-balancing loss is added with it; see :mod:`parallel.moe_step`)."""
        padded, seq, mbsz = (self._pack if self.pad_free else self._pad)(mbs, device)
        self.computed_tokens = sum(pb.input_ids.numel() for pb in padded)
        self.computed_pairs = sum(
            row_pairs(pb.packed.segments, pb.packed.trees) if pb.packed is not None
            else pb.input_ids.shape[0] * causal_pairs(pb.input_ids.shape[1]) for pb in padded)
        items = iter(list(zip(mbs, padded)))
        moe = self.moe
        if moe is not None:
            moe.start(None if forward_only else aux_scale_of)

        def step(data_iter: Any, model_: torch.nn.Module):
            mb, pb = next(data_iter)
            if moe is not None:
                moe.before(pb, mb.routes, training=not forward_only)
            if self.vision is not None:
                out = self.vision.forward(model_, pb, mb.images)
            else:
                # causal mask built by megatron (pad-free: per sequence, from packed_seq_params);
                # a shared-prefix row rotates by its own positions (parallel/rotary.py)
                positions = getattr(pb.packed, "positions", None)
                with explicit_rotary_positions(self._positioned_ropes(model_), positions):
                    out = model_(pb.input_ids, pb.position_ids, None, packed_seq_params=pb.packed)
            if moe is not None:
                out = moe.after(out, training=not forward_only)
            return out, partial(self._call, on_output, mb, pb)

        kw: dict[str, Any] = {}
        if self._p2p is not None:
            kw["p2p_communicator"] = self._p2p
        return self._fwd_bwd(
            forward_step_func=step,
            data_iterator=items,
            model=[model],
            num_microbatches=len(mbs),
            seq_length=seq,
            micro_batch_size=mbsz,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
            pg_collection=self.groups.pg_collection,
            **kw,
        )

    def _positioned_ropes(self, model: torch.nn.Module) -> list:
        if self._ropes is None or self._ropes[0] != id(model):
            self._ropes = (id(model), positioned_ropes(model))
        return self._ropes[1]

    @staticmethod
    def _call(on_output: OutputCallback, mb: MicroBatch, pb: PaddedBatch,
              output: torch.Tensor, non_loss_data: bool = False) -> Any:
        if pb.expand is None:
            return on_output(mb, pb.valid, output)
        # a shared-prefix row back in the micro-batch's own token order: sample i's prefix
        # tokens read the prefix's rows (whose gradients the gather's backward sums)
        expand = pb.expand.to(output.device)
        return on_output(mb, torch.ones(1, expand.numel(), dtype=torch.bool, device=output.device),
                         output[:, expand])
