"""Routed experts (rollout routing replay, R3) between generators and the trainer: one format.

An MoE generator reports, per sequence, the experts every input token was routed to:
``[len(prompt) + len(output) - 1, num_layers, topk]`` global expert ids (the last output token
is never run as input), see :class:`realflow.api.generation.GenerationResult`.  This module is
the one place that

* encodes it in a gen server's JSON answer (:func:`encode_routed_experts`): SGLang's key
  ``meta_info["routed_experts"]`` (base64 bytes), plus ``routed_experts_shape`` and
  ``routed_experts_dtype`` so the answer describes itself (1 byte per id up to 256 experts
  instead of SGLang's 4);
* decodes it from either server (:func:`decode_routed_experts`): ours by its shape and dtype,
  SGLang's (flat int32, no shape) with the model's ``topk`` and expert count;
* turns it into the per-token batch key :data:`realflow.api.keys.ROUTED_EXPERTS`
  (:func:`routed_experts_tensor`), aligned with ``packed_input_ids``.

Why base64 in JSON and not a list of lists: a 4k-token answer of a 48-layer top-8 model is 1.5M
ids; as JSON numbers that is ~5 MB and seconds of parsing, as base64 of uint8 2 MB and a memcpy.
"""
from __future__ import annotations

import base64
from typing import Any, Mapping, Optional

import numpy as np
import torch

__all__ = ["routing_numpy_dtype", "encode_routed_experts", "decode_routed_experts", "routed_experts_tensor", "moe_routing_of",
           "RoutingFormatError"]

_DTYPES = {"uint8": np.uint8, "int16": np.int16, "int32": np.int32}


class RoutingFormatError(ValueError):
    """An answer's routed experts do not fit what the request and the model say."""


def routing_numpy_dtype(num_experts: int) -> np.dtype:
    """The narrowest integer dtype that holds every expert id (uint8 up to 256 experts, else int16)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16)


def encode_routed_experts(arr: np.ndarray) -> dict[str, Any]:
    """The ``meta_info`` entries of one sequence's routed experts ``[rows, layers, topk]``."""
    arr = np.ascontiguousarray(arr)
    if arr.ndim != 3 or arr.dtype.name not in _DTYPES:
        raise RoutingFormatError(f"routed experts must be a [rows, layers, topk] array of "
                                 f"{sorted(_DTYPES)}, got {arr.dtype.name} {list(arr.shape)}")
    return {"routed_experts": base64.b64encode(arr.tobytes()).decode("ascii"),
            "routed_experts_shape": list(arr.shape), "routed_experts_dtype": arr.dtype.name}


def decode_routed_experts(meta: Mapping[str, Any], rows: int, topk: Optional[int] = None,
                          num_experts: Optional[int] = None) -> Optional[np.ndarray]:
    """One answer's routed experts ``[rows, layers, topk]`` from its ``meta_info`` (None if absent).

    ``rows`` is what the answer must cover (``len(prompt) + len(output) - 1``; an answer with no
    output may cover none).  SGLang's format (flat int32, no shape) needs ``topk``; with
    ``num_experts`` the ids are narrowed to :func:`routing_numpy_dtype` so every sample of a run
    has one dtype (the trainer's batch concatenates them).
    """
    raw = meta.get("routed_experts")
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise RoutingFormatError(f"meta_info.routed_experts must be a base64 string, got {type(raw).__name__}")
    data = base64.b64decode(raw)
    shape = meta.get("routed_experts_shape")
    if shape is not None:  # realflow's gen server
        dtype = _DTYPES.get(str(meta.get("routed_experts_dtype")))
        if dtype is None or not isinstance(shape, list) or len(shape) != 3:
            raise RoutingFormatError(f"routed_experts_shape={shape!r} / routed_experts_dtype="
                                     f"{meta.get('routed_experts_dtype')!r}: expected [rows, layers, topk] "
                                     f"and one of {sorted(_DTYPES)}")
        arr = np.frombuffer(data, dtype=dtype).reshape([int(x) for x in shape])
    else:  # SGLang: int32, [seqlen - 1, layers, topk] flattened
        if topk is None:
            raise RoutingFormatError("routed experts in SGLang's format (no shape) need the model's topk "
                                     "(num_experts_per_tok) to be decoded")
        flat = np.frombuffer(data, dtype=np.int32)
        if flat.size == 0:
            return None
        per_row = rows * topk
        if rows == 0 or flat.size % per_row:
            raise RoutingFormatError(f"{flat.size} routed expert ids do not fill {rows} rows of "
                                     f"top-{topk} per layer")
        arr = flat.reshape(rows, flat.size // per_row, topk)
    if arr.shape[0] not in (rows, 0):
        raise RoutingFormatError(f"routed experts cover {arr.shape[0]} tokens, the sequence has {rows} "
                                 f"input tokens (prompt + output - 1)")
    if num_experts is not None:
        if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
            raise RoutingFormatError(f"routed expert ids outside [0, {num_experts})")
        arr = arr.astype(routing_numpy_dtype(num_experts), copy=False)
    return arr


def routed_experts_tensor(arr: np.ndarray, n_tokens: int) -> torch.Tensor:
    """The batch key's tensor for one sequence of ``n_tokens`` tokens: ``[n_tokens, layers, topk]``.

    Row ``t`` is the routing of token ``t``, aligned with ``packed_input_ids`` (same seqlens,
    so micro-batching and packing treat it as any per-token key).  The generator never ran the
    last token as input; its row repeats the one before (valid, distinct ids): in the trainer's
    forward that token's MLP output reaches no logit that is trained (causal attention, no next
    token), so any routing of it gives the same loss.
    """
    if arr.ndim != 3 or arr.shape[0] not in (n_tokens - 1, n_tokens):
        raise RoutingFormatError(f"routed experts {list(arr.shape)} for a sequence of {n_tokens} tokens "
                                 f"(expected {n_tokens - 1} or {n_tokens} rows)")
    t = torch.from_numpy(np.require(arr, requirements=["C", "W"]))  # (a decoded answer is read-only: copied)
    if t.shape[0] == n_tokens - 1:
        t = torch.cat([t, t[-1:]]) if t.shape[0] else t.new_zeros((n_tokens, *t.shape[1:]))
    return t


def moe_routing_of(model_path: str) -> Optional[tuple[int, int]]:
    """``(num_experts, topk)`` of the MoE model in checkpoint directory ``model_path`` (its
    config.json), None for a dense model or when there is no readable config.json there (a
    rollout controller then asks no server for routing; the builtin server returns it anyway)."""
    import json
    import os

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    topk = int(cfg.get("num_experts_per_tok") or 0)
    return (experts, topk) if experts > 0 and topk > 0 else None
