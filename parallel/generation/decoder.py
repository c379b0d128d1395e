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

Mixture of experts (``spec.arch.moe``): the MLP is :func:`parallel.generation.moe.moe_forward`,
and every prefill / decode leaves the top-k expert ids it routed each input token to in
:attr:`Decoder.routing` (``[..., layers, topk]``, :func:`~parallel.generation.moe.routing_dtype`):
what routing replay (R3) hands the trainer.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.generation.kv_slots import KVCache
from parallel.generation.layer_ops import apply_rope, linear, linear_2d, rms_norm
from parallel.generation.moe import moe_forward, routing_dtype
from parallel.generation.paged_cache import PagedKVCache
from parallel.generation.weights import DecoderWeights
from parallel.generation.workspace import Workspace, workspace_for
from parallel.model_config import rope_inv_freq

__all__ = ["KVCache", "Decoder", "Probe"]

#: ``probe(op, layer, x)`` at the op boundaries of a forward (see :attr:`Decoder.probe`)
Probe = Callable[[str, int, torch.Tensor], None]


#: contiguous decode attends over a multiple of this many positions (see :meth:`Decoder.decode`)
_ATTEND_MULTIPLE = 16

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
        self.cos_sin = torch.stack((self.cos, self.sin_signed), 1)  # [max_len, 2, hd]: one gather
        self.vocab_lo = s.tp_rank * s.local_vocab
        self._positions = torch.arange(max_len, device=weights.device)
        self.eps = torch.tensor(s.eps, dtype=torch.float32, device=weights.device)  # see layer_ops.rms_norm
        self._neg_inf = torch.tensor(float("-inf"), device=weights.device)  # decode's mask values
        self._zero = torch.tensor(0.0, device=weights.device)
        moe = s.arch.moe
        self.moe = moe
        self.routing_dtype = routing_dtype(moe.num_experts) if moe is not None else None
        # MoE only: the top-k expert ids of every input token of the last prefill ([J, P, layers,
        # topk], padding rows included) or decode ([B, layers, topk]); None for dense models
        self.routing: Optional[torch.Tensor] = None
        # The mismatch doctor's window into a forward (parallel.mismatch_probe): called with
        # ("embedding", -1, x), ("attention", i, x) and ("mlp", i, x) for the residual stream after
        # layer i's attention / MLP block, ("final_norm", -1, h) and ("logits", -1, logits).  x is
        # [J, P, h] in prefill, [B, h] in decode (changed in place afterwards: the probe copies
        # what it keeps); final_norm / logits rows are the rows logits() was given.  None (always,
        # outside the doctor) costs one test per layer.
        self.probe: Optional[Probe] = None
        # the paged decode step's attention kernel (parallel.generation.paged_attention.kernel_for;
        # the engine sets it): None gathers each row's context instead
        self.paged_kernel: Optional[Callable[..., torch.Tensor]] = None
        # decode's reused activation buffers (CPU; see parallel.generation.workspace)
        self.ws: Optional[Workspace] = workspace_for(weights.dtype, weights.device)

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
        h = rms_norm(h, self.w.final_norm, self.eps)
        V = self.spec.arch.vocab_size
        if self.spec.tp_size == 1:  # the padding rows of the LM head not computed: a contiguous [N, V]
            w_t = None if self.w.output_t is None else self.w.output_t[:, :V]  # (~30% cheaper to sample from)
            out = linear(h, self.w.output[:V], w_t)
        else:
            out = linear(h, self.w.output, self.w.output_t)
        if self.spec.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(self.spec.tp_size)]
            dist.all_gather(parts, out.contiguous(), group=self.tp_group)
            out = torch.cat(parts, -1)
        out = out[..., :V].float()
        if self.probe is not None:
            self.probe("final_norm", -1, h)
            self.probe("logits", -1, out)
        return out

    def _moe(self, layer, li: int, x: torch.Tensor, routing: torch.Tensor,
             rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """MoE MLP of ``x [..., h]``; writes layer ``li``'s expert ids into ``routing [N, layers, k]``."""
        h = rms_norm(x, layer.ln2, self.eps)
        out, ids = moe_forward(h.reshape(-1, h.shape[-1]), layer.moe, self.moe.topk, self.moe.norm_topk_prob,
                               self._all_reduce, rows)
        routing[:, li] = ids
        return out.view(x.shape)

    def _new_routing(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.empty((n, self.spec.num_layers, self.moe.topk), dtype=self.routing_dtype, device=device)

    # ------------------------------------------------------------- forward

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, lens: torch.Tensor, cache: KVCache, slot0: int,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                images: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Right-padded prompts ``ids [J, P]`` into slots ``slot0..slot0+J-1`` of a contiguous cache.

        Right padding needs no mask beyond causality: a real token only attends
        to earlier positions, which are all real.  Returns logits [J, V] at each
        row's last real token.  Vision-language models (:mod:`parallel.generation.vision`)
        pass per-row ``rope`` cos/sin ``[J, P, hd]`` (M-RoPE) and ``images``: rows
        ``(row, position)`` whose embeddings are replaced by the tower's ``features``.
        """
        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_prefix(li, slot0, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.rep > 1)

        return self._rows_forward(ids, lens, None, attend, rope, images)

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, pool: PagedKVCache,
               write_rows: torch.Tensor, ctx_tables: Optional[torch.Tensor] = None,
               rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               images: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
               fill: Optional[tuple[KVCache, int, torch.Tensor | int]] = None) -> torch.Tensor:
        """Prefill into the paged pool: row ``j`` runs its tokens ``starts[j] .. starts[j]+lens[j]-1``
        (``ids [J, P]``, right-padded), writing their keys and values to pool rows ``write_rows
        [J, P]`` (the scratch row for padding), and attending to its earlier tokens already in the
        pool -- a cached or shared prefix, the previous chunks of a chunked prefill -- through the
        block tables ``ctx_tables [J, W]`` (whole blocks, read at once: tokens ``0..W*bs-1``, those
        at or past a row's own position masked; None when every row starts at 0). Logits [J, V]
        at each row's last new token.

        ``fill = (cache, slot0, src)`` (contiguous decode, rows starting at 0 only): also write
        the keys and values of job ``src[i]`` into slot ``slot0 + i`` of ``cache``, straight from
        the layer's output (a group's n slots from its one prefilled prompt), instead of reading
        them back from the pool afterwards; ``src`` an int ``n``: each job into ``n`` slots in turn."""
        J, P = ids.shape
        ng, hd = self.spec.local_groups, self.spec.head_dim
        positions = (starts[:, None] + self._positions[:P][None, :]).clamp_(max=self._positions.shape[0] - 1)
        mask = None
        if fill is not None and ctx_tables is not None:
            raise ValueError("extend: fill writes slots from rows that start at 0 (ctx_tables must be None)")
        C = 0
        if ctx_tables is not None:  # key t is visible to the query at position p when t <= p
            C = min(ctx_tables.shape[1] * pool.block_size, self._positions.shape[0])
            mask = (self._positions[:C][None, None, :] <= positions[:, :, None])[:, None]
        flat_rows = write_rows.reshape(-1)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool.write(li, flat_rows, k.transpose(1, 2).reshape(J * P, ng, hd), v.transpose(1, 2).reshape(J * P, ng, hd))
            if fill is not None:
                fill[0].fill_from_jobs(li, fill[1], k, v, fill[2])
            if ctx_tables is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                      enable_gqa=self.rep > 1)
            k_all, v_all = pool.read_blocks(li, ctx_tables)  # [J, W*bs, ng, hd]
            return F.scaled_dot_product_attention(q, k_all[:, :C].transpose(1, 2), v_all[:, :C].transpose(1, 2),
                                                  attn_mask=mask, scale=self.scale, enable_gqa=self.rep > 1)

        return self._rows_forward(ids, lens, None if ctx_tables is None else positions, attend, rope, images)

    def _rows_forward(self, ids: torch.Tensor, lens: torch.Tensor, positions: Optional[torch.Tensor],
                      attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                      images: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The layers over right-padded rows ``ids [J, P]``; ``attend(layer, q [J, heads, P, hd],
        k, v [J, groups, P, hd])`` stores k/v and returns the attention output [J, heads, P, hd].
        ``positions [J, P]``: rotary positions when rows do not start at 0."""
        s = self.spec
        J, P = ids.shape
        N, ng, rep, hd = J * P, s.local_groups, self.rep, s.head_dim
        x = self._embed(ids)  # [J, P, h]
        if images is not None:
            rows_j, rows_p, feats = images
            x[rows_j, rows_p] = feats.to(x.dtype)
        # sin as sin_signed (see layer_ops.apply_rope)
        if rope is not None:
            cos = rope[0].view(J, P, 1, 1, hd)
            half = hd // 2
            sin = torch.cat((-rope[1][..., :half], rope[1][..., half:]), -1).view(J, P, 1, 1, hd)
        elif positions is not None:
            cos, sin = self.cos_sin[positions].view(J, P, 2, 1, 1, hd).unbind(2)
        else:
            cos, sin = self.cos_sin[:P].view(1, P, 2, 1, 1, hd).unbind(2)
        probe = self.probe
        if probe is not None:
            probe("embedding", -1, x)
        routing = rows = None
        if self.moe is not None:
            routing = self._new_routing(N, x.device)
            if int(lens.sum()) != N:  # experts run on the real tokens only
                rows = (self._positions[:P][None, :] < lens[:, None]).reshape(-1).nonzero().squeeze(1)
        # the token rows as one 2-d batch: the matmuls, norms and the MLP run as in decode, into
        # the reused buffers (fresh [N, 2*ffn] outputs page-fault: ~3x the matmul on the CI VM)
        ws = self.ws
        x2 = x.view(N, -1)
        ffn = s.ffn // s.tp_size
        for li, layer in enumerate(self.w.layers):
            h = rms_norm(x2, layer.ln1, self.eps, ws, "h")
            qkv = linear_2d(h, layer.qkv_w, layer.qkv_t, layer.qkv_b, ws, "qkv").view(J, P, ng, rep + 2, hd)
            if layer.q_norm is None:
                qk = qkv[:, :, :, : rep + 1]
            else:
                qk = torch.cat((rms_norm(qkv[:, :, :, :rep], layer.q_norm, self.eps),
                                rms_norm(qkv[:, :, :, rep:rep + 1], layer.k_norm, self.eps)), 3)
            qk = apply_rope(qk, cos, sin)  # [J, P, ng, rep+1, hd]
            q = qk[:, :, :, :rep].reshape(J, P, s.local_heads, hd).transpose(1, 2)  # [J, nh, P, hd]
            k, v = qk[:, :, :, rep].transpose(1, 2), qkv[:, :, :, rep + 1].transpose(1, 2)  # [J, ng, P, hd]
            o = attend(li, q, k, v)
            o = o.transpose(1, 2).reshape(N, s.local_heads * hd)
            x2.add_(self._all_reduce(linear_2d(o, layer.proj_w, layer.proj_t, None, ws, "proj")))
            if probe is not None:
                probe("attention", li, x)
            if routing is not None:
                x2.add_(self._moe(layer, li, x2, routing, rows))
            else:
                gate_up = linear_2d(rms_norm(x2, layer.ln2, self.eps, ws, "h"), layer.fc1_w, layer.fc1_t, None,
                                     ws, "fc1")
                act = F.silu(gate_up[:, :ffn], inplace=True).mul_(gate_up[:, ffn:])
                x2.add_(self._all_reduce(linear_2d(act, layer.fc2_w, layer.fc2_t, None, ws, "fc2")))
            if probe is not None:
                probe("mlp", li, x)
        if routing is not None:
            self.routing = routing.view(J, P, s.num_layers, -1)
        last = x[torch.arange(J, device=x.device), lens - 1]
        return self.logits(last)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: Optional[KVCache],
               rope_pos: Optional[torch.Tensor] = None, pool: Optional[PagedKVCache] = None,
               pool_rows: Optional[torch.Tensor] = None, tables: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One token per row (rows ``0..B-1`` = slots) at positions ``pos``; logits [B, V].

        ``rope_pos`` (vision-language models): the rotary positions when they are not the
        cache positions (``pos + delta`` after an image prompt; M-RoPE's three are equal then).

        Where keys and values live (:mod:`parallel.generation.paged_cache`):

        * ``cache`` (contiguous slots): the new k/v go into slot ``i`` of row ``i`` and attention
          reads the slots; with ``pool`` the new k/v are also written to pool rows ``pool_rows [B]``
          (the slots are then the pool's per-row copy);
        * ``cache=None`` (paged): the new k/v go to ``pool_rows`` and each row attends over its
          tokens ``0..pos`` through its block table, ``tables [B, W]`` (``W`` blocks cover every
          row): with :attr:`paged_kernel` (:mod:`parallel.generation.paged_attention`) in place,
          else by gathering pool rows for positions ``0..W*bs-1`` (past ``pos``: masked).

        Written for few ops per layer: RoPE is applied to q and k heads at once
        (they are adjacent in the fused qkv layout), the new k/v go into the
        cache with one ``index_copy_`` each (flat indices computed once per
        step), and attention is two batched matmuls with the ``rep`` query
        heads of a kv group as the query rows, so grouped-query attention needs
        no repeat of k/v.  (Torch's fused CPU attention costs about twice as
        much at these shapes: tiny heads, a handful of query rows.)
        """
        s = self.spec
        B, ng, rep, hd = tokens.shape[0], s.local_groups, self.rep, s.head_dim
        x = self._embed(tokens)  # [B, h]
        cos, sin = self.cos_sin[pos if rope_pos is None else rope_pos].view(B, 1, 2, 1, hd).unbind(2)
        kernel = None
        if cache is not None:
            L = int(pos.max()) + 1
            cache.reserve(L, B)
            # attend over a multiple of 16 positions (the capacity is one): torch's CPU softmax
            # over a last dim shorter than 16 costs 4-10x one of 16 (measured at 512 rows: 0.3-0.5
            # ms vs 0.04 ms a layer), far more than the masked extra columns' matmul work
            L = min(-(-L // _ATTEND_MULTIPLE) * _ATTEND_MULTIPLE, cache.capacity)
            idx = cache.decode_index(pos)
            keys = cache.k[:, :B, :, :L].flatten(1, 2)  # [layers, B*ng, L, hd], a view
            values = cache.v[:, :B, :, :L].flatten(1, 2)
        else:
            kernel = self.paged_kernel
            # the blocks' positions, up to the context (a last block may run past max_len)
            L = min(tables.shape[1] * pool.block_size, self._positions.shape[0])
            if kernel is not None:
                # int32 once per step, not per layer (what the kernel indexes with)
                lens, tables = (pos + 1).to(torch.int32), tables.to(torch.int32)
        # additive mask for positions beyond each row's own, one row per query: [B*ng, rep, L]
        if cache is not None or kernel is None:  # (the kernel masks by each row's length itself)
            bias = torch.where(self._positions[:L] > pos[:, None], self._neg_inf, self._zero).to(x.dtype)
            bias = bias[:, None, None, :].expand(B, ng, rep, L).reshape(B * ng, rep, L)
        ffn = s.ffn // s.tp_size
        routing = None if self.moe is None else self._new_routing(B, x.device)
        probe = self.probe
        if probe is not None:
            probe("embedding", -1, x)
        ws = self.ws
        for li, layer in enumerate(self.w.layers):
            h = rms_norm(x, layer.ln1, self.eps, ws, "h")
            qkv = linear_2d(h, layer.qkv_w, layer.qkv_t, layer.qkv_b, ws, "qkv").view(B, ng, rep + 2, hd)
            if layer.q_norm is None:
                qk = qkv[:, :, : rep + 1]
            else:
                qk = torch.cat((rms_norm(qkv[:, :, :rep], layer.q_norm, self.eps),
                                rms_norm(qkv[:, :, rep:rep + 1], layer.k_norm, self.eps)), 2)
            qk = apply_rope(qk, cos, sin, None if ws is None else ws.get("rope", B, ng, rep + 1, hd))
            if pool is not None:
                pool.write(li, pool_rows, qk[:, :, rep], qkv[:, :, rep + 1])
            if cache is not None:
                cache.k_flat[li].index_copy_(0, idx, qk[:, :, rep].reshape(B * ng, hd))
                cache.v_flat[li].index_copy_(0, idx, qkv[:, :, rep + 1].reshape(B * ng, hd))
                k_t, vals = keys[li].transpose(1, 2), values[li]
            elif kernel is None:  # the gather path: [B, L, ng, hd] -> [B*ng, hd, L] and [B*ng, L, hd]
                k_all, v_all = pool.read_blocks(li, tables)  # whole blocks, one index each
                k_t = k_all[:, :L].permute(0, 2, 3, 1).reshape(B * ng, hd, L)
                vals = v_all[:, :L].transpose(1, 2).reshape(B * ng, L, hd)
            if cache is None and kernel is not None:  # in place over the block tables
                o = kernel(qk[:, :, :rep], pool.k[li], pool.v[li], tables, lens, self.scale, pool.block_size)
            else:
                scores = torch.baddbmm(bias, qk[:, :, :rep].reshape(B * ng, rep, hd), k_t,
                                       alpha=self.scale)  # [B*ng, rep, L]
                o = torch.bmm(torch.softmax(scores, dim=-1), vals,
                              out=None if ws is None else ws.get("attn", B * ng, rep, hd))  # [B*ng, rep, hd]
            x.add_(self._all_reduce(linear_2d(o.view(B, ng * rep * hd), layer.proj_w, layer.proj_t, None,
                                               ws, "proj")))
            if probe is not None:
                probe("attention", li, x)
            if routing is not None:
                x.add_(self._moe(layer, li, x, routing))
            else:  # silu(gate) * up in place in the fc1 output: fc2 reads it through a strided view
                gate_up = linear_2d(rms_norm(x, layer.ln2, self.eps, ws, "h"), layer.fc1_w, layer.fc1_t, None,
                                     ws, "fc1")
                act = F.silu(gate_up[:, :ffn], inplace=True).mul_(gate_up[:, ffn:])
                x.add_(self._all_reduce(linear_2d(act, layer.fc2_w, layer.fc2_t, None, ws, "fc2")))
            if probe is not None:
                probe("mlp", li, x)
        if routing is not None:
            self.routing = routing
        return self.logits(x)
