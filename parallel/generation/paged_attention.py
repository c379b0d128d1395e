"""Decode attention straight over the paged KV pool: a Triton kernel (GPU; CPU under Triton's interpreter).

Why a kernel: the paged decode step otherwise gathers every row's context out of the pool into a
new ``[B, L, groups, head_dim]`` tensor per layer, then attends over the copy: the KV bytes cross
memory three times (read, write, read) where attention needs them once.  A decode step of a small
model at a few hundred sequences is bound by exactly those bytes (Qwen3-0.6B at 256 sequences of
~1k tokens: ~30 GB of KV a step against ~1.2 GB of weights), so the gather caps the step at about a
third of the memory roofline.  The kernel reads each row's blocks through its block table in
place: one program per (row, kv group) walks the row's blocks ``TILE`` tokens at a time with an
online softmax (flash-decoding without the split), the group's ``rep`` query heads together so a
key/value tile is loaded once for all of them (grouped-query attention without repeating k/v).

The row's length comes from a tensor, so the launch is the same for every step of a row bucket:
CUDA graphs capture it as they capture the other kernels.

Tested on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, numpy per program) against
the gather path; compiled for real on a GPU (``benchmarks/device_check.sh``).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

__all__ = ["kernel_for", "paged_decode_attention", "MIN_BLOCK_SIZE"]

#: ``tl.dot`` needs tiles of >= 16 on every side: smaller KV blocks take the gather path
MIN_BLOCK_SIZE = 16
#: tokens per key/value tile (whole blocks; at least one)
TILE_TOKENS = 64


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _compiled(interpret: bool) -> Optional[Any]:
    """The jitted kernel (decorated on first use, so ``TRITON_INTERPRET`` is read then), or None
    without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, o_ptr,
               sq_b, sq_g, sq_r, sk_row, sk_g, st_b, so_b, so_g, so_r, width, scale,
               REP: tl.constexpr, REP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
               BS: tl.constexpr, BPT: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        n = tl.load(len_ptr + b)  # tokens 0..n-1 are this row's context
        r = tl.arange(0, REP_P)
        d = tl.arange(0, HD_P)
        t = tl.arange(0, BPT * BS)  # token within the tile
        rm = r < REP
        dm = d < HD
        q = tl.load(q_ptr + b * sq_b + g * sq_g + r[:, None] * sq_r + d[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        m_i = tl.full([REP_P], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([REP_P], dtype=tl.float32)
        acc = tl.zeros([REP_P, HD_P], dtype=tl.float32)
        for j in range(0, tl.cdiv(n, BPT * BS)):
            slot = j * BPT + t // BS  # the table entry of each token of the tile
            blk = tl.load(tab_ptr + b * st_b + slot, mask=slot < width, other=0)
            row = blk * BS + t % BS  # the token's pool row
            tm = j * BPT * BS + t < n
            off = row[:, None] * sk_row + g * sk_g + d[None, :]
            km = tm[:, None] & dm[None, :]
            k = tl.load(k_ptr + off, mask=km, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(tm[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off, mask=km, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * so_b + g * so_g + r[:, None] * so_r + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=rm[:, None] & dm[None, :])

    return kernel


def _pow2(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Attention of one query token per row over its context in the pool.

    ``q [B, groups, rep, head_dim]`` (RoPE applied); ``k_pool``/``v_pool [pool rows, groups,
    head_dim]`` (one layer); ``tables [B, W]`` block tables; ``lens [B]`` each row's context
    length (its new token's keys and values already written).  Returns ``[B, groups, rep,
    head_dim]`` in ``q``'s dtype.
    """
    kernel = _compiled(_interpreting())
    if kernel is None:
        raise RuntimeError("paged decode attention needs Triton (pip install triton)")
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"paged decode attention needs block_size >= {MIN_BLOCK_SIZE}, got {block_size}")
    B, ng, rep, hd = q.shape
    if k_pool.stride(-1) != 1 or v_pool.stride() != k_pool.stride() or q.stride(-1) != 1:
        raise ValueError("paged decode attention: q and the pool need a contiguous head_dim, k and v one layout")
    out = torch.empty((B, ng, rep, hd), dtype=q.dtype, device=q.device)
    tables = tables if tables.dtype == torch.int32 else tables.to(torch.int32)
    lens = lens if lens.dtype == torch.int32 else lens.to(torch.int32)
    kernel[(B, ng)](q, k_pool, v_pool, tables, lens, out,
                    q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), tables.stride(0),
                    out.stride(0), out.stride(1), out.stride(2), tables.shape[1], float(scale),
                    REP=rep, REP_P=_pow2(rep, 16), HD=hd, HD_P=_pow2(hd, 16), BS=block_size,
                    BPT=max(1, TILE_TOKENS // block_size), IEEE=q.dtype == torch.float32)
    return out


def kernel_for(device: torch.device, block_size: int) -> Optional[Callable[..., torch.Tensor]]:
    """:func:`paged_decode_attention` when it can run here: a CUDA device with Triton, or any
    device under Triton's interpreter; blocks of at least :data:`MIN_BLOCK_SIZE` tokens."""
    if block_size < MIN_BLOCK_SIZE or (device.type != "cuda" and not _interpreting()):
        return None
    return paged_decode_attention if _compiled(_interpreting()) is not None else None
