"""Core attention for megatron's local layer spec via torch's scaled_dot_product_attention.

megatron's local ``DotProductAttention`` materialises the [b, np, s, s] scores
(baddbmm into a global buffer, masked_fill, softmax, copies); on CPU that costs
about a quarter of a small model's train step.  This module is a drop-in
replacement (same constructor and forward contract, plugged into the layer spec
as ``core_attention``) that calls ``F.scaled_dot_product_attention``, which uses
a fused flash-style kernel on CPU and GPU.  Causal self-attention only; no
packed (THD) sequences - the same limits as the module it replaces.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

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
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences / attention bias")
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
