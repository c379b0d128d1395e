"""Core attention for megatron's local layer spec via torch's scaled_dot_product_attention.

megatron's local ``DotProductAttention`` materialises the [b, np, s, s] scores
(baddbmm into a global buffer, masked_fill, softmax, copies); on CPU that costs
about a quarter of a small model's train step.  This module is a drop-in
replacement (same constructor and forward contract, plugged into the layer spec
as ``core_attention``) that calls ``F.scaled_dot_product_attention``, which uses
a fused flash-style kernel on CPU and GPU.  Causal self-attention only.

Packed (THD) micro-batches (:mod:`parallel.packed_batch`, ``packed_seq_params`` with
``qkv_format="thd"``): q/k/v arrive as ``[t, heads, hn]`` of several sequences back to back, and
each sequence attends causally within itself.  This runs one causal SDPA per ``cu_seqlens``
segment: exactly the computation of that sequence's row in the padded path (a right-padded row
under a causal mask never sees its padding), at ``sum(len_i^2)`` cost; a block-diagonal mask
over the whole row would cost ``t^2`` memory and flops, and re-padding q/k/v to ``[n_seq, L]``
would bring back the padding this path removes.  The loop is one kernel call per sequence and
layer (micro-seconds each).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from parallel.cpu_compat import import_megatron_core

import_megatron_core()  # before megatron's own imports: the fast path on CPU hosts
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402

__all__ = ["SDPACoreAttention"]


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
        parts = [self._shared(q, k, v, trees[i], attn_mask_type) if i < len(trees) and trees[i] else
                 self._sbhd(q[:, None], k[:, None], v[:, None], None, attn_mask_type)
                 for i, (q, k, v) in enumerate(zip(query.split(segs), key.split(segs), value.split(segs)))]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(t, nq * hn)

    def _shared(self, query: Tensor, key: Tensor, value: Tensor, tree: tuple[int, ...],
                attn_mask_type: Optional[AttnMaskType]) -> Tensor:
        """One shared-prefix segment ``[P | R_1 | ... | R_n]`` (:mod:`parallel.shared_prefix`): P
        causal within itself; each R_i attends to all of P and causally to itself (P's keys and
        values are computed once and read by every branch)."""
        from parallel.shared_prefix import tree_mask

        p, *rest = tree
        parts = []
        if p:
            parts.append(self._sbhd(query[:p, None], key[:p, None], value[:p, None], None, attn_mask_type))
        at = p
        for r, masked in zip(rest, tree_mask(tree, query.device)):
            if r == 0:
                continue
            k = torch.cat([key[:p], key[at:at + r]])[:, None]
            v = torch.cat([value[:p], value[at:at + r]])[:, None]
            parts.append(self._sbhd(query[at:at + r, None], k, v, masked[None, None], attn_mask_type))
            at += r
        return torch.cat(parts)

    def _sbhd(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
              attn_mask_type: Optional[AttnMaskType]) -> Tensor:
        sq, b, nq, hn = query.shape
        nk = key.shape[2]
        # [s, b, n, h] -> [b, n, s, h]; kv heads are shared by nq // nk consecutive query heads
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if nq != nk:
            k = k.repeat_interleave(nq // nk, dim=1)
            v = v.repeat_interleave(nq // nk, dim=1)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None and sq > 1
        mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=causal, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * hn)
