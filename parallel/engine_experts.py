"""Every expert on every rank, for a colocated generator of an expert-parallel trainer.

With expert parallelism (``e<N>``) a trainer rank holds ``E/N`` whole experts; its colocated
generator decodes its own data-parallel share of the prompts and must run any expert a token
picks.  Why gather rather than dispatch tokens during decoding: decode steps are tiny and many,
and an all-to-all per layer per step between ranks that each decode their own batch would tie
their loops together; a gather per weight version costs one collective per (layer, linear), the
same bytes as a reallocation of the experts.  The gathered copies are then split over tp like a
dense MLP (the generator's layout), and refreshed in place when the weights move.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel.hf_io import ParamMapping, local_param_table, param_table, tp_shard

__all__ = ["needs_expert_gather", "gathered_expert_weights", "refresh_gathered_experts"]


def needs_expert_gather(engine: Any) -> bool:
    return engine.arch.moe is not None and engine.groups.strategy.ep > 1


def _expert_rows(engine: Any) -> dict[tuple[int, str], list[tuple[ParamMapping, str]]]:
    """(stage-local layer, linear) -> this rank's expert rows, sorted by global expert index."""
    table = param_table(engine.hf_config, engine.arch)
    rows: dict[tuple[int, str], list[tuple[ParamMapping, str]]] = {}
    for e, local in local_param_table(engine.module, table):
        if e.expert is not None:
            layer = int(local.split(".")[2])
            rows.setdefault((layer, local.rsplit(".", 2)[-2]), []).append((e, local))
    return {k: sorted(v, key=lambda r: r[0].expert) for k, v in rows.items()}


def _gather(engine: Any, out: dict[str, torch.Tensor]) -> None:
    """All experts of each (layer, linear), gathered over the ep group and cut to this tp rank,
    written into ``out`` (new tensors the first time, in place after)."""
    g = engine.groups
    ep, tp = g.strategy.ep, g.strategy.tp
    params = dict(engine.module.named_parameters())
    for (layer, linear), rows in sorted(_expert_rows(engine).items()):
        mine = torch.stack([params[name].detach() for _, name in rows]).contiguous()
        parts = [torch.empty_like(mine) for _ in range(ep)]
        dist.all_gather(parts, mine, group=g.ep_group)
        every = torch.cat(parts)  # [E, ...] in global expert order
        template = rows[0][0]
        for j in range(every.shape[0]):
            name = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.{linear}.weight"
            piece = tp_shard(template, every[j], g.tp_rank, tp)
            if name in out and out[name].shape == piece.shape:
                out[name].copy_(piece)
            else:
                out[name] = piece.clone()


def gathered_expert_weights(engine: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (megatron names of this rank) with its local experts replaced by all of them
    (global indices, tp-split): collective over the model's expert-parallel groups."""
    out = {n: t for n, t in weights.items() if ".mlp.experts.local_experts." not in n}
    copies: dict[str, torch.Tensor] = {}
    _gather(engine, copies)
    engine._gathered_experts = copies
    out.update(copies)
    return out


def refresh_gathered_experts(engine: Any) -> None:
    """Re-gather after the experts changed (an optimizer step, a reallocation): in place, so a
    generator holding the tensors sees the new weights.  Collective like the first gather."""
    copies = getattr(engine, "_gathered_experts", None)
    if copies is not None:
        _gather(engine, copies)
