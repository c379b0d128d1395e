"""One engine's exact training state on this rank, for recover points.

What is saved is what this rank holds, in its own layout: the local parameter shards, the
distributed optimizer's shard of Adam moments and master weights, the learning-rate
schedule position, the loss scale and the weight version. A recover point is resumed only
by the same layout (the recover fingerprint checks the allocation), so rank ``r`` reads
back exactly what rank ``r`` wrote and no resharding is needed; copying in place keeps
every alias (DDP's contiguous parameter buffer, the generation engine's shared weights)
valid. Restoring is bit-exact: a resumed run computes the same numbers as one that never
stopped.

Values are plain tensors, numbers and lists, so the file loads with
``torch.load(weights_only=True)`` (no arbitrary objects are unpickled).
"""
from __future__ import annotations

from typing import Any

import torch

_GROUP_SCALARS = (int, float, bool)


def _inner(engine: Any) -> Any:
    """The torch optimizer over this rank's shard (inside megatron's DistributedOptimizer)."""
    return engine.optimizer.optimizer


def _shard_params(engine: Any) -> list[torch.Tensor]:
    return [p for g in _inner(engine).param_groups for p in g["params"]]


def engine_local_state(engine: Any) -> dict[str, Any]:
    """This rank's part of ``engine``'s state (CPU copies)."""
    state: dict[str, Any] = {
        "version": int(engine.version),
        "params": {n: p.detach().to("cpu", copy=True) for n, p in engine.module.named_parameters()},
        "buffers": {n: b.detach().to("cpu", copy=True) for n, b in engine.module.named_buffers()},
    }
    if engine.optimizer is None:
        return state
    inner = _inner(engine)
    state["shard"] = [p.detach().to("cpu", copy=True) for p in _shard_params(engine)]
    state["moments"] = [{k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                         for k, v in inner.state.get(p, {}).items()} for p in _shard_params(engine)]
    state["groups"] = [{k: v for k, v in g.items() if k != "params" and isinstance(v, _GROUP_SCALARS)}
                       for g in inner.param_groups]
    state["schedule_steps"] = int(engine.scheduler.num_steps)
    scaler = getattr(engine.optimizer, "grad_scaler", None)
    if scaler is not None:
        state["grad_scaler"] = {k: v.detach().cpu() if torch.is_tensor(v) else v
                                for k, v in scaler.state_dict().items()}
    return state


def load_engine_local_state(engine: Any, state: dict[str, Any]) -> None:
    """Restore what :func:`engine_local_state` returned on the same rank of the same layout."""
    _copy_named(engine.module.named_parameters(), state["params"], "parameter")
    _copy_named(engine.module.named_buffers(), state["buffers"], "buffer")
    engine.version = int(state["version"])
    if engine.optimizer is None:
        if "shard" in state:
            raise ValueError("the recover point holds optimizer state for an engine built without an optimizer")
        return
    if "shard" not in state:
        raise ValueError("the recover point holds no optimizer state for this trainable engine")
    inner = _inner(engine)
    params = _shard_params(engine)
    if len(params) != len(state["shard"]):
        raise ValueError(f"optimizer shard has {len(params)} tensors here, {len(state['shard'])} in the point")
    with torch.no_grad():
        for p, saved, moments in zip(params, state["shard"], state["moments"]):
            _check_shape("optimizer shard", p, saved)
            p.copy_(saved)
            if moments:
                inner.state[p] = {k: v.to(p.device).clone() if torch.is_tensor(v) else v for k, v in moments.items()}
            else:
                inner.state.pop(p, None)
    for g, saved in zip(inner.param_groups, state["groups"]):
        g.update(saved)
    engine.scheduler.num_steps = int(state["schedule_steps"])
    engine.scheduler.step(increment=0)  # lr and weight decay of the restored position
    if "grad_scaler" in state:
        engine.optimizer.grad_scaler.load_state_dict(state["grad_scaler"])


def _copy_named(current: Any, saved: dict[str, torch.Tensor], what: str) -> None:
    current = dict(current)
    missing, extra = sorted(set(saved) - set(current)), sorted(set(current) - set(saved))
    if missing or extra:
        raise ValueError(f"recover point {what}s differ from this engine's: "
                         f"only in the point {missing[:3]}, only here {extra[:3]}")
    with torch.no_grad():
        for name, t in current.items():
            _check_shape(f"{what} {name}", t, saved[name])
            t.copy_(saved[name])


def _check_shape(what: str, t: torch.Tensor, saved: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(saved.shape) or t.dtype != saved.dtype:
        raise ValueError(f"recover point {what}: {tuple(saved.shape)} {saved.dtype} in the point, "
                         f"{tuple(t.shape)} {t.dtype} here")
