"""Rotary embeddings at explicit positions, for rows whose positions do not restart per segment.

megatron's GPT computes its RoPE frequencies from a length alone (``0..S-1``) and, on a pad-free
THD row, restarts them at each ``cu_seqlens`` segment. A shared-prefix segment
(:mod:`parallel.shared_prefix`) needs more: every sample's response continues at the prefix's
length, so the row's positions go ``0..p-1, p.., p.., ...``. This subclass returns one
frequency row per token at those positions when the schedule has set them (megatron's THD rotary
then maps token ``t`` to row ``t``, its "exact mapping with offsets" case), and the stock
frequencies otherwise. It holds no parameters or buffers of its own: checkpoints are unchanged.

:func:`install_packed_rope` also gives megatron's unfused THD rotation (``rope_utils.
_apply_rotary_pos_emb_thd``, used by every pad-free row) a vectorised way to its per-token
frequencies: megatron slices them per segment in a Python loop (a ``.item()`` per segment, a host
sync on a GPU) for the q and the k of every layer; the same rows come from one gather.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

__all__ = ["explicit_rotary_positions", "positioned_ropes", "use_positioned_rotary", "install_packed_rope"]


def _positioned_class() -> type:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class PositionedRotaryEmbedding(RotaryEmbedding):
        positions: Optional[torch.Tensor] = None  # [row tokens], set around one forward

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                    cp_group: Any = None) -> torch.Tensor:
            pos = self.positions
            if pos is None:
                return super().forward(max_seq_len, offset, packed_seq, cp_group)
            full = super().forward(int(pos.max()) + 1, offset, packed_seq, cp_group)
            return full[pos.to(full.device)]

    return PositionedRotaryEmbedding


_CLASS: Optional[type] = None


def use_positioned_rotary(model: torch.nn.Module) -> bool:
    """Give a GPT model's plain RoPE the explicit-positions path (in place; False when the model
    has another kind of position embedding, which then cannot take shared-prefix rows)."""
    global _CLASS
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:  # a pipeline stage without decoder layers does not rotate
        return True
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if _CLASS is None:
        _CLASS = _positioned_class()
    if type(rope) is RotaryEmbedding:
        rope.__class__ = _CLASS  # a subclass with no state of its own: the same module otherwise
    return isinstance(rope, _CLASS)


def positioned_ropes(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's rotary modules that take explicit positions (look up once per model)."""
    return [] if _CLASS is None else [m for m in model.modules() if isinstance(m, _CLASS)]


@contextlib.contextmanager
def explicit_rotary_positions(ropes: list[torch.nn.Module], positions: Optional[torch.Tensor]) -> Iterator[None]:
    """Rotate ``ropes`` (:func:`positioned_ropes`) by ``positions`` during the forward inside
    (megatron computes the frequencies once per forward, before the layers: recompute in the
    backward reuses them)."""
    if positions is None or not ropes:
        yield
        return
    for r in ropes:
        r.positions = positions
    try:
        yield
    finally:
        for r in ropes:
            r.positions = None


def install_packed_rope() -> None:
    """Replace megatron's unfused THD RoPE (module docstring) with :func:`_packed_rope` (idempotent).
    Context parallelism (never with our core attention) keeps megatron's own."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils._apply_rotary_pos_emb_thd, "_realflow_packed", False):
        return
    original = rope_utils._apply_rotary_pos_emb_thd

    cache: dict[str, Any] = {}  # the last row's (freqs, cu_seqlens, n, mscale, dtype) -> (cos, sin)

    def _packed_rope(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                     rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                     mscale: float = 1.0, cp_group: Any = None) -> torch.Tensor:
        """megatron's ``_apply_rotary_pos_emb_thd`` at cp = 1, the same frequency rows gathered at once:
        ``freqs`` with one row per token (explicit positions) as they are, else row ``i`` of a
        segment's ``i``-th token (megatron's two cases; ``t`` is the whole row, ``cu_seqlens[-1]``).
        The rows' cos / sin are computed once per forward (every layer's q and k get the same
        ``freqs``), and the rotation is megatron's ``t * cos + rotate_half(t) * sin`` without its
        concatenation of an empty pass-through part (a copy of ``t``)."""
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        n = t.size(0)
        key = (n, float(mscale), t.dtype, freqs._version, cu_seqlens._version)  # _version: in-place changes
        hit = cache.get("freqs") is freqs and cache.get("cu") is cu_seqlens and cache.get("key") == key
        if not hit:
            rows = freqs
            if freqs.size(0) != n:  # positions restart at 0 at each segment start
                cu = cu_seqlens.to(device=freqs.device, dtype=torch.long)
                starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=n)
                rows = freqs[torch.arange(n, device=freqs.device) - starts]
            cache.clear()
            cache.update(freqs=freqs, cu=cu_seqlens, key=key, rows=rows,
                         cos=(torch.cos(rows) * mscale).to(t.dtype), sin=(torch.sin(rows) * mscale).to(t.dtype))
        if multi_latent_attention or t.size(-1) != cache["rows"].size(-1):  # megatron's general form
            return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), cache["rows"],
                                                         rotary_interleaved=rotary_interleaved,
                                                         multi_latent_attention=multi_latent_attention,
                                                         mscale=mscale).squeeze(1)
        x = t.unsqueeze(1)
        return ((x * cache["cos"]) + (rope_utils._rotate_half(x, rotary_interleaved) * cache["sin"])).squeeze(1)

    _packed_rope._realflow_packed = True  # type: ignore[attr-defined]
    rope_utils._apply_rotary_pos_emb_thd = _packed_rope
