"""The decoder forward with a KV cache, on one tp rank's megatron-layout weights.

Why not call megatron's GPTModel: its inference path (dynamic contexts, CUDA
graphs) is built for GPUs and costs far more Python per step than a tiny CPU
model's maths.  This module is the same computation written as a few dozen
torch ops per layer: the whole running batch goes through each op at once.

Exactness: every op mirrors transformers' Qwen2/Qwen3/Llama code in fp32
(RMSNorm in fp32, RoPE as ``q*cos + rotate_half(q)*sin`` with frequencies from
:func:`parallel.model_config.rope_inv_freq`), so greedy output equals
``generate(do_sample=False)``.

Tensor parallelism (megatron's layout): qkv and fc1 are column-parallel (this
rank's heads / ffn columns), proj and fc2 row-parallel followed by an
all-reduce over ``tp_group``; the embedding is vocab-parallel (masked lookup +
all-reduce) and the LM head's logits are all-gathered.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.generation.weights import DecoderWeights, ModelSpec
from parallel.model_config import rope_inv_freq

__all__ = ["KVCache", "Decoder"]


class KVCache:
    """Preallocated keys/values: ``[layers, slots, local kv heads, max_len, head_dim]``.

    Row ``i`` of the running batch always lives in slot ``i`` (the engine keeps
    the batch compact by moving the last row into a freed slot), so attention
    reads the plain view ``k[l, :B, :, :L]``: no gather, no reallocation.
    """

    def __init__(self, spec: ModelSpec, slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (spec.num_layers, slots, spec.local_groups, max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len
        # per-layer [slots * heads * max_len, head_dim] views for index_copy_ writes
        self.k_flat = [t.view(-1, spec.head_dim) for t in self.k]
        self.v_flat = [t.view(-1, spec.head_dim) for t in self.v]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)  # same maths, one kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Decoder:
    """Prefill (padded prompts) and decode (one token per row) against a :class:`KVCache`."""

    def __init__(self, weights: DecoderWeights, max_len: int,
                 tp_group: Optional[dist.ProcessGroup] = None) -> None:
        self.w = weights
        self.spec = s = weights.spec
        self.tp_group = tp_group
        self.rep = s.num_heads // s.num_groups
        self.scale = s.head_dim ** -0.5
        inv = rope_inv_freq(s.arch)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(weights.dtype).to(weights.device)  # [max_len, hd]
        self.sin = emb.sin().to(weights.dtype).to(weights.device)
        half = s.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), -1)
        self.vocab_lo = s.tp_rank * s.local_vocab

    # ------------------------------------------------------------- tp helpers

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.spec.tp_size == 1:
            return F.embedding(ids, self.w.embedding)
        local = ids - self.vocab_lo
        outside = (local < 0) | (local >= self.spec.local_vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.w.embedding)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self._all_reduce(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the HF vocab (padding rows cut) from final hidden states [N, h]."""
        h = _rms(h, self.w.final_norm, self.spec.eps)
        out = F.linear(h, self.w.output)
        if self.spec.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(self.spec.tp_size)]
            dist.all_gather(parts, out.contiguous(), group=self.tp_group)
            out = torch.cat(parts, -1)
        return out[..., : self.spec.arch.vocab_size].float()

    def _qkv(self, layer, x: torch.Tensor):
        """x [..., h] -> q [..., ng, rep, hd], k, v [..., ng, hd] (qk-norm applied)."""
        s = self.spec
        qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
        qkv = qkv.view(*x.shape[:-1], s.local_groups, self.rep + 2, s.head_dim)
        q, k, v = qkv[..., : self.rep, :], qkv[..., self.rep, :], qkv[..., self.rep + 1, :]
        if layer.q_norm is not None:
            q = _rms(q, layer.q_norm, s.eps)
            k = _rms(k, layer.k_norm, s.eps)
        return q, k, v

    def _mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        h = _rms(x, layer.ln2, self.spec.eps)
        gate, up = F.linear(h, layer.fc1_w).chunk(2, dim=-1)
        return self._all_reduce(F.linear(F.silu(gate) * up, layer.fc2_w))

    # ------------------------------------------------------------- forward

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lens: torch.Tensor, cache: KVCache, slot0: int) -> torch.Tensor:
        """Right-padded prompts ``ids [J, P]`` into slots ``slot0..slot0+J-1``.

        Right padding needs no mask beyond causality: a real token only attends
        to earlier positions, which are all real.  Returns logits [J, V] at each
        row's last real token.
        """
        s = self.spec
        J, P = ids.shape
        x = self._embed(ids)  # [J, P, h]
        cos = self.cos[:P].view(1, P, 1, 1, -1)
        sin = self.sin[:P].view(1, P, 1, 1, -1)
        for li, layer in enumerate(self.w.layers):
            h = _rms(x, layer.ln1, s.eps)
            q, k, v = self._qkv(layer, h)  # q [J, P, ng, rep, hd], k/v [J, P, ng, hd]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos[:, :, 0] + _rotate_half(k) * sin[:, :, 0]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [J, ng, P, hd]
            cache.k[li, slot0:slot0 + J, :, :P] = k
            cache.v[li, slot0:slot0 + J, :, :P] = v
            q = q.reshape(J, P, s.local_heads, s.head_dim).transpose(1, 2)  # [J, nh, P, hd]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.rep > 1)
            o = o.transpose(1, 2).reshape(J, P, s.local_heads * s.head_dim)
            x = x + self._all_reduce(F.linear(o, layer.proj_w))
            x = x + self._mlp(layer, x)
        last = x[torch.arange(J, device=x.device), lens - 1]
        return self.logits(last)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row (rows ``0..B-1`` = slots) at positions ``pos``; logits [B, V].

        Written for few ops per layer: RoPE is applied to q and k heads at once
        (they are adjacent in the fused qkv layout), the new k/v go into the
        cache with one ``index_copy_`` each (flat index computed once per step),
        and attention is SDPA with the ``rep`` query heads of a kv group as its
        query rows, so grouped-query attention needs no repeat of k/v.
        """
        s = self.spec
        B, ng, rep, hd = tokens.shape[0], s.local_groups, self.rep, s.head_dim
        L = int(pos.max()) + 1
        dev = tokens.device
        x = self._embed(tokens)  # [B, h]
        cos = self.cos[pos].view(B, 1, 1, hd)
        sin = self.sin_signed[pos].view(B, 1, 1, hd)
        rows = torch.arange(B, device=dev)
        flat = ((rows[:, None] * ng + torch.arange(ng, device=dev)[None, :]) * cache.max_len
                + pos[:, None]).view(-1)
        bias = torch.zeros(B, 1, 1, L, dtype=x.dtype, device=dev)
        bias.masked_fill_(torch.arange(L, device=dev).view(1, 1, 1, L) > pos.view(B, 1, 1, 1),
                          float("-inf"))
        half = hd // 2
        for li, layer in enumerate(self.w.layers):
            h = _rms(x, layer.ln1, s.eps)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(B, ng, rep + 2, hd)
            if layer.q_norm is None:
                qk = qkv[:, :, : rep + 1]
            else:
                qk = torch.cat((_rms(qkv[:, :, :rep], layer.q_norm, s.eps),
                                _rms(qkv[:, :, rep:rep + 1], layer.k_norm, s.eps)), 2)
            # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2] (exact: a sign flip)
            qk = qk * cos + qk.roll(half, -1) * sin
            ck, cv = cache.k_flat[li], cache.v_flat[li]
            ck.index_copy_(0, flat, qk[:, :, rep].reshape(B * ng, hd))
            cv.index_copy_(0, flat, qkv[:, :, rep + 1].reshape(B * ng, hd))
            o = F.scaled_dot_product_attention(qk[:, :, :rep], cache.k[li, :B, :, :L],
                                               cache.v[li, :B, :, :L], attn_mask=bias,
                                               scale=self.scale)  # [B, ng, rep, hd]
            x = x + self._all_reduce(F.linear(o.reshape(B, ng * rep * hd), layer.proj_w))
            x = x + self._mlp(layer, x)
        return self.logits(x)
