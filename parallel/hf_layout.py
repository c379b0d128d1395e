"""HF checkpoints <-> a model laid out in any (dp, tp, pp): sliced load, gathered save.

Load: every rank reads ONLY the bytes of its own tp slice of its own pipeline
stage's tensors (safetensors ``get_slice``), from the :func:`param_table` rows.
:func:`plan_hf_load` validates everything (presence, HF shapes, the local
megatron shapes) from the headers and raises :class:`CheckpointError` before
any tensor is read; :func:`execute_hf_load` then copies.  The engine agrees on
the plan over all ranks of the model between the two, so a bad checkpoint
fails on every rank instead of leaving some waiting in a collective.

Save: :func:`gather_hf_state_any` gathers tp shards to tp rank 0 of each stage
of dp replica 0 (``dist.gather``), converts them to HF tensors there, and sends
each stage's tensors to the writer (dp 0, tp 0, pp 0) point to point, in table
order; the writer knows every name, shape and dtype from the table, so nothing
but raw tensors crosses the wire.

:func:`check_layout` rejects layouts the model cannot take before anything is
built (pp > layers, tp not dividing heads / kv heads / ffn).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel.hf_io import (
    CheckpointError,
    ParamMapping,
    _named_params,
    _weight_index,
    hf_to_mcore,
    local_param_table,
    mcore_to_hf,
    param_table,
    tp_unshard,
)
from parallel.model_config import HFArch

__all__ = ["model_param_table", "check_layout", "read_tp_slice", "HFLoadPlan", "plan_hf_load",
           "execute_hf_load", "owner_stage", "gather_hf_state_any"]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    from parallel.model_config import config_value

    return config_value(cfg, key, default)


def _num_query_groups(hf_config: Any) -> int:
    return int(_get(hf_config, "num_key_value_heads") or _get(hf_config, "num_attention_heads"))


def model_param_table(hf_config: Any, arch: HFArch, critic: bool = False) -> list[ParamMapping]:
    """:func:`param_table` for an LM, or the trunk + value head rows for a critic."""
    table = param_table(hf_config, arch)
    if not critic:
        return table
    from parallel.critic import critic_head_table

    return [e for e in table if e.mcore_name != "output_layer.weight"] + \
        critic_head_table(hf_config, arch)


def check_layout(hf_config: Any, dp: int, tp: int, pp: int, ep: int = 1) -> None:
    """ValueError naming the field when (dp, tp, pp, ep) cannot hold the model."""
    from parallel.moe import moe_layout_problem

    layers = int(_get(hf_config, "num_hidden_layers"))
    heads = int(_get(hf_config, "num_attention_heads"))
    groups = _num_query_groups(hf_config)
    where = f"layout d{dp}t{tp}p{pp}" + (f"e{ep}" if ep > 1 else "")
    problem = moe_layout_problem(hf_config, dp, tp, ep)
    if problem:
        raise ValueError(f"{where}: {problem}")
    # an MoE model's layers are all sparse: its dense intermediate_size is never built
    ffn = int(_get(hf_config, "intermediate_size")) if problem is None and not _is_moe(hf_config) else tp
    if pp > layers:
        raise ValueError(f"{where}: pp={pp} > num_hidden_layers={layers} (a stage needs a layer)")
    if layers % pp:
        raise ValueError(f"{where}: num_hidden_layers={layers} is not divisible by pp={pp}")
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                        ("intermediate_size", ffn)):
        if value % tp:
            raise ValueError(f"{where}: {name}={value} is not divisible by tp={tp}")


def _is_moe(hf_config: Any) -> bool:
    from parallel.model_config import moe_arch

    return moe_arch(hf_config) is not None


def owner_stage(entry: ParamMapping, num_layers: int, pp: int) -> int:
    """Pipeline stage that holds (and saves) ``entry``: layers split evenly."""
    if entry.layer is not None:
        return entry.layer // (num_layers // pp)
    return 0 if entry.mcore_name.startswith(("embedding.", "visual.")) else pp - 1


# --------------------------------------------------------------------------- load


def read_tp_slice(entry: ParamMapping, get_slice: Callable[[str], Any], tp_rank: int,
                  tp_size: int, padded_vocab: int, num_query_groups: int) -> torch.Tensor:
    """This tp rank's megatron tensor for ``entry``, reading only its HF slices.

    ``get_slice(name)`` returns a safetensors slice (``f.get_slice(name)``).  Equals
    ``tp_shard(entry, hf_to_mcore(entry, full_tensors, ...), tp_rank, tp_size)``.
    """
    names = entry.hf_names
    if entry.tp_dim is None or tp_size == 1:
        full = [get_slice(n)[:] for n in names]
        return hf_to_mcore(entry, full, padded_vocab, num_query_groups)
    r = tp_rank
    if entry.kind == "copy":
        n = entry.hf_shapes[0][entry.tp_dim] // tp_size
        idx = (slice(None),) * entry.tp_dim + (slice(r * n, (r + 1) * n),)
        return get_slice(names[0])[idx]
    if entry.kind == "vocab":
        rows = padded_vocab // tp_size
        lo, hi = r * rows, (r + 1) * rows
        vocab, rest = entry.hf_shapes[0][0], entry.hf_shapes[0][1:]
        part = get_slice(names[0])[lo:min(hi, vocab)] if lo < vocab else None
        have = 0 if part is None else part.shape[0]
        pad = torch.zeros((rows - have, *rest), dtype=part.dtype if part is not None else
                          torch.float32)
        return pad if part is None else torch.cat([part, pad.to(part.dtype)], 0)
    if entry.kind == "gate_up":
        n = entry.hf_shapes[0][0] // tp_size
        return torch.cat([get_slice(h)[r * n:(r + 1) * n] for h in names], 0)
    if entry.kind == "qkv":  # whole query groups per rank: [q_g; k_g; v_g] for the rank's groups
        ng_local = num_query_groups // tp_size
        parts = []
        for h, shape in zip(names, entry.hf_shapes):
            per_group = shape[0] // num_query_groups
            a = r * ng_local * per_group
            parts.append(get_slice(h)[a:a + ng_local * per_group])
        return hf_to_mcore(entry, parts, padded_vocab, ng_local)
    raise AssertionError(entry.kind)


@dataclass
class HFLoadPlan:
    """A validated load: (entry, local param name) pairs and where their tensors live."""

    path: str
    index: dict[str, str]  # HF name -> file
    items: list[tuple[ParamMapping, str]]
    skipped: list[ParamMapping]  # value-head rows absent from an LM checkpoint (zero init)


def plan_hf_load(model: torch.nn.Module, path: str, hf_config: Any, arch: HFArch, tp_rank: int,
                 tp_size: int, critic: bool = False) -> HFLoadPlan:
    """Validate ``path`` against this rank's part of ``model`` (headers only).

    Raises :class:`CheckpointError` (one line naming tensor and file) on a missing
    tensor, a wrong HF shape, or a megatron parameter whose shape the config does
    not imply.  A critic may load an LM checkpoint: missing ``score.*`` rows are
    skipped (the head keeps its zero init).
    """
    from safetensors import safe_open

    from parallel.moe import expert_parallel_of

    table = model_param_table(hf_config, arch, critic)
    local = local_param_table(model, table)
    params = _named_params(model)
    ep = expert_parallel_of(model)[0]
    index = _weight_index(path)
    skipped = []
    if critic and "score.weight" not in index:
        skipped = [e for e, _ in local if e.hf_names[0].startswith("score.")]
        local = [(e, p) for e, p in local if not e.hf_names[0].startswith("score.")]
    shapes: dict[tuple[str, str], tuple[int, ...]] = {}
    for fn in sorted({index[n] for e, _ in local for n in e.hf_names if n in index}):
        if not os.path.isfile(fn):
            raise CheckpointError(f"checkpoint shard {fn} listed in the index is missing")
        with safe_open(fn, "pt") as f:
            names = set(f.keys())
            for e, _ in local:
                for n in e.hf_names:
                    if index.get(n) == fn and n in names:
                        shapes[(fn, n)] = tuple(f.get_slice(n).get_shape())
    for e, pname in local:
        for n, want in zip(e.hf_names, e.hf_shapes):
            if n not in index:
                raise CheckpointError(f"tensor {n} missing from checkpoint {path} "
                                      f"(needed for megatron {e.mcore_name})")
            got = shapes.get((index[n], n))
            if got is None:
                raise CheckpointError(f"tensor {n} is listed in the index of {path} but "
                                      f"missing from {index[n]}")
            if got != want:
                raise CheckpointError(f"tensor {n} in {index[n]} has shape {list(got)}, "
                                      f"model expects {list(want)}")
        full = e.mcore_shape if e.kind != "vocab" else (arch.padded_vocab_size, *e.mcore_shape[1:])
        local_shape = list(full)
        if e.tp_dim is not None and e.tp_in(tp_size, ep) > 1:
            local_shape[e.tp_dim] //= tp_size
        if tuple(local_shape) != tuple(params[pname].shape):
            raise CheckpointError(f"megatron parameter {pname} has shape "
                                  f"{list(params[pname].shape)}, the HF config implies "
                                  f"{local_shape} (checkpoint {path})")
    return HFLoadPlan(path, index, local, skipped)


def execute_hf_load(model: torch.nn.Module, plan: HFLoadPlan, hf_config: Any, arch: HFArch,
                    tp_rank: int, tp_size: int) -> None:
    """Copy the planned slices into ``model`` (in place, exact, only this rank's bytes)."""
    from safetensors import safe_open

    from parallel.moe import expert_parallel_of

    params = _named_params(model)
    ng = _num_query_groups(hf_config)
    ep = expert_parallel_of(model)[0]
    with contextlib.ExitStack() as stack, torch.no_grad():
        files: dict[str, Any] = {}

        def get_slice(name: str) -> Any:
            fn = plan.index[name]
            if fn not in files:
                files[fn] = stack.enter_context(safe_open(fn, "pt"))
            return files[fn].get_slice(name)

        for e, pname in plan.items:
            p = params[pname]
            tp = e.tp_in(tp_size, ep)
            t = read_tp_slice(e, get_slice, tp_rank if tp > 1 else 0, tp, arch.padded_vocab_size, ng)
            p.data.copy_(t.to(p.dtype))


# --------------------------------------------------------------------------- save


def gather_hf_state_any(model: torch.nn.Module, groups: Any, hf_config: Any, arch: HFArch,
                        critic: bool = False,
                        tensor_of: Optional[Callable[[torch.nn.Parameter], torch.Tensor]] = None,
                        dtype: Optional[torch.dtype] = None,
                        table: Optional[list[ParamMapping]] = None) -> Optional[dict[str, torch.Tensor]]:
    """The whole model as HF-named CPU tensors on the writer (dp 0, tp 0, pp 0); None elsewhere.

    Collective over the ranks of dp replica 0 and, with expert parallelism, the expert-parallel
    group of each stage's head (which may reach into other dp replicas: their experts are
    gathered whole); every other rank returns None at once.
    ``tensor_of`` picks what to gather per parameter (default: its data; e.g.
    ``lambda p: p.main_grad`` for gradients); ``dtype`` is the wire/result dtype
    (default: the parameters' dtype); ``table`` the rows to gather (default: the model's own;
    e.g. :func:`parallel.lora.lora_param_table` for LoRA adapters).
    """
    s = groups.strategy
    ep = getattr(s, "ep", 1)
    in_head_ep_group = ep > 1 and groups.dp_rank * s.tp + groups.tp_rank < ep
    if groups.dp_rank != 0 and not in_head_ep_group:
        return None
    tensor_of = tensor_of or (lambda p: p.detach())
    table = model_param_table(hf_config, arch, critic) if table is None else table
    ng = _num_query_groups(hf_config)
    num_layers = int(_get(hf_config, "num_hidden_layers"))
    params = _named_params(model)
    dtype = dtype or next(iter(params.values())).dtype
    mine = [(e, pname) for e, pname in local_param_table(model, table)
            if owner_stage(e, num_layers, s.pp) == groups.pp_rank]
    stage_head = groups.dp_rank == 0 and groups.tp_rank == 0
    hf: dict[str, torch.Tensor] = {}
    if in_head_ep_group:
        hf.update(_gather_experts([(e, params[p]) for e, p in mine if e.expert is not None], groups,
                                  tensor_of, dtype, stage_head))
    if groups.dp_rank != 0:
        return None
    for e, pname in mine:
        if e.expert is not None and ep > 1:
            continue
        t = tensor_of(params[pname]).to(device="cpu", dtype=dtype).contiguous()
        if e.tp_dim is not None and s.tp > 1 and e.tp_in(s.tp, ep) > 1:
            dst = groups.rank_at(dp=0, tp=0, pp=groups.pp_rank)
            shards = [torch.empty_like(t) for _ in range(s.tp)] if stage_head else None
            dist.gather(t, shards, dst=dst, group=groups.tp_group)
            if not stage_head:
                continue
            t = tp_unshard(e, shards)
        elif not stage_head:
            continue
        for n, v in mcore_to_hf(e, t, ng).items():
            hf[n] = v.contiguous().clone()
    if not stage_head or s.pp == 1:
        return hf if stage_head else None
    writer = groups.rank_at(dp=0, tp=0, pp=0)
    if groups.pp_rank != 0:
        for e in table:
            if owner_stage(e, num_layers, s.pp) == groups.pp_rank:
                for n in e.hf_names:
                    dist.send(hf[n], dst=writer, group=groups.pp_group)
        return None
    for stage in range(1, s.pp):
        src = groups.rank_at(dp=0, tp=0, pp=stage)
        for e in table:
            if owner_stage(e, num_layers, s.pp) != stage:
                continue
            for n, shape in zip(e.hf_names, e.hf_shapes):
                buf = torch.empty(shape, dtype=dtype)
                dist.recv(buf, src=src, group=groups.pp_group)
                hf[n] = buf
    return hf


def _gather_experts(local: list[tuple[ParamMapping, torch.nn.Parameter]], groups: Any,
                    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor], dtype: torch.dtype,
                    stage_head: bool) -> dict[str, torch.Tensor]:
    """Every expert of this stage, whole, on the stage head (HF names); {} on the other ranks.

    Each rank of the head's expert-parallel group holds ``E/ep`` whole experts; per (layer,
    linear) they are stacked and gathered in one collective, in expert order (group rank r
    holds experts ``[r*E/ep, (r+1)*E/ep)``).
    """
    by_kind: dict[tuple[int, str], list[tuple[ParamMapping, torch.nn.Parameter]]] = {}
    for e, p in local:
        by_kind.setdefault((e.layer, e.mcore_name.rsplit(".", 2)[-2]), []).append((e, p))
    ep = groups.strategy.ep
    dst = groups.rank_at(dp=0, tp=0, pp=groups.pp_rank)
    out: dict[str, torch.Tensor] = {}
    for key in sorted(by_kind):
        rows = sorted(by_kind[key], key=lambda ep_: ep_[0].expert)
        mine = torch.stack([tensor_of(p).to(device="cpu", dtype=dtype) for _, p in rows]).contiguous()
        parts = [torch.empty_like(mine) for _ in range(ep)] if stage_head else None
        dist.gather(mine, parts, dst=dst, group=groups.ep_group)
        if not stage_head:
            continue
        n_local = len(rows)
        template = rows[0][0]
        for r, part in enumerate(parts):
            for k in range(n_local):
                j = r * n_local + k
                e = _expert_row(template, j)
                for n, v in mcore_to_hf(e, part[k], 0).items():
                    out[n] = v.contiguous().clone()
    return out


def _expert_row(template: ParamMapping, expert: int) -> ParamMapping:
    """``template`` (a row of expert ``template.expert``) renamed for ``expert``."""
    old, new = f".{template.expert}.", f".{expert}."
    swap = lambda name, marker: name.replace(f"{marker}{old}", f"{marker}{new}", 1)  # noqa: E731
    return ParamMapping(swap(template.mcore_name, "local_experts"),
                        tuple(swap(n, "experts") for n in template.hf_names), template.hf_shapes,
                        template.kind, template.tp_dim, template.layer, expert)
