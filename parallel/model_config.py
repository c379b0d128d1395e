"""HF config -> megatron-core TransformerConfig (Qwen2, Qwen3, Llama, Qwen3-MoE families).

The HF config is the source of truth for the architecture; everything megatron
needs beyond TransformerConfig (vocab padding, RoPE base/scaling, tied
embeddings) is in :class:`HFArch`, produced by :func:`hf_arch`.  Anything we
cannot reproduce exactly raises ``NotImplementedError`` naming the field, so a
model never silently diverges from its HF twin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "HFArch",
    "MoEArch",
    "MOE_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "hf_arch",
    "moe_arch",
    "moe_config_fields",
    "num_experts_of",
    "precision_overrides",
    "recompute_overrides",
    "rope_inv_freq",
    "transformer_config_from_hf",
]

# model_type -> (qkv bias, qk-norm)
SUPPORTED_MODEL_TYPES: dict[str, tuple[bool, bool]] = {
    "qwen2": (True, False),
    "llama": (False, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
    # vision-language: the language model is Qwen2's (its fields under text_config, see _get)
    "qwen2_5_vl": (True, False),
    "qwen2_vl": (True, False),
}
MOE_MODEL_TYPES = ("qwen3_moe",)

# Megatron-LM's convention: pad the vocab to a multiple of 128 * tp so the
# vocab-parallel embedding/output layer splits evenly and GEMMs stay aligned.
DEFAULT_VOCAB_DIVISOR = 128


@dataclass(frozen=True)
class MoEArch:
    """Mixture-of-experts facts of an HF config (every decoder layer sparse).

    Routing is HF's: softmax over all experts (fp32), the top ``topk``, renormalised when
    ``norm_topk_prob``.  ``aux_loss_coef`` is HF's ``router_aux_loss_coef`` (the
    load-balancing loss of :mod:`parallel.moe_aux`), which ``moe.aux_loss_coef`` overrides.
    """

    num_experts: int
    topk: int
    ffn: int  # moe_intermediate_size: one expert's SwiGLU width
    norm_topk_prob: bool
    aux_loss_coef: float


@dataclass(frozen=True)
class HFArch:
    """Architecture facts megatron's GPTModel takes outside TransformerConfig."""

    model_type: str
    vocab_size: int  # the HF vocab; logits are cut to this
    padded_vocab_size: int  # megatron's embedding/output rows
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]  # HF rope_parameters for non-default RoPE
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool
    qk_norm: bool
    moe: Optional[MoEArch] = None


_MISSING = object()


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    """A config field; a VL config's language-model fields live in its ``text_config``."""
    if isinstance(hf_config, dict):
        value = hf_config.get(name, _MISSING)
        text = hf_config.get("text_config")
    else:
        value = getattr(hf_config, name, _MISSING)
        text = getattr(hf_config, "text_config", None)
    if value is not _MISSING:
        return value
    if text is not None and text is not hf_config:
        return _get(text, name, default)
    return default


def _rope_params(hf_config: Any) -> dict[str, Any]:
    """RoPE settings from either transformers 5 (rope_parameters) or 4.x fields."""
    params = dict(_get(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    legacy = _get(hf_config, "rope_scaling", None)
    if legacy and "rope_type" not in params:
        params.update(legacy)
        params.setdefault("rope_type", legacy.get("type", "default"))
    params.setdefault("rope_type", "default")
    return params


def num_experts_of(hf_config: Any) -> int:
    """Expert count of an HF config (``num_experts``; ``num_local_experts`` in some dumps); 0 = dense."""
    return int(_get(hf_config, "num_experts", None) or _get(hf_config, "num_local_experts", None) or 0)


def moe_arch(hf_config: Any) -> Optional[MoEArch]:
    """The :class:`MoEArch` of an MoE config (None for dense); refuses what we cannot reproduce."""
    model_type = _get(hf_config, "model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    experts = num_experts_of(hf_config)
    topk = int(_get(hf_config, "num_experts_per_tok", 0) or 0)
    if experts < 1 or not 1 <= topk <= experts:
        raise NotImplementedError(f"{model_type}: num_experts={experts}, num_experts_per_tok={topk} "
                                  f"(need 1 <= num_experts_per_tok <= num_experts)")
    if int(_get(hf_config, "decoder_sparse_step", 1) or 1) != 1 or list(_get(hf_config, "mlp_only_layers", None) or []):
        raise NotImplementedError(f"{model_type}: dense layers between sparse ones (decoder_sparse_step != 1 or "
                                  f"mlp_only_layers set) are not supported; every layer must be an MoE layer")
    return MoEArch(num_experts=experts, topk=topk, ffn=int(_get(hf_config, "moe_intermediate_size")),
                   norm_topk_prob=bool(_get(hf_config, "norm_topk_prob", False)),
                   aux_loss_coef=float(_get(hf_config, "router_aux_loss_coef", 0.0) or 0.0))


def hf_arch(hf_config: Any, tp_size: int = 1, vocab_divisor: int = DEFAULT_VOCAB_DIVISOR) -> HFArch:
    """Validate ``hf_config`` and collect the architecture facts."""
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = _get(hf_config, "architectures") or []
        raise NotImplementedError(
            f"unsupported architecture model_type={model_type!r} {list(archs)}; "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    qkv_bias, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"{model_type}: hidden_act={act!r} (only SwiGLU/silu)")
    if model_type == "llama":
        if _get(hf_config, "attention_bias", False):
            raise NotImplementedError("llama: attention_bias=True (o_proj bias) is not supported")
        if _get(hf_config, "mlp_bias", False):
            raise NotImplementedError("llama: mlp_bias=True is not supported")
    if model_type in ("qwen3", "qwen3_moe") and _get(hf_config, "attention_bias", False):
        raise NotImplementedError(f"{model_type}: attention_bias=True is not supported")
    if _get(hf_config, "use_sliding_window", False):
        raise NotImplementedError(f"{model_type}: use_sliding_window=True is not supported")
    layer_types = _get(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(f"{model_type}: layer_types other than full_attention")

    rope = _rope_params(hf_config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise NotImplementedError(f"{model_type}: rope_type={rope['rope_type']!r}")
    hidden = _get(hf_config, "hidden_size")
    heads = _get(hf_config, "num_attention_heads")
    head_dim = _get(hf_config, "head_dim", None) or hidden // heads
    vocab = int(_get(hf_config, "vocab_size"))
    divisor = vocab_divisor * tp_size
    return HFArch(
        model_type=model_type,
        vocab_size=vocab,
        padded_vocab_size=int(math.ceil(vocab / divisor) * divisor),
        max_position_embeddings=int(_get(hf_config, "max_position_embeddings", 4096)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=None if rope["rope_type"] == "default" else rope,
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        head_dim=int(head_dim),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        moe=moe_arch(hf_config),
    )


def rope_inv_freq(arch: HFArch) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them (fp32).

    Megatron's own llama3 scaling hard-codes low/high frequency factors and the
    original context length, so we always install these frequencies ourselves.
    """
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_scaling is None:
        return inv
    s = arch.rope_scaling  # llama3
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def precision_overrides(precision: str) -> dict[str, Any]:
    """TransformerConfig fields of a resolved precision (``fp32`` | ``bf16``): bf16 parameters,
    which megatron's optimizer pairs with fp32 master weights and gradients."""
    return {"bf16": True, "params_dtype": torch.bfloat16} if precision == "bf16" else {}


def recompute_overrides(mode: str) -> dict[str, Any]:
    """TransformerConfig fields of ``training.gradient_checkpointing`` (megatron-core's recompute).

    ``full``: every transformer layer keeps only its input and is run again in the backward
    (``uniform`` over chunks of one layer: the most memory saved, one extra forward of the
    layers).  ``selective``: only the core attention (``recompute_modules=["core_attn"]``) is
    recomputed; megatron checkpoints whatever module sits in the ``core_attention`` slot, so it
    covers :class:`parallel.attention.SDPACoreAttention` as well as megatron's own and TE's.
    """
    if mode == "none":
        return {}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    raise ValueError(f"training.gradient_checkpointing={mode!r} must be one of none, full, selective")


def moe_config_fields(arch: HFArch, tp: int, ep: int) -> dict[str, Any]:
    """TransformerConfig fields of an MoE model: HF routing, megatron's SequentialMLP experts.

    ``pre_softmax`` is HF's order (softmax over all experts, then top-k) when the top-k
    probabilities are NOT renormalised; when they are, megatron's top-k-then-softmax gives
    the same weights (a softmax over the top-k logits is the renormalised top-k softmax).
    Experts are sharded over ``ep`` ranks; with ``ep > 1`` each expert is whole on its rank
    (expert tensor parallel 1, so ep may span the tp ranks), else split like a dense MLP.
    Megatron's own aux loss is off: :mod:`parallel.moe_aux` computes HF's.
    The token dispatcher is all-to-all: gloo implements ``all_to_all_single`` with uneven
    splits, which is all it needs on CPU.
    """
    moe = arch.moe
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1 if ep > 1 else tp,
    )


def transformer_config_from_hf(hf_config: Any, **overrides: Any):
    """Build a megatron ``TransformerConfig`` equivalent to ``hf_config``.

    Defaults suit fp32 training on CPU (no fused kernels, no dropout, CPU init);
    ``overrides`` are TransformerConfig fields (e.g. ``tensor_model_parallel_size``,
    ``bf16=True``, ``params_dtype=torch.bfloat16``) and win over everything.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = hf_arch(hf_config, tp_size=int(overrides.get("tensor_model_parallel_size", 1)))
    on_gpu = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=int(_get(hf_config, "num_hidden_layers")),
        hidden_size=int(_get(hf_config, "hidden_size")),
        num_attention_heads=int(_get(hf_config, "num_attention_heads")),
        num_query_groups=int(
            _get(hf_config, "num_key_value_heads", None) or _get(hf_config, "num_attention_heads")
        ),
        kv_channels=arch.head_dim,
        ffn_hidden_size=int(_get(hf_config, "intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,  # SwiGLU: fc1 = [gate; up]
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(_get(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(_get(hf_config, "initializer_range", 0.02)),
        params_dtype=torch.float32,
        use_cpu_initialization=not on_gpu,
        # Fusions need CUDA kernels (apex/TE); the unfused paths are exact.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
    if arch.moe is not None:
        kw.update(moe_config_fields(arch, int(overrides.get("tensor_model_parallel_size", 1)),
                                    int(overrides.get("expert_model_parallel_size", 1))))
    kw.update(overrides)
    # dtype of the activations pipeline stages exchange (megatron requires it for pp > 1)
    kw.setdefault("pipeline_dtype", kw["params_dtype"])
    return TransformerConfig(**kw)
