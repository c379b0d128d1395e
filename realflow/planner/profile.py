"""Device and link profiles: the numbers the cost model turns work into seconds.

A profile is measured on a machine by ``realflow calibrate`` (``source`` says where and
when) or built from published figures (``source`` names them): the planner's predictions
are only as good as these numbers, so every profile says which it is. Units are SI:
seconds, bytes, FLOP/s, bytes/s.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

PROFILE_DIR = Path(__file__).with_name("profiles")


class ProfileError(ValueError):
    """A profile file or name that cannot be used; the message names the field or the file."""


@dataclass(frozen=True)
class LinkProfile:
    """A collective's cost ``alpha + bytes_on_the_wire / bandwidth`` (per message, per hop)."""

    alpha_s: float  # latency of one step of a ring / one message
    bandwidth: float  # bytes/s one rank sends (bus bandwidth)

    def validate(self, where: str) -> None:
        if not self.alpha_s >= 0 or not self.bandwidth > 0:
            raise ProfileError(f"{where}: alpha_s must be >= 0 and bandwidth > 0, got {self}")


@dataclass(frozen=True)
class DeviceProfile:
    """What one device (a GPU, or one CPU worker process with its threads) sustains."""

    name: str
    source: str  # "measured: ..." or "published: ..."
    memory_bytes: int  # usable device memory
    matmul_flops: float  # sustained dense GEMM FLOP/s at large shapes (training dtype)
    matmul_overhead_s: float  # fixed cost of one GEMM call (launch / dispatch)
    attention_flops: float  # sustained FLOP/s of attention (scores + weighted sum), fwd and bwd
    attention_overhead_s: float  # fixed cost of one attention call
    memory_bandwidth: float  # bytes/s read + written by a device-memory copy
    op_overhead_s: float  # fixed cost of one small (elementwise / norm) op
    decode_layer_overhead_s: float  # fixed cost per layer of one decode step (beyond its GEMMs)
    host_bandwidth: float  # bytes/s between device and host memory (offload / reload)
    intra_node: LinkProfile = field(default_factory=lambda: LinkProfile(5e-6, 1e11))
    params_bytes: int = 2  # bytes per weight in the profile's training dtype (bf16 on GPUs, fp32 on CPU)
    # attention runs on packed sequences (flash / TransformerEngine THD kernels). False on the CPU
    # engine: each micro-batch is padded to [sequences, longest] and the causal scores are materialised
    packed_attention: bool = True
    # measured by `realflow calibrate` (ring all-gather; send/recv of one message); None: as intra_node
    intra_node_all_gather: Optional[LinkProfile] = None
    intra_node_p2p: Optional[LinkProfile] = None
    # the training framework's own fixed costs (megatron-core: parallel/overheads.py), measured by
    # `realflow calibrate`; 0 = count primitive ops instead (the published GPU profiles)
    layer_train_overhead_s: float = 0.0  # per layer and micro-batch, forward + backward
    layer_forward_overhead_s: float = 0.0  # per layer and micro-batch, forward only
    train_step_overhead_s: float = 0.0  # per optimizer step (loss, schedule, optimizer)
    forward_overhead_s: float = 0.0  # per forward call
    decode_step_overhead_s: float = 0.0  # per decode step beyond its layers (sampling, scheduling)
    decode_seq_s: float = 0.0  # per live sequence and decode step beyond its layers (its sampling, stop checks)
    decode_layer_seq_s: float = 0.0  # per live sequence, layer and decode step, at the reference layer
    generate_call_overhead_s: float = 0.0  # per generate call (scheduler, cache set-up, outputs)
    generate_seq_overhead_s: float = 0.0  # per sequence of a generate call (its request and output)
    layer_train_token_s: float = 0.0  # per layer and token, forward + backward, at the reference layer
    layer_forward_token_s: float = 0.0  # per layer and token, forward, at the reference layer
    layer_reference_params: float = 0.0  # parameters of that reference layer (costs scale with them)
    # the same, measured in a tensor-parallel group of ``measured_tp`` devices (the split GEMMs and
    # megatron's sequence-parallel collectives together); used for layouts with that tp
    measured_tp: float = 0.0
    tp_layer_train_overhead_s: float = 0.0
    tp_layer_forward_overhead_s: float = 0.0
    tp_layer_train_token_s: float = 0.0
    tp_layer_forward_token_s: float = 0.0
    tp_decode_layer_overhead_s: float = 0.0
    tp_decode_layer_seq_s: float = 0.0
    tp_train_step_overhead_s: float = 0.0  # per optimizer step at the measured tp (its loss and grad-norm collectives)
    tp_forward_overhead_s: float = 0.0  # per forward call at the measured tp
    tp_decode_step_overhead_s: float = 0.0  # (the embedding's all-reduce and the logits' gather are per step)
    tp_decode_seq_s: float = 0.0
    tp_generate_call_overhead_s: float = 0.0
    tp_generate_seq_overhead_s: float = 0.0
    # a layer's cost per micro-batch against the micro-batch's tokens, as measured: ((tokens, seconds), ...)
    # at the reference layer; between the points interpolated, past the last one its slope. Why not
    # one line: a tensor-parallel layer's cost grows faster past ~1k tokens than below (seen 10 vs
    # 16 us per token), and a line through 32..2048 tokens under-priced a run's ~1k-token batches
    layer_train_curve: tuple = ()
    layer_forward_curve: tuple = ()
    tp_layer_train_curve: tuple = ()
    tp_layer_forward_curve: tuple = ()
    # per token of a call outside its layers (embedding, LM head, loss; at tp the vocab-parallel
    # loss's collectives), beyond the LM head GEMM of the reference model (vocab x hidden =
    # head_reference_size) priced at matmul_flops
    train_head_token_s: float = 0.0
    forward_head_token_s: float = 0.0
    tp_train_head_token_s: float = 0.0
    tp_forward_head_token_s: float = 0.0
    head_reference_size: float = 0.0

    def measured_at(self, tp: int) -> bool:
        """Whether the framework's costs were measured in a tensor-parallel group of ``tp``."""
        return tp > 1 and tp == int(self.measured_tp)

    def engine_value(self, name: str, tp: int) -> Any:
        """A framework cost for a layout with tensor parallelism ``tp``: the one measured at that
        tp (``tp_<name>``) where calibrate measured it, else the tp=1 one."""
        return getattr(self, f"tp_{name}") if self.measured_at(tp) else getattr(self, name)

    def layer_costs(self, tp: int, train: bool, mb_tokens: float) -> tuple[float, float]:
        """(the part that grows with tokens, the fixed part) of one layer's cost on a micro-batch of
        ``mb_tokens`` tokens, at the reference layer; (0, 0) when not measured. See
        :meth:`engine_costs` for which tp's numbers serve."""
        per_token, fixed = self.engine_costs(tp, train)
        curve = self.engine_value(f"layer_{'train' if train else 'forward'}_curve", tp)
        if curve:
            return max(curve_at(curve, mb_tokens) - fixed, 0.0), fixed
        return per_token * mb_tokens, fixed

    def engine_costs(self, tp: int, train: bool) -> tuple[float, float]:
        """(per layer and token at the reference layer, per layer and micro-batch) measured for a
        layout with tensor parallelism ``tp``; (0, 0) when not measured for it. The tp=1 costs
        serve any tp only when no tp was measured (then split by tp, collectives modelled)."""
        kind = "train" if train else "forward"
        return self.engine_value(f"layer_{kind}_token_s", tp), self.engine_value(f"layer_{kind}_overhead_s", tp)

    def call_overhead(self, tp: int, train: bool) -> float:
        """The fixed cost of a train step (per optimizer step) or a forward call, outside its
        layers: at the measured tp its own measurement (the vocab-parallel loss, the grad norm
        and the optimizer's checks add collectives there), else the tp=1 one."""
        return self.engine_value("train_step_overhead_s" if train else "forward_overhead_s", tp)

    def link(self, op: str) -> LinkProfile:
        """The intra-node link of ``op`` ("all_reduce", "all_gather" or "p2p")."""
        if op not in ("all_reduce", "all_gather", "p2p"):
            raise ValueError(f"unknown collective {op!r}; known: all_reduce, all_gather, p2p")
        return getattr(self, f"intra_node_{op}", None) or self.intra_node

    def validate(self) -> None:
        where = f"device profile {self.name!r}"
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(v, str) or not v:
                    raise ProfileError(f"{where}: {f.name} must be a non-empty string")
            elif f.name == "packed_attention":
                if not isinstance(v, bool):
                    raise ProfileError(f"{where}: packed_attention={v!r} must be true or false")
            elif f.name in CURVE_FIELDS:
                check_curve(v, f"{where}: {f.name}")
            elif f.name in LINK_FIELDS:
                if v is not None or f.name == "intra_node":
                    if not isinstance(v, LinkProfile):
                        raise ProfileError(f"{where}: {f.name} must be a LinkProfile, got {v!r}")
                    v.validate(f"{where}: {f.name}")
            elif f.name.endswith("_s") or f.name in FRAMEWORK_FIELDS:
                if not isinstance(v, (int, float)) or v < 0:
                    raise ProfileError(f"{where}: {f.name}={v!r} must be a number >= 0")
            elif not isinstance(v, (int, float)) or not v > 0:
                raise ProfileError(f"{where}: {f.name}={v!r} must be a number > 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


LINK_FIELDS = ("intra_node", "intra_node_all_gather", "intra_node_p2p")
FRAMEWORK_FIELDS = ("layer_train_overhead_s", "layer_forward_overhead_s", "train_step_overhead_s", "forward_overhead_s",
                    "decode_step_overhead_s", "layer_train_token_s", "layer_forward_token_s", "layer_reference_params",
                    "measured_tp", "tp_layer_train_overhead_s", "tp_layer_forward_overhead_s", "tp_layer_train_token_s",
                    "tp_layer_forward_token_s", "tp_decode_layer_overhead_s", "decode_seq_s", "decode_layer_seq_s",
                    "generate_call_overhead_s", "generate_seq_overhead_s", "tp_decode_layer_seq_s",
                    "tp_train_step_overhead_s", "tp_forward_overhead_s", "tp_decode_step_overhead_s", "tp_decode_seq_s",
                    "tp_generate_call_overhead_s", "tp_generate_seq_overhead_s", "train_head_token_s",
                    "forward_head_token_s", "tp_train_head_token_s", "tp_forward_head_token_s", "head_reference_size")
CURVE_FIELDS = ("layer_train_curve", "layer_forward_curve", "tp_layer_train_curve", "tp_layer_forward_curve")


def check_curve(curve: Any, where: str) -> None:
    """A measured curve: empty (not measured) or >= 2 (tokens, seconds) pairs, tokens rising."""
    if curve == ():
        return
    ok = isinstance(curve, tuple) and len(curve) >= 2 and all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p) and p[0] > 0 and p[1] >= 0
        for p in curve)
    if not ok or any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
        raise ProfileError(f"{where} must be >= 2 [tokens, seconds] pairs with tokens > 0 and rising and "
                           f"seconds >= 0, got {curve!r}")


def curve_at(curve: Sequence[tuple[float, float]], x: float) -> float:
    """The measured curve at ``x``: linear between its points, past either end its end segment's slope."""
    i = 1
    while i < len(curve) - 1 and x > curve[i][0]:
        i += 1
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return max(y0 + (x - x0) * (y1 - y0) / (x1 - x0), 0.0)


def profile_from_dict(d: dict[str, Any], where: str = "profile") -> DeviceProfile:
    known = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    missing = sorted(f.name for f in fields(DeviceProfile)
                     if f.name not in d and f.name not in ("params_bytes", "packed_attention", *LINK_FIELDS,
                                                           *FRAMEWORK_FIELDS, *CURVE_FIELDS))
    if missing:
        raise ProfileError(f"{where}: missing field(s) {missing}")
    d = dict(d)
    for name in LINK_FIELDS:  # intra_node may be left out (the default); the others also null
        if name not in d or (d[name] is None and name != "intra_node"):
            continue
        link = d[name]
        if not isinstance(link, dict) or set(link) != {"alpha_s", "bandwidth"}:
            raise ProfileError(f"{where}: {name} must be {{alpha_s, bandwidth}}, got {link!r}")
        d[name] = LinkProfile(**link)
    for name in CURVE_FIELDS:  # JSON lists -> tuples (a profile is frozen and hashable)
        if isinstance(d.get(name), list):
            d[name] = tuple(tuple(p) if isinstance(p, list) else p for p in d[name])
    prof = DeviceProfile(**d)
    prof.validate()
    return prof


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name (``h100``, ``h200``, ``a100``, ``cpu-example``) or a JSON file."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" or os.sep in name_or_path):
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ProfileError(f"no device profile {name_or_path!r}; shipped: {', '.join(shipped_profiles())} "
                               f"(or give a JSON file written by `realflow calibrate`)")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"device profile file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"device profile {str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"device profile {str(path)!r} must hold a JSON object")
    return profile_from_dict(data, where=str(path))
