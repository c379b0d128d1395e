"""The MoE router of realflow's models: HF's routing, rollout routing replay (R3), statistics.

Why our own router rather than megatron's ``TopKRouter`` routing: (1) the weights must be
HF's (softmax over all experts in fp32, top-k, renormalised when ``norm_topk_prob``), so the
trainer routes exactly as transformers and the generation engine do; (2) routing replay must
take the generator's expert choice per token, falling back to the router's own choice for
tokens the generator never ran as input (each sequence's last token), and megatron's
``RouterReplay`` keeps one process-wide list of routers, while a realflow worker holds
several models (actor, reference, critic) at once; (3) the load-balancing loss is HF's
(:func:`hf_aux_loss`) and the statistics per step are ours.

The router keeps megatron's parameter (``router.weight``, marked ``sequence_parallel`` so its
gradient is summed over tp) and its gating GEMM, and returns what megatron's dispatcher
expects: ``probs`` ``[tokens, experts]`` (zero off the chosen experts) and a boolean
``routing_map``.  A :class:`RoutingContext` per model, shared by its routers, carries the
current micro-batch's token mask and replayed experts in and the statistics out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import functools

import torch

__all__ = ["router_class", "RoutingContext", "RoutingTotals", "hf_aux_loss", "install_routing_context"]


@dataclass
class RoutingTotals:
    """One micro-batch's routing over this stage's MoE layers (this rank's tokens)."""

    layer_counts: list[torch.Tensor]  # per layer [E]: top-k assignments of real tokens (no grad)
    prob_sum: torch.Tensor  # [E] router softmax of real tokens, summed over layers (grad when training)
    tokens: float  # real tokens x layers
    replayed: float = 0.0  # real tokens x layers routed by replay
    replay_differs: float = 0.0  # ... of which the router's own top-k set differs


@dataclass
class RoutingContext:
    """What the routers of one model share during one micro-batch's forward.

    ``valid`` ``[tokens]`` (router order: sequence-major ``[s, b]`` flattened, this rank's
    sequence-parallel part) marks real tokens; ``replay`` maps a GLOBAL layer index to the
    experts ``[tokens, k]`` to use (``-1`` rows: the router's own choice).
    """

    num_experts: int
    topk: int
    norm_topk_prob: bool
    valid: Optional[torch.Tensor] = None
    replay: dict[int, torch.Tensor] = field(default_factory=dict)
    want_grad: bool = False  # keep the softmax sums' graph (the aux loss trains the router)
    totals: Optional[RoutingTotals] = None

    def begin(self, valid: Optional[torch.Tensor], replay: Optional[dict[int, torch.Tensor]],
              want_grad: bool) -> None:
        self.valid, self.replay, self.want_grad, self.totals = valid, dict(replay or {}), want_grad, None

    def finish(self) -> Optional[RoutingTotals]:
        out, self.totals, self.valid, self.replay = self.totals, None, None, {}
        return out

    def record(self, own: torch.Tensor, chosen: torch.Tensor, probs_all: torch.Tensor,
               replayed: Optional[torch.Tensor]) -> None:
        """Add one layer's routing (``own``/``chosen`` ``[T, k]``, ``probs_all`` ``[T, E]``)."""
        valid = self.valid
        if valid is None or valid.shape[0] != own.shape[0]:
            valid = torch.ones(own.shape[0], dtype=torch.bool, device=own.device)
        w = valid.to(probs_all.dtype)
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=own.device)
        counts.scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(chosen.shape[1]).float())
        probs = probs_all if self.want_grad else probs_all.detach()
        prob_sum = (probs * w[:, None]).sum(0)
        t = self.totals
        if t is None:
            t = self.totals = RoutingTotals([], torch.zeros_like(prob_sum), 0.0)
        t.layer_counts.append(counts)
        t.prob_sum = t.prob_sum + prob_sum
        t.tokens += float(valid.sum())
        if replayed is not None:
            rep = replayed & valid
            t.replayed += float(rep.sum())
            differs = (own.sort(-1).values != chosen.sort(-1).values).any(-1)
            t.replay_differs += float((differs & rep).sum())


def hf_aux_loss(counts: torch.Tensor, prob_sum: torch.Tensor, tokens: float, num_experts: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func``: ``E * sum_e (counts_e / N) * (prob_sum_e / N)``,
    with the sums taken over every layer's real tokens (``N`` = tokens x layers)."""
    n = max(float(tokens), 1.0)
    return (counts / n * (prob_sum / n)).sum() * num_experts


@functools.cache
def router_class() -> type:
    """``RealflowRouter``: megatron's ``TopKRouter`` with HF routing, replay and statistics (module
    docstring).  Made on first use, so importing this module does not import megatron."""
    from megatron.core.transformer.moe.router import TopKRouter

    class RealflowRouter(TopKRouter):
        """megatron's router module, routing as transformers does, with replay and statistics."""

        context: Optional[RoutingContext] = None

        def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):  # noqa: A002
            logits = self.gating(input)
            flat = logits.reshape(-1, self.config.num_moe_experts)
            probs_all = torch.softmax(flat, dim=-1, dtype=torch.float32)
            own = torch.topk(probs_all, self.topk, dim=-1).indices
            ctx = self.context
            chosen, replayed = own, None
            layer = (self.layer_number or 1) - 1
            if ctx is not None and layer in ctx.replay:
                target = ctx.replay[layer].to(device=own.device, dtype=torch.long)
                if target.shape != own.shape:
                    raise ValueError(f"routing replay for layer {layer}: experts of shape {tuple(target.shape)}, "
                                     f"the router has {tuple(own.shape)} (tokens, top-k)")
                replayed = target[:, 0] >= 0
                chosen = torch.where(replayed[:, None], target, own)
            weights = probs_all.gather(1, chosen)
            norm = ctx.norm_topk_prob if ctx is not None else not self.config.moe_router_pre_softmax
            if norm:
                weights = weights / weights.sum(-1, keepdim=True)
            probs = torch.zeros_like(probs_all).scatter(1, chosen, weights).to(logits.dtype)
            routing_map = torch.zeros_like(probs_all, dtype=torch.bool).scatter(1, chosen, True)
            if ctx is not None:
                ctx.record(own, chosen, probs_all, replayed)
            return probs, routing_map

    return RealflowRouter


def install_routing_context(model: torch.nn.Module, norm_topk_prob: bool) -> Optional[RoutingContext]:
    """One :class:`RoutingContext` shared by every ``RealflowRouter`` of ``model`` (None: dense)."""
    routers = [m for m in model.modules() if isinstance(m, router_class())]
    if not routers:
        return None
    cfg: Any = routers[0].config
    ctx = RoutingContext(num_experts=int(cfg.num_moe_experts), topk=int(cfg.moe_router_topk),
                         norm_topk_prob=norm_topk_prob)
    for r in routers:
        r.context = ctx
    return ctx
