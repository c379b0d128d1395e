"""Mixture-of-experts layers in the generation engine: weights of one tp rank and the forward.

Why a module of its own: the dense decoder's MLP is one fused linear pair; an MoE layer is a
router plus ``E`` expert MLPs, with its own weight names, shapes and CPU layout, and a forward
that must group tokens by expert to stay cheap on CPU.

Routing is HF's (transformers ``Qwen3MoeTopKRouter``): ``softmax(h @ W_router^T)`` in fp32,
``torch.topk`` of it, renormalised when ``norm_topk_prob``; the layer's output is
``sum_k p_k * expert_k(h)`` with ``expert = fc2(silu(gate(h)) * up(h))``.  The router logits are
computed in fp32 (an fp32 copy of the router): exactly HF's in fp32, and in bf16 the same
routing the trainer's megatron router computes (``moe_router_dtype="fp32"``), which is what
routing replay (R3) wants the generator and the trainer to agree on.

Experts: megatron's SequentialMLP layout, ``...mlp.experts.local_experts.{j}.linear_fc1.weight``
``[2 f/tp, hidden]`` (``[gate_r; up_r]``, as the dense ``linear_fc1``) and ``linear_fc2.weight``
``[hidden, f/tp]``.  This rank holds ALL experts (expert parallelism is gathered before the
engine sees the weights), split over tp like a dense MLP, so the layer ends with one all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

__all__ = ["MoELayerWeights", "moe_layer_names", "moe_layer_shapes", "moe_forward", "routing_dtype"]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds every expert id: uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def moe_layer_names(layer: int, num_experts: int) -> dict[str, str]:
    """Megatron names of one MoE layer's router and experts (keys ``router``, ``fc1.{j}``, ``fc2.{j}``)."""
    p = f"decoder.layers.{layer}.mlp."
    out = {"router": p + "router.weight"}
    for j in range(num_experts):
        out[f"fc1.{j}"] = f"{p}experts.local_experts.{j}.linear_fc1.weight"
        out[f"fc2.{j}"] = f"{p}experts.local_experts.{j}.linear_fc2.weight"
    return out


def moe_layer_shapes(layer: int, num_experts: int, hidden: int, ffn: int, tp_size: int
                     ) -> dict[str, tuple[int, ...]]:
    """Local (this tp rank) shape of every megatron parameter of one MoE layer."""
    if ffn % tp_size:
        raise ValueError(f"moe_intermediate_size={ffn} is not divisible by tp_size={tp_size}")
    f = ffn // tp_size
    out: dict[str, tuple[int, ...]] = {}
    for key, name in moe_layer_names(layer, num_experts).items():
        out[name] = (num_experts, hidden) if key == "router" else (2 * f, hidden) if key[:3] == "fc1" else (hidden, f)
    return out


@dataclass
class MoELayerWeights:
    """One MoE layer's tensors: references to the (possibly shared) originals, plus fp32 / CPU copies.

    ``router_t``: the router as fp32 ``[hidden, E]`` (always a copy: fp32 routing, see the module
    docstring).  On CPU, ``fc1_t`` ``[E, hidden, 2f]`` and ``fc2_t`` ``[E, f, hidden]`` hold every
    expert's weights transposed and contiguous, for the same reason as the dense linears'
    ``[in, out]`` copies (:class:`parallel.generation.weights.DecoderWeights`); :meth:`refresh`
    re-copies all of them after an in-place write.
    """

    router: torch.Tensor
    fc1: list[torch.Tensor]
    fc2: list[torch.Tensor]
    router_t: torch.Tensor
    fc1_t: Optional[torch.Tensor] = None
    fc2_t: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, named: Mapping[str, torch.Tensor], layer: int, num_experts: int,
              transposed: bool) -> "MoELayerWeights":
        names = moe_layer_names(layer, num_experts)
        fc1 = [named[names[f"fc1.{j}"]] for j in range(num_experts)]
        fc2 = [named[names[f"fc2.{j}"]] for j in range(num_experts)]
        router = named[names["router"]]
        w = cls(router, fc1, fc2, router.detach().t().float().contiguous())
        if transposed:
            w.fc1_t = torch.stack([t.detach().t() for t in fc1]).contiguous()
            w.fc2_t = torch.stack([t.detach().t() for t in fc2]).contiguous()
        return w

    @torch.no_grad()
    def refresh(self) -> None:
        self.router_t.copy_(self.router.t())
        if self.fc1_t is not None:
            for j, (a, b) in enumerate(zip(self.fc1, self.fc2)):
                self.fc1_t[j].copy_(a.t())
                self.fc2_t[j].copy_(b.t())


def moe_forward(h: torch.Tensor, w: MoELayerWeights, topk: int, norm_topk_prob: bool,
                all_reduce: Callable[[torch.Tensor], torch.Tensor],
                rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer on normalised hidden states ``h [N, hidden]``: (output ``[N, hidden]``, top-k ids ``[N, k]``).

    Tokens are grouped by expert (a stable sort of the ``N*k`` assignments by expert id) and
    every expert that has tokens runs once on its contiguous block: one matmul pair per used
    expert, whatever ``N`` is, instead of a per-token loop.  ``rows`` (optional) restricts the
    expert work to those rows (prefill's real tokens; padding rows are routed but get output 0).
    Every tp rank routes identically (the router is replicated), computes its ffn slice of each
    expert, and the weighted sum is all-reduced once.
    """
    N = h.shape[0]
    logits = torch.mm(h.float(), w.router_t)  # [N, E] fp32
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = torch.topk(probs, topk, dim=-1)  # [N, k]
    if norm_topk_prob:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    top_p = top_p.to(h.dtype)
    out = torch.zeros_like(h)
    sel_i, sel_p, src = top_i, top_p, None
    if rows is not None:
        sel_i, sel_p, src = top_i[rows], top_p[rows], rows
    flat = sel_i.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within
    token = order // topk  # position in the (selected) rows
    counts = torch.bincount(flat, minlength=len(w.fc1)).tolist()
    x = h[token] if src is None else h[src[token]]
    weight = sel_p.reshape(-1)[order].unsqueeze(-1)
    parts = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = x[start:start + n]
        if w.fc1_t is not None:
            gate_up = torch.mm(xe, w.fc1_t[e])
            f = gate_up.shape[1] // 2
            parts.append(torch.mm(F.silu(gate_up[:, :f]) * gate_up[:, f:], w.fc2_t[e]))
        else:
            gate, up = F.linear(xe, w.fc1[e]).chunk(2, dim=-1)
            parts.append(F.linear(F.silu(gate) * up, w.fc2[e]))
        start += n
    y = torch.cat(parts) * weight
    dest = token if src is None else src[token]
    out.index_add_(0, dest, y)
    return all_reduce(out), top_i
