"""Build a megatron-core GPTModel from an HF config, for one model's process groups.

One function hides the layer-spec choice: megatron's local (pure PyTorch)
modules on CPU (core attention through torch SDPA by default), Transformer
Engine modules when TE is importable and a GPU is present.  Parameter names
differ between the two specs; :mod:`parallel.hf_io` resolves both.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Optional

import torch

from parallel.cpu_compat import apply_cpu_compat
from parallel.critic import ValueHead, has_value_bias
from parallel.groups import ModelGroups
from parallel.hf_layout import check_layout
from parallel.mcore_globals import ensure_megatron_globals
from parallel.model_config import HFArch, hf_arch, rope_inv_freq, transformer_config_from_hf
from parallel.model_config import moe_arch as arch_moe
from parallel.rotary import install_packed_rope
from parallel.vision import build_vision_tower

__all__ = ["build_gpt_model", "te_available"]


def te_available() -> bool:
    """True when Transformer Engine can be used (importable and a GPU present)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


ATTENTION_BACKENDS = ("sdpa", "megatron")


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm built from megatron's spec arguments (local spec, any tp).

    megatron's ``WrappedTorchNorm`` refuses sequence parallelism because torch's
    norm does not mark its weight; this one marks it (``weight.sequence_parallel``)
    when the config runs sequence parallel, so ``finalize_model_grads`` sums its
    gradient over the tp ranks, each of which normalised a different part of the
    sequence.
    """

    mark_sequence_parallel = True

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_unused: Any) -> None:
        # in the parameters' dtype, as megatron's own modules (bf16 runs: every weight bf16, so the
        # generation engine sharing them computes in one dtype; fp32 masters live in the optimizer)
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.sequence_parallel and self.mark_sequence_parallel:
            self.weight.sequence_parallel = True


class QKRMSNorm(RMSNorm):
    """Per-head q/k norm: sees the whole sequence of its own heads, so NOT marked
    (megatron already sums q/k-norm gradients over tp for ``qk_layernorm``)."""

    mark_sequence_parallel = False


def _layer_spec(arch: HFArch, use_te: bool, attention: str):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = arch.moe.num_experts if arch.moe is not None else None
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=experts is not None, qk_layernorm=arch.qk_norm)
        return _with_realflow_router(spec, experts)
    spec = _with_realflow_router(specs.get_gpt_layer_local_spec(
        num_experts=experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm"), experts)
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_BACKENDS}")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if arch.qk_norm:
        sub.self_attention.submodules.q_layernorm = QKRMSNorm
        sub.self_attention.submodules.k_layernorm = QKRMSNorm
    if attention == "sdpa":
        from parallel.attention import SDPACoreAttention

        sub.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def _with_realflow_router(spec: Any, experts: Optional[int]) -> Any:
    """MoE layers route with :class:`parallel.moe_router.RealflowRouter` (HF routing, replay)."""
    if experts is not None:
        from parallel.moe_router import router_class

        spec.submodules.mlp.submodules.router = router_class()
    return spec


def _block_spec(layer_spec: Any, num_layers: int, use_te: bool) -> Any:
    """This stage's layers (even split) + the final norm; TE keeps megatron's default."""
    if use_te:
        return layer_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=RMSNorm)


def build_gpt_model(
    hf_config: Any,
    groups: ModelGroups,
    *,
    critic: bool = False,
    use_te: Optional[bool] = None,
    attention: str = "sdpa",
    config_overrides: Optional[dict[str, Any]] = None,
) -> tuple[Any, HFArch]:
    """Return ``(model, arch)``: this rank's pipeline stage of the GPTModel.

    Weights are randomly initialised (megatron's init, from the CPU/CUDA RNG the
    caller seeded); load real weights with :func:`parallel.hf_io.load_hf_checkpoint`.
    ``critic=True`` swaps the LM head for :class:`parallel.critic.ValueHead` (no
    tied embeddings; outputs ``[b, s, 1]`` values).  With tp > 1 sequence
    parallelism is on by default (activations between tp regions are split along
    the sequence, which must then be a multiple of tp).  Without TE,
    ``attention="sdpa"`` swaps the local spec's core attention for
    :class:`parallel.attention.SDPACoreAttention` (same maths, fused kernel);
    ``attention="megatron"`` keeps megatron's ``DotProductAttention``.
    """
    if not groups.is_member:
        raise ValueError(f"build_gpt_model: rank is not one of the model's ranks {groups.ranks}")
    strategy = groups.strategy
    hf_arch(hf_config, tp_size=strategy.tp)  # unsupported architectures fail first
    check_layout(hf_config, strategy.dp, strategy.tp, strategy.pp, strategy.ep)
    apply_cpu_compat()
    ensure_megatron_globals()
    install_packed_rope()  # pad-free rows' rotary frequencies in one gather (parallel/rotary.py)
    from megatron.core.models.gpt.gpt_model import GPTModel

    use_te = te_available() if use_te is None else use_te
    overrides = dict(
        tensor_model_parallel_size=strategy.tp,
        pipeline_model_parallel_size=strategy.pp,
        sequence_parallel=strategy.tp > 1,
    )
    if arch_moe(hf_config) is not None:
        overrides["expert_model_parallel_size"] = strategy.ep
    overrides.update(config_overrides or {})
    config = transformer_config_from_hf(hf_config, **overrides)
    arch = hf_arch(hf_config, tp_size=strategy.tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(_layer_spec(arch, use_te, attention),
                                           config.num_layers // strategy.pp, use_te),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,  # logits stay vocab-sharded across tp; gathered by the engine
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not critic,
        position_embedding_type="rope" if arch.vision is None else "mrope",
        rotary_base=arch.rope_theta,
        # a VL model replaces image rows of the embeddings before the sequence-parallel split
        # (parallel/vision_step.py): megatron's embedding must hand over the whole sequence
        scatter_embedding_sequence_parallel=arch.vision is None,
        pg_collection=groups.pg_collection,
    )
    # RoPE frequencies exactly as transformers computes them (incl. llama3 scaling).
    rope = model.rotary_pos_emb
    rope.inv_freq = rope_inv_freq(arch).to(rope.inv_freq.device)
    if arch.vision is not None and groups.is_first_stage:
        # the tower (transformers' module: HF-exact features) is replicated on every rank that
        # embeds tokens; a child of the GPTModel, so DDP reduces its gradients over dp
        model.visual = build_vision_tower(hf_config, dtype=config.params_dtype)
    if critic and groups.is_last_stage:
        model.output_layer = ValueHead(config.hidden_size, has_value_bias(hf_config),
                                       config.params_dtype, config.sequence_parallel,
                                       groups.tp_group)
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model, arch
