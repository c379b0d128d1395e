"""What an MoE model adds to each micro-batch of a forward(-backward) schedule.

Before a micro-batch's forward, :class:`MoEStep` tells the model's routers
(:class:`parallel.moe_router.RoutingContext`) which of the ``[s, b]`` tokens are real and, with
routing replay, which experts the generator chose for them (a packed ``[tokens, layers, k]``
integer tensor aligned with the micro-batch's ``input_ids``; ``-1`` rows keep the router's own
choice).  A pad-free micro-batch (:mod:`parallel.packed_batch`) is the ``b = 1`` case: megatron's
dropless MoE routes every token on its own, so only the real-token mask and the sequence ends
need the layout.  After it, the routers' totals become the load-balancing loss and the statistics.

The load-balancing loss is transformers' (:func:`parallel.moe_router.hf_aux_loss`) over the
micro-batch's real tokens and this stage's layers, summed over the tensor-parallel ranks that
hold parts of the sequence.  It joins the gradient as megatron's ``MoEAuxLossAutoScaler``
does (an identity on the stage's output whose backward adds ``d aux``), weighted like the
micro-batch's loss: the update minimises ``sum(loss sums) / W + coef * sum_m (w_m / W) aux_m``,
i.e. exactly ``loss + coef * aux`` of transformers for one micro-batch on one rank.  With
pipeline parallelism each stage's aux covers its own layers (the counts of later stages are
not known when an earlier stage's gradient is formed), a stage-local form of HF's loss.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel.moe_router import RoutingContext, hf_aux_loss
from parallel.packing import PaddedBatch, sequence_ends

__all__ = ["MoEStep", "build_moe_step"]



class _AddAuxGradient(torch.autograd.Function):
    """Identity on ``output``; its backward also sends ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, ctx.scale), None


def _router_order(x: torch.Tensor, tp: int, tp_rank: int, sequence_parallel: bool) -> torch.Tensor:
    """``[b, s, ...]`` -> the routers' token order: ``[s, b]`` flattened, this rank's part of s."""
    x = x.transpose(0, 1)
    if sequence_parallel and tp > 1:
        x = x.chunk(tp, 0)[tp_rank]
    return x.reshape(-1, *x.shape[2:])


class MoEStep:
    """Routing inputs in, aux loss and statistics out, per micro-batch (module docstring)."""

    def __init__(self, ctx: RoutingContext, groups: Any, sequence_parallel: bool, aux_coef: float,
                 replay: bool) -> None:
        self.ctx, self.groups, self.sp = ctx, groups, sequence_parallel
        self.aux_coef, self.replay = float(aux_coef), bool(replay)
        self.aux_scale_of: Optional[Callable[[int], float]] = None  # set per train step
        self.totals: list[dict[str, float]] = []  # per micro-batch: aux, imbalance, replay counts
        self._index = 0

    def start(self, aux_scale_of: Optional[Callable[[int], float]]) -> None:
        """A new schedule: ``aux_scale_of(i)`` is micro-batch i's gradient weight (None: no aux)."""
        self.aux_scale_of, self.totals, self._index = aux_scale_of, [], 0

    def before(self, pb: PaddedBatch, routes: Optional[torch.Tensor], training: bool) -> None:
        s = self.groups.strategy
        valid = _router_order(pb.valid, s.tp, self.groups.tp_rank, self.sp)
        replay = None
        if self.replay and routes is not None:
            b, n = pb.valid.shape
            padded = torch.full((b, n, *routes.shape[1:]), -1, dtype=torch.long, device=pb.valid.device)
            padded[pb.valid] = routes.to(device=pb.valid.device, dtype=torch.long)
            # each sequence's last token never ran as the generator's input: its row is a filler,
            # so it routes on its own (it feeds no prediction, and the statistics skip it)
            padded[sequence_ends(pb)] = -1
            ordered = _router_order(padded, s.tp, self.groups.tp_rank, self.sp)  # [T, L, k]
            replay = {layer: ordered[:, layer] for layer in range(ordered.shape[1])}
        want_grad = training and self.aux_coef > 0 and self.aux_scale_of is not None
        self.ctx.begin(valid, replay, want_grad)

    def after(self, output: torch.Tensor, training: bool) -> torch.Tensor:
        t = self.ctx.finish()
        i, self._index = self._index, self._index + 1
        if t is None:
            return output
        counts = torch.stack(t.layer_counts)  # [layers, E]
        plain = torch.tensor([t.tokens, t.replayed, t.replay_differs], dtype=torch.float64)
        prob_sum = t.prob_sum
        if self.sp and self.groups.strategy.tp > 1:  # the tp ranks hold parts of the same sequences
            from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

            dist.all_reduce(counts, group=self.groups.tp_group)
            dist.all_reduce(plain, group=self.groups.tp_group)
            prob_sum = reduce_from_tensor_model_parallel_region(prob_sum, group=self.groups.tp_group)
        tokens, replayed, differs = plain.tolist()
        aux = hf_aux_loss(counts.sum(0), prob_sum, tokens, self.ctx.num_experts)
        mean = counts.sum(-1, keepdim=True) / counts.shape[-1]
        imbalance = float((counts.max(-1, keepdim=True).values / mean.clamp_min(1e-9)).max())
        self.totals.append({"aux": float(aux.detach()), "imbalance": imbalance, "replayed": replayed,
                            "differs": differs})
        if training and self.aux_scale_of is not None and self.aux_coef > 0 and aux.requires_grad:
            output = _AddAuxGradient.apply(output, aux, self.aux_coef * self.aux_scale_of(i))
        return output

    def reduced_stats(self) -> dict[str, float]:
        """The schedule's routing statistics, the same on every rank of the model (collective over
        the model's ranks): ``moe/aux_loss`` (mean per micro-batch, all layers), ``moe/expert_load``
        (the busiest expert's tokens over the mean, worst layer, mean over micro-batches) and, with
        replay, ``moe/replay_mismatch`` (the fraction of replayed tokens x layers whose experts differ
        from the trainer router's own top-k) and ``moe/replayed_tokens``."""
        g = self.groups
        head = g.tp_rank == 0  # values are already summed over tp
        first = g.pp_rank == 0
        sums = torch.zeros(5, dtype=torch.float64)
        if head:
            for t in self.totals:
                sums[:4] += torch.tensor([t["aux"], float(first), t["replayed"], t["differs"]],
                                         dtype=torch.float64)
            sums[4] = sum(t["imbalance"] for t in self.totals)
        if len(g.ranks) > 1:
            dist.all_reduce(sums, group=g.model_group)
        aux, n_mbs, replayed, differs, imbalance = sums.tolist()
        n_head_mbs = max(n_mbs, 1.0)
        out = {"moe/aux_loss": aux / n_head_mbs, "moe/expert_load": imbalance / n_head_mbs / g.strategy.pp}
        if self.replay:
            out["moe/replayed_tokens"] = replayed
            out["moe/replay_mismatch"] = differs / replayed if replayed else 0.0
        return out


def build_moe_step(module: torch.nn.Module, arch: Any, groups: Any, config: Any, hf_config: Any,
                   options: Any = None) -> Optional[MoEStep]:
    """The :class:`MoEStep` of a built model (None for a dense one).  ``options``: the model's
    :class:`realflow.api.model_options.MoEConfig` (routing replay unless ``off``; the aux loss
    coefficient, default the checkpoint's)."""
    from parallel.moe import aux_loss_coef_of
    from parallel.moe_router import install_routing_context

    if arch.moe is None:
        return None
    ctx = install_routing_context(module, arch.moe.norm_topk_prob)
    if ctx is None:
        return None
    replay = options is None or options.routing_replay != "off"
    return MoEStep(ctx, groups, bool(config.sequence_parallel), aux_loss_coef_of(options, hf_config), replay)
