"""Core attention for megatron's local layer spec via torch's scaled_dot_product_attention.

megatron's local ``DotProductAttention`` materialises the [b, np, s, s] scores
(baddbmm into a global buffer, masked_fill, softmax, copies); on CPU that costs
about a quarter of a small model's train step.  This module is a drop-in
replacement (same constructor and forward contract, plugged into the layer spec
as ``core_attention``) that calls ``F.scaled_dot_product_attention``, which uses
a fused flash-style kernel on CPU and GPU.  Causal self-attention only.

Packed (THD) micro-batches (:mod:`parallel.packed_batch`, ``packed_seq_params`` with
``qkv_format="thd"``): q/k/v arrive as ``[t, heads, hn]`` of several sequences back to back, and
each sequence attends causally within itself (a shared-prefix segment, :mod:`parallel.shared_prefix`:
its prefix causally, each branch to the prefix and causally to itself).  The row is cut into
query blocks -- a plain segment, a shared segment's prefix, one of its branches -- each with its
keys (the prefix's, then its own).  One SDPA call per block, as a loop would make, costs a dozen
small ops per block and layer, forward and backward: on an RL batch of short sequences (hundreds
of blocks per row) that per-op overhead, not the maths, was most of the train step.  Instead
(:func:`row_attention_plan`, built once per row and shared by every layer) the blocks are
gathered into a few padded ``[n, heads, Lq, Lk]`` batches, blocks of similar size together, each
ONE SDPA call with a boolean mask (the block's own keys causal, the prefix's all visible, padding
never); the outputs are gathered back into row order.  A block-diagonal mask over the whole row
would cost ``t^2``; the buckets keep the padding within about 2x of the real ``(query, key)``
pairs plus a fixed allowance (:data:`BUCKET_SLACK_WORK`).  A long plain segment
(:data:`SOLO_TOKENS` tokens on) keeps a causal call of its own (no mask, half the pairs).
Masked query padding reads a real row and is dropped; padded keys are masked, so the values and
gradients are those of the per-block calls, up to float rounding.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from parallel.cpu_compat import import_megatron_core

import_megatron_core()  # before megatron's own imports: the fast path on CPU hosts
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402

__all__ = ["SDPACoreAttention", "row_attention_plan", "SOLO_TOKENS", "BUCKET_SLACK_WORK"]

#: a plain segment with this many tokens or more runs in a causal SDPA call of its own (no mask: the
#: kernel skips the masked half; short ones are batched, where the call overhead dominates)
SOLO_TOKENS = 128
#: padded (query, key) pairs x heads x head_dim a batched call may add beyond 2x its real pairs:
#: about what one more SDPA call (its gathers, mask, forward and backward) costs on a CPU core
BUCKET_SLACK_WORK = 1 << 20
#: a batched call's keys are padded to a multiple of this: torch's CPU attention (and softmax) runs
#: a scalar path over a row whose length is not a multiple of the vector width (16 fp32 lanes with
#: AVX-512): 4-5x slower at 15 keys than at 16
KEY_MULTIPLE = 16


@dataclass(frozen=True)
class _Bucket:
    """One SDPA call: ``n`` blocks padded to ``lq`` queries and ``lk`` keys, or (``solo``) one plain
    segment ``[start, start + lq)`` run causally on its own."""

    n: int
    lq: int
    lk: int
    solo: Optional[int] = None  # the segment's start when it runs alone
    q_index: Optional[torch.Tensor] = None  # [n * lq] row positions of the queries (padding: a real one)
    kv_index: Optional[torch.Tensor] = None  # [n * lk] row positions of the keys (padding: a real one)
    mask: Optional[torch.Tensor] = None  # [n, 1, lq, lk] bool, True = attends


@dataclass(frozen=True)
class RowPlan:
    """How a packed row's attention runs: the calls, and ``gather`` -- for each row token, its output
    among the calls' concatenated ``[n * lq]`` query rows (None: the calls' rows are the row)."""

    buckets: tuple[_Bucket, ...]
    gather: Optional[torch.Tensor]


def _blocks(segments: tuple[int, ...], trees: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int, int]]:
    """The row's query blocks ``(start, length, prefix start, prefix length)``: a plain segment (no
    prefix), a shared segment's prefix (causal, no prefix) and each of its branches (sees the prefix)."""
    out, at = [], 0
    for i, n in enumerate(segments):
        tree = trees[i] if i < len(trees) else ()
        if not tree:
            if n:
                out.append((at, n, 0, 0))
        else:
            p, *rest = tree
            if p:
                out.append((at, p, 0, 0))
            b = at + p
            for r in rest:
                if r:
                    out.append((b, r, at, p))
                b += r
        at += n
    return out


def _round_keys(n: int) -> int:
    return -(-n // KEY_MULTIPLE) * KEY_MULTIPLE


@functools.lru_cache(maxsize=8)  # every layer of a row's forward (and a recompute) asks for the same plan
def row_attention_plan(segments: tuple[int, ...], trees: tuple[tuple[int, ...], ...], device: torch.device,
                       head_work: int = 128, causal: bool = True) -> RowPlan:
    """The SDPA calls of a packed row (module docstring). ``head_work``: query heads x head dim (the
    cost of one (query, key) pair, to size :data:`BUCKET_SLACK_WORK` in pairs). ``causal=False``: a
    plain segment (or a prefix) sees all of itself (a branch of a shared segment is causal anyway)."""
    blocks = _blocks(segments, trees)
    solo = [b for b in blocks if b[3] == 0 and b[1] >= SOLO_TOKENS]
    rest = sorted((b for b in blocks if not (b[3] == 0 and b[1] >= SOLO_TOKENS)),
                  key=lambda b: (b[1] + b[3], b[1]), reverse=True)
    slack = max(BUCKET_SLACK_WORK // max(head_work, 1), 64)
    groups: list[list[tuple[int, int, int, int]]] = []
    mq = mk = real = 0
    for b in rest:
        q, k = b[1], b[1] + b[3]
        if groups:
            nq_, nk_ = max(mq, q), max(mk, k)
            if (len(groups[-1]) + 1) * nq_ * _round_keys(nk_) <= 2 * (real + q * k) + slack:
                groups[-1].append(b)
                mq, mk, real = nq_, nk_, real + q * k
                continue
        groups.append([b])
        mq, mk, real = q, k, q * k
    buckets: list[_Bucket] = [_Bucket(1, b[1], b[1], solo=b[0]) for b in solo]
    q_rows = [torch.arange(b[0], b[0] + b[1]) for b in solo]  # row position of each call output row
    for g in groups:
        start, qlen, pstart, plen = (torch.tensor(c) for c in zip(*g))
        n, lq, lk = len(g), int(qlen.max()), _round_keys(int((qlen + plen).max()))
        i, j = torch.arange(lq), torch.arange(lk)
        q_index = start[:, None] + torch.minimum(i[None], qlen[:, None] - 1)  # [n, lq]
        own = j[None] - plen[:, None]  # [n, lk]: key j's index among the block's own tokens (< 0: prefix)
        kv_index = torch.where(own < 0, pstart[:, None] + j[None], start[:, None] + own.clamp(min=0))
        kv_index = torch.minimum(kv_index, (start + qlen - 1)[:, None])  # padding: a real row (masked)
        own = own[:, None, :]
        seen = own <= i[None, :, None]
        if not causal:  # blocks without a prefix see all their own keys
            seen = seen | (plen == 0)[:, None, None]
        mask = (own < 0) | (seen & (own < qlen[:, None, None]))
        buckets.append(_Bucket(n, lq, lk, q_index=q_index.reshape(-1).to(device),
                               kv_index=kv_index.reshape(-1).to(device), mask=mask[:, None].to(device)))
        q_rows.append((start[:, None] + i[None]).masked_fill(i[None] >= qlen[:, None], -1).reshape(-1))
    rows = torch.cat(q_rows) if q_rows else torch.zeros(0, dtype=torch.long)
    total = sum(segments)
    real = rows >= 0
    gather = None
    if not (len(buckets) == 1 and buckets[0].solo == 0 and buckets[0].lq == total):
        gather = torch.empty(total, dtype=torch.long)
        gather[rows[real]] = torch.arange(len(rows))[real]
        gather = gather.to(device)
    return RowPlan(tuple(buckets), gather)


class SDPACoreAttention(MegatronModule):
    """[sq, b, np, hn] q / [sk, b, ng, hn] k, v -> [sq, b, np * hn] context."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention: context parallelism")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or config.window_size is not None:
            raise NotImplementedError("SDPACoreAttention: only vanilla softmax, no sliding window")
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            raise NotImplementedError("SDPACoreAttention: apply_query_key_layer_scaling")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params: Any = None) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention bias")
        if packed_seq_params is not None:
            return self._thd(query, key, value, attention_mask, attn_mask_type, packed_seq_params)
        return self._sbhd(query, key, value, attention_mask, attn_mask_type)

    def _thd(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
             attn_mask_type: Optional[AttnMaskType], params: Any) -> Tensor:
        """[t, np, hn] q / [t, ng, hn] k, v of back-to-back sequences -> [t, np * hn]."""
        if params.qkv_format != "thd" or attention_mask is not None:
            raise NotImplementedError(f"SDPACoreAttention: packed sequences need qkv_format='thd' and no "
                                      f"attention mask (got {params.qkv_format!r})")
        if (params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
                or params.cu_seqlens_q is not params.cu_seqlens_kv
                and not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv)):
            raise NotImplementedError("SDPACoreAttention: packed self-attention needs cu_seqlens_q == "
                                      "cu_seqlens_kv and no padded cu_seqlens")
        segs = list(getattr(params, "segments", ()) or ())
        if not segs:  # plain PackedSeqParams: one device -> host read
            cu = params.cu_seqlens_q
            segs = (cu[1:] - cu[:-1]).tolist()
        t, nq, hn = query.shape
        if sum(segs) != t:
            raise ValueError(f"SDPACoreAttention: cu_seqlens cover {sum(segs)} tokens, q has {t}")
        trees = tuple(getattr(params, "trees", ()) or ())
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        plan = row_attention_plan(tuple(segs), trees, query.device, nq * hn, causal)
        parts = [self._sbhd(query[b.solo:b.solo + b.lq, None], key[b.solo:b.solo + b.lq, None],
                            value[b.solo:b.solo + b.lq, None], None, attn_mask_type).reshape(b.lq, nq * hn)
                 if b.solo is not None else self._bucket(query, key, value, b) for b in plan.buckets]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if plan.gather is None else out.index_select(0, plan.gather)

    def _bucket(self, query: Tensor, key: Tensor, value: Tensor, b: _Bucket) -> Tensor:
        """One batched call: ``b.n`` blocks gathered to ``[n, heads, lq | lk, hn]`` -> ``[n * lq, np * hn]``."""
        _, nq, hn = query.shape
        nk = key.shape[1]
        q = query.index_select(0, b.q_index).view(b.n, b.lq, nq, hn).transpose(1, 2)
        k = key.index_select(0, b.kv_index).view(b.n, b.lk, nk, hn).transpose(1, 2)
        v = value.index_select(0, b.kv_index).view(b.n, b.lk, nk, hn).transpose(1, 2)
        out = self._sdpa(q, k, v, b.mask, False)
        return out.transpose(1, 2).reshape(b.n * b.lq, nq * hn)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool) -> Tensor:
        """``[b, n, s, h]`` q / ``[b, g, s, h]`` k, v (kv heads shared by ``n // g`` consecutive query heads)."""
        kw: dict[str, Any] = {}
        nq, nk = q.shape[1], k.shape[1]
        if nq != nk:
            if q.device.type == "cpu":  # the CPU kernel reads the shared kv heads in place (faster)
                kw["enable_gqa"] = True
            else:  # the GPU kernels that take a mask want as many kv heads as query heads
                k = k.repeat_interleave(nq // nk, dim=1)
                v = v.repeat_interleave(nq // nk, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                      scale=self.softmax_scale, **kw)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
                                              **kw)

    def _sbhd(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
              attn_mask_type: Optional[AttnMaskType]) -> Tensor:
        sq, b, nq, hn = query.shape
        nk = key.shape[2]
        # [s, b, n, h] -> [b, n, s, h]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None and sq > 1
        mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked
        out = self._sdpa(q, k, v, mask, causal)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * hn)
