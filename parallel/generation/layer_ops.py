"""The decoder's small ops, each exactly what transformers computes (fp32 bit for bit), written
for few torch calls on CPU: RMSNorm, RoPE and the linears, optionally into reused buffers
(:mod:`parallel.generation.workspace`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from parallel.generation.workspace import Workspace

__all__ = ["rms_norm", "linear", "linear_2d", "apply_rope"]

_WIDTHS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _width(n: int, device: torch.device) -> torch.Tensor:
    """``n`` as a 0-dim fp32 tensor (cached): dividing by a tensor skips the scalar
    wrapping and casts that a Python number costs each op on CPU."""
    t = _WIDTHS.get((n, device))
    if t is None:
        t = _WIDTHS[(n, device)] = torch.tensor(float(n), dtype=torch.float32, device=device)
    return t


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: torch.Tensor | float,
             ws: Optional[Workspace] = None, name: str = "") -> torch.Tensor:
    """transformers' RMSNorm, bit for bit: normalise in fp32, cast back, scale.

    Written out rather than ``F.rms_norm`` (on CPU that composite upcasts and copies, and
    costs about twice as much inside the decode loop); ``sum / n`` is exactly what
    ``mean`` computes, and ``x * x`` exactly ``pow(2)``.  ``eps`` may be a 0-dim fp32
    tensor (the decoder passes one, for the same reason as :func:`_width`).  With a
    workspace (2-d fp32 ``x`` only) the result is buffer ``name`` (``t * w`` is ``w * t``).
    """
    xf = x if x.dtype == torch.float32 else x.float()
    if ws is not None and x.dtype == torch.float32 and x.dim() == 2:
        sq = torch.mul(xf, xf, out=ws.get("rms_sq", *x.shape))
        var = sq.sum(-1, keepdim=True).div_(_width(x.shape[-1], x.device)).add_(eps).rsqrt_()
        return torch.mul(xf, var, out=ws.get(name, *x.shape)).mul_(w)
    var = (xf * xf).sum(-1, keepdim=True).div_(_width(x.shape[-1], x.device)).add_(eps).rsqrt_()
    if x.dtype == torch.float32:
        return w * (xf * var)
    return w * (xf * var).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, w_t: Optional[torch.Tensor],
           b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, through the contiguous ``[in, out]`` copy when there is one."""
    if w_t is None:
        return F.linear(x, w, b)
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), w, w_t, b).view(*x.shape[:-1], w_t.shape[1])
    return torch.mm(x, w_t) if b is None else torch.addmm(b, x, w_t)


def linear_2d(x: torch.Tensor, w: torch.Tensor, w_t: Optional[torch.Tensor], b: Optional[torch.Tensor],
              ws: Optional[Workspace], name: str) -> torch.Tensor:
    """:func:`linear` of a 2-d ``x``, into workspace buffer ``name`` when there is one."""
    if ws is None or w_t is None:
        return linear(x, w, w_t, b)
    out = ws.get(name, x.shape[0], w_t.shape[1])
    return torch.mm(x, w_t, out=out) if b is None else torch.addmm(b, x, w_t, out=out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bit for bit, with ``sin_signed =
    [-sin_1, sin_2]`` (halves of the last dim): ``rotate_half(x) * sin`` is ``[x_2, x_1] *
    sin_signed`` exactly (a sign flip), added half by half in place, so no rotated copy is
    made (``torch.roll`` is a ``cat`` on CPU: ~80 us a layer at 512 rows)."""
    half = x.shape[-1] // 2
    y = torch.mul(x, cos, out=out)
    y[..., :half].addcmul_(x[..., half:], sin_signed[..., :half])
    y[..., half:].addcmul_(x[..., :half], sin_signed[..., half:])
    return y
