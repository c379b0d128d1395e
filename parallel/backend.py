"""The "megatron" model backend: what a model worker calls to build groups and engines.

Thin adapter from the runtime's :class:`realflow.api.backend.ModelBackend`
protocol to :func:`parallel.groups.build_model_groups` and
:class:`parallel.engine.MegatronEngine`, plus the plan-time checks of a layout
(:meth:`MegatronBackend.check_layout`) that the plan compiler runs for every MFC.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from realflow.api.allocation import ParallelStrategy
from realflow.api.backend import LayoutError, engine_cost_meters, register_backend
from realflow.api.engine import TrainEngine
from realflow.api.layout import Layout
from realflow.base.devices import resolve_precision
from realflow.base.hf_models import language_fields

from parallel.engine import MegatronEngine
from parallel.groups import ModelGroups, build_model_groups
from parallel.model_config import hf_arch, precision_overrides
from parallel.lora_checks import check_lora, lora_for_layout, lora_of_pair, resolved_lora
from parallel.moe import check_moe_options, moe_layout_problem
from parallel.optim import EngineOptimizerConfig

__all__ = ["MegatronBackend", "estimate_rank_bytes"]

_BACKEND_ARGS = ("config_overrides", "attention", "critic")


@register_backend("megatron")
class MegatronBackend:
    """Megatron-core GPT models from HF checkpoints (see :mod:`parallel.engine`)."""

    _hosts: Optional[list[str]] = None  # rank -> host, gathered once per process (collective)

    def build_groups(self, ranks: list[int], strategy: ParallelStrategy) -> ModelGroups:
        return build_model_groups(ranks, strategy)

    def build_engine(self, spec: Any, groups: ModelGroups, seed: int, *,
                     load_weights: bool = True) -> TrainEngine:
        """The engine of ``spec`` on ``groups``; ``load_weights=False`` for layouts whose weights
        arrive by reallocation (random init, no checkpoint read)."""
        unknown = sorted(set(spec.backend_args) - set(_BACKEND_ARGS))
        if unknown:
            raise ValueError(f"model {spec.role!r}: unknown megatron backend_args {unknown}; "
                             f"known: {list(_BACKEND_ARGS)}")
        opt = None
        if spec.optimizer is not None:
            opt = EngineOptimizerConfig.for_run(spec.optimizer, spec.total_train_steps)
        return MegatronEngine(spec.path, groups, spec.path if load_weights else None, opt, seed,
                              config_overrides=_config_overrides(spec),
                              attention=spec.backend_args.get("attention", "sdpa"),
                              critic=bool(spec.backend_args.get("critic", False)),
                              lora=lora_for_layout(spec, load_weights),
                              training=getattr(spec, "training", None), moe=getattr(spec, "moe", None),
                              freeze_vision=bool(getattr(spec, "freeze_vision", False)))

    # ---- parameter reallocation and offload (runtime hooks) ------------------------------------

    def prepare_realloc(self, src_spec: Any, src_layout: Layout, src_groups: ModelGroups,
                        dst_spec: Any, dst_layout: Layout, dst_groups: ModelGroups) -> Any:
        """Plan + resources of one (source layout, destination layout) pair.

        Collective over the whole world, in the same order on every worker (the plan's
        ``realloc_pairs``): gathers host names (to pick shared memory vs point-to-point),
        creates the pair's group and shared segments.
        """
        from transformers import AutoConfig

        from parallel.realloc import gather_hosts, plan_reallocation, prepare_reallocation

        if self._hosts is None:
            self._hosts = gather_hosts()
        if bool(src_spec.backend_args.get("critic")) or bool(dst_spec.backend_args.get("critic")):
            raise LayoutError(f"reallocation of critic models ({src_spec.role} -> {dst_spec.role}) is not "
                              f"supported: give the critic one layout for all its MFCs")
        plan = plan_reallocation(
            AutoConfig.from_pretrained(src_spec.path),
            src_layout, dst_layout,
            dst_hf_config=AutoConfig.from_pretrained(dst_spec.path), hosts=self._hosts,
            lora=lora_of_pair(src_spec, dst_spec))
        return plan, prepare_reallocation(plan)

    def reallocate(self, handle: Any, src: Optional[TrainEngine], dst: Optional[TrainEngine],
                   eta: float) -> dict[str, float]:
        """Collective over both layouts' workers: ``dst = eta*src + (1-eta)*dst`` (exact copy at 1)."""
        from parallel.realloc import reallocate

        plan, res = handle
        return reallocate(plan, res, _megatron(src).module if src is not None else None,
                          _megatron(dst).module if dst is not None else None, eta=eta)

    def offload(self, engine: TrainEngine) -> None:
        """Release the engine's parameter storage (kept in a compact host buffer, on the module)."""
        from parallel.realloc import offload

        offload(_megatron(engine).module)

    def reload(self, engine: TrainEngine) -> None:
        """Give the parameters their storage back, bit-identical."""
        from parallel.realloc import reload

        reload(_megatron(engine).module)

    # ---- recover points ---------------------------------------------------------------------------

    def local_state(self, engine: TrainEngine) -> dict[str, Any]:
        """This rank's exact training state of ``engine`` (see :mod:`parallel.engine_state`)."""
        from parallel.engine_state import engine_local_state

        return engine_local_state(_megatron(engine))

    def load_local_state(self, engine: TrainEngine, state: dict[str, Any]) -> None:
        """Restore what :meth:`local_state` returned on the same rank of the same layout."""
        from parallel.engine_state import load_engine_local_state

        load_engine_local_state(_megatron(engine), state)

    # ---- plan-time checks (realflow.api.backend.ModelBackend, optional methods) ----------------

    def check_layout(self, spec: Any, strategy: ParallelStrategy, trained: bool,
                     n_workers_per_host: int, capacity_bytes: Optional[int] = None) -> Optional[str]:
        """Raise :class:`LayoutError` when megatron cannot build ``spec`` as ``strategy`` or it cannot fit.

        Structural limits are megatron's (and our HF loader's): tp must divide the
        attention heads, the KV heads (the fused qkv is split by whole query groups),
        the SwiGLU width and the padded vocabulary; pp must divide the layers. Memory
        is a lower bound (weights, plus fp32 grads and sharded Adam states when
        trained; activations and KV cache come on top) against a capacity (this
        machine's, or ``capacity_bytes`` for a planned cluster), so the check is
        deterministic on every process.
        """
        cfg = read_hf_config(spec.path)
        planned = cfg is None and spec.expected_config is not None
        if planned:
            cfg = dict(spec.expected_config)
        if cfg is None:
            return f"model {spec.role!r}: no config.json in {spec.path!r} yet; layout {strategy} not checked"
        made = ", as prepare() will create it" if planned else ""
        what = f"model {spec.role!r} ({_model_desc(cfg)}{made}) in layout {strategy}"
        try:
            arch = hf_arch(cfg, tp_size=strategy.tp)
        except NotImplementedError as e:
            raise LayoutError(f"{what}: {e}") from None
        tp, pp = strategy.tp, strategy.pp
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        layers = int(cfg["num_hidden_layers"])
        problem = moe_layout_problem(cfg, strategy.dp, tp, strategy.ep)
        if problem:
            raise LayoutError(f"{what}: {problem}")
        ffn = tp if arch.moe is not None else int(cfg["intermediate_size"])  # MoE: every layer sparse
        for n, field in ((heads, "num_attention_heads"), (kv, "num_key_value_heads"),
                         (ffn, "intermediate_size"), (arch.padded_vocab_size, "padded vocab size")):
            if n % tp:
                raise LayoutError(f"{what}: tp={tp} does not divide {field}={n}")
        if pp > layers:
            raise LayoutError(f"{what}: pp={pp} is larger than num_hidden_layers={layers}")
        if layers % pp:
            raise LayoutError(f"{what}: pp={pp} does not divide num_hidden_layers={layers} "
                              f"(megatron needs the same number of layers on every stage)")
        check_lora(spec, cfg, what)
        check_moe_options(spec, cfg, what)
        trained = trained and resolved_lora(spec) is None  # LoRA: a frozen base (+ adapters, ~1%)
        overrides = _config_overrides(spec)
        params, need = estimate_rank_bytes(cfg, strategy, trained, _low_precision(overrides))
        if capacity_bytes is None:
            have, where = _memory_per_worker(n_workers_per_host)
        else:
            have, where = int(capacity_bytes), "the planned device's memory"
        if need > have:
            state = "weights + fp32 grads + Adam states" if trained else "weights"
            raise LayoutError(
                f"{what} cannot fit: {params / 1e6:.1f}M parameters per rank need at least "
                f"{_gib(need)} ({state}) but a worker has {_gib(have)} ({where})"
            )
        return None

    def rank_state_bytes(self, cfg: dict[str, Any], strategy: ParallelStrategy, trained: bool,
                         low_precision: bool = False) -> tuple[int, int]:
        """(parameters, bytes) of the most loaded rank's resident state (the planner's memory
        estimate: the same rule the layout check applies)."""
        return estimate_rank_bytes(cfg, strategy, trained, low_precision)

    def check_same_architecture(self, source: Any, target: Any) -> Optional[str]:
        """Raise :class:`LayoutError` unless both checkpoints have the same architecture fields."""
        a, b = read_hf_config(source.path), read_hf_config(target.path)
        if a is None or b is None:
            missing = source if a is None else target
            return f"model {missing.role!r}: no config.json in {missing.path!r} yet; architectures not compared"
        diff = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in _ARCH_FIELDS if a.get(k) != b.get(k)]
        if diff:
            raise LayoutError(f"models {source.role!r} ({source.path}) and {target.role!r} ({target.path}) "
                              f"differ in architecture: {'; '.join(diff)}")
        return None


def _megatron(engine: TrainEngine) -> MegatronEngine:
    """``engine`` as the MegatronEngine this backend built (its hooks work on megatron modules)."""
    if not isinstance(engine, MegatronEngine):
        raise TypeError(f"the megatron backend was handed a {type(engine).__name__}, not a MegatronEngine")
    return engine


_ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings")


def read_hf_config(path: str) -> Optional[dict[str, Any]]:
    """The checkpoint's config.json as a dict (plain JSON: no transformers import), or None if absent."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            cfg = language_fields(json.load(f))
    except json.JSONDecodeError as e:
        raise LayoutError(f"{file}:{e.lineno}: invalid JSON ({e.msg})") from None
    except (OSError, ValueError) as e:
        raise LayoutError(f"cannot read HF config {file}: {e}") from None
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size",
                           "vocab_size") if k not in cfg]
    if missing:
        raise LayoutError(f"HF config {file} lacks {missing}")
    return cfg


def _model_desc(cfg: dict[str, Any]) -> str:
    return (f"{cfg.get('model_type')}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads / {cfg.get('num_key_value_heads') or cfg['num_attention_heads']} "
            f"KV heads, vocab {'of the tokenizer' if cfg.get('vocab_size_unknown') else cfg['vocab_size']}")


def _config_overrides(spec: Any) -> dict[str, Any]:
    """The TransformerConfig overrides of ``spec``: its precision's, then its own (which win)."""
    out = precision_overrides(resolve_precision(getattr(spec, "precision", "auto")))
    out.update(spec.backend_args.get("config_overrides") or {})
    return out


def _low_precision(overrides: dict[str, Any]) -> bool:
    dtype = str(overrides.get("params_dtype", ""))
    return bool(overrides.get("bf16") or overrides.get("fp16")) or "16" in dtype


def estimate_rank_bytes(cfg: dict[str, Any], strategy: ParallelStrategy, trained: bool,
                        low_precision: bool = False) -> tuple[int, int]:
    """(parameters, bytes) on the most loaded rank of ``strategy``: a lower bound on its memory.

    Layers split evenly over pp and their matrices over tp; the first stage holds the
    embedding, the last the output layer (a second copy when embeddings are tied and
    pp > 1) and the final norm. Trained: fp32 main grads (megatron DDP with
    grad_reduce_in_fp32) plus Adam moments (and fp32 master weights under bf16/fp16),
    sharded over dp by the distributed optimizer.
    """
    arch = hf_arch(cfg, tp_size=strategy.tp)
    tp, pp = strategy.tp, strategy.pp
    h, ffn = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = arch.head_dim
    split = (heads + 2 * kv) * hd * h + heads * hd * h  # qkv, proj
    if arch.moe is None:
        split += 3 * ffn * h  # fc1 [gate; up], fc2
    if arch.qkv_bias:
        split += (heads + 2 * kv) * hd
    replicated = 2 * h + (2 * hd if arch.qk_norm else 0)  # the two RMSNorms (+ q/k norms)
    per_layer = -(-split // tp) + replicated
    if arch.moe is not None:  # router (replicated) + this rank's experts (whole, or split over tp)
        m = arch.moe
        experts = 3 * m.ffn * h * m.num_experts // strategy.ep
        per_layer += m.num_experts * h + (experts if strategy.ep > 1 else -(-experts // tp))
    stage_layers = -(-int(cfg["num_hidden_layers"]) // pp) * per_layer
    vocab_shard = arch.padded_vocab_size * h // tp
    output = 0 if arch.tie_word_embeddings and pp == 1 else vocab_shard
    first = stage_layers + vocab_shard + (output + h if pp == 1 else 0)
    last = stage_layers + output + h
    params = max(first, last)
    weight = 2 if low_precision else 4
    per_param = weight
    if trained:
        per_param += 4 + (8 + (4 if low_precision else 0)) / strategy.dp
    return params, int(params * per_param)


def smallest_fitting_tp(cfg: dict[str, Any], n_workers: int, n_workers_per_host: int,
                        headroom: float = 2.0) -> int:
    """The smallest tensor-parallel degree with which ``cfg`` trains within a worker's memory.

    Why the smallest: tensor parallelism splits every layer's matrices, so each layer costs
    collectives; when a whole replica fits, data parallelism over every worker is faster
    (``benchmarks/bench_e2e_rl.py``: the default GRPO step takes 0.95 s at d2 against 1.37 s
    with training at d1t2 on 2 CPU cores). ``headroom`` multiplies the lower-bound estimate
    (weights, grads, optimizer states) to leave room for activations.  Returns 1 when
    nothing divides the model or nothing fits (the layout check then says why).
    """
    have, _ = _memory_per_worker(n_workers_per_host)
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    ffn = int(cfg["intermediate_size"])
    tp = 1
    while tp <= n_workers and not n_workers % tp and not heads % tp and not kv % tp and not ffn % tp:
        _, need = estimate_rank_bytes(cfg, ParallelStrategy(dp=n_workers // tp, tp=tp), True)
        if need * headroom <= have:
            return tp
        tp *= 2
    return 1


def _memory_per_worker(n_workers_per_host: int) -> tuple[int, str]:
    """A worker's memory capacity: its GPU's total memory, or MemTotal / workers on this host."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"GPU {props.name} total memory"
    n = max(int(n_workers_per_host), 1)
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return total_kib * 1024 // n, f"MemTotal {_gib(total_kib * 1024)} / {n} workers on this host"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@engine_cost_meters.register("megatron")
def measure_megatron_costs(world: int, quick: bool) -> dict[str, Any]:
    """megatron-core's own costs on this machine (:mod:`parallel.overheads`), for ``realflow calibrate``."""
    from parallel.overheads import measure_engine_overheads

    return measure_engine_overheads(world=world, quick=quick)
