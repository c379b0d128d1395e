"""Mixture-of-experts facts shared by the model builder, the HF loader/saver and reallocation.

Experts live in megatron-core's ``SequentialMLP`` (``mlp.experts.local_experts.{j}``, ``j``
local), the router in ``mlp.router``.  With expert parallelism ``ep`` (see
:class:`realflow.api.allocation.ParallelStrategy`) rank ``r`` of an expert-parallel group
holds the experts ``[r*E/ep, (r+1)*E/ep)``, each whole; without it every rank holds every
expert, split over tp like a dense MLP.  The checkpoint table names experts by GLOBAL index;
these helpers turn that into a rank's local name.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

from parallel.model_config import moe_arch, num_experts_of

__all__ = ["local_experts", "local_expert_name", "moe_layout_problem", "expert_parallel_of",
           "check_moe_options", "aux_loss_coef_of"]

_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global indices of the experts held by ``ep_rank`` of an expert-parallel group of ``ep``."""
    n = num_experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)


def local_expert_name(name: str, expert: int, num_experts: int, ep: int, ep_rank: int) -> Optional[str]:
    """``name`` (global expert index) as ``ep_rank`` calls it, or None when it holds another expert."""
    held = local_experts(num_experts, ep, ep_rank)
    if expert not in held:
        return None
    return _EXPERT.sub(lambda m: f"{m.group(1)}{expert - held.start}.", name, count=1)


def expert_parallel_of(model: torch.nn.Module) -> tuple[int, int]:
    """(ep, ep_rank) of a built megatron model: (1, 0) for a dense one."""
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        mlp = getattr(layer, "mlp", None)
        idx = getattr(mlp, "local_expert_indices", None)
        if idx:
            n_local = len(idx)
            total = int(mlp.config.num_moe_experts)
            return total // n_local, idx[0] // n_local
    return 1, 0


def moe_layout_problem(hf_config: Any, dp: int, tp: int, ep: int) -> Optional[str]:
    """Why an MoE (or dense) model cannot take expert parallelism ``ep``; None when it can."""
    moe = moe_arch(hf_config)
    if moe is None:
        if ep > 1:
            experts = num_experts_of(hf_config)
            kind = f"model_type={_get(hf_config, 'model_type')!r}"
            return (f"expert parallel e{ep} needs a mixture-of-experts model; this one is dense ({kind}"
                    f"{f', num_experts={experts}' if experts else ''}): drop e{ep} from the layout")
        return None
    if moe.num_experts % ep:
        return (f"expert parallel e{ep} does not divide num_experts={moe.num_experts} (each rank of an "
                f"expert-parallel group holds num_experts/e whole experts)")
    if ep == 1 and moe.ffn % tp:
        return (f"tp={tp} does not divide moe_intermediate_size={moe.ffn} (without expert parallelism "
                f"experts are split over tp like a dense MLP; or shard them whole with e{tp})")
    return None


def check_moe_options(spec: Any, hf_config: Any, what: str) -> None:
    """Plan-time checks of ``spec.moe`` (and LoRA) against the model: one line each, naming the key."""
    from realflow.api.backend import LayoutError

    opts = getattr(spec, "moe", None)
    moe = moe_arch(hf_config)
    if moe is None:
        if opts is not None and opts.routing_replay == "rollout":
            raise LayoutError(f"{what}: moe.routing_replay=rollout needs a mixture-of-experts model; this one "
                              f"is dense (model_type={_get(hf_config, 'model_type')!r}): set moe.routing_replay=off")
        if opts is not None and opts.aux_loss_coef is not None:
            raise LayoutError(f"{what}: moe.aux_loss_coef is set but the model is dense "
                              f"(model_type={_get(hf_config, 'model_type')!r}): remove it")
        return
    lora = getattr(spec, "lora", None)
    if lora is not None and lora.enabled:
        raise LayoutError(f"{what}: LoRA on a mixture-of-experts model is not supported yet "
                          f"(adapters on every expert); train it fully (model.lora.enabled=false)")


def aux_loss_coef_of(spec_moe: Any, hf_config: Any) -> float:
    """The load-balancing coefficient a run uses: ``moe.aux_loss_coef`` or the checkpoint's."""
    moe = moe_arch(hf_config)
    if moe is None:
        return 0.0
    if spec_moe is not None and spec_moe.aux_loss_coef is not None:
        return float(spec_moe.aux_loss_coef)
    return moe.aux_loss_coef


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    from parallel.model_config import config_value

    return config_value(cfg, key, default)
