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
from parallel.groups import ModelGroups
from parallel.mcore_globals import ensure_megatron_globals
from parallel.model_config import HFArch, hf_arch, rope_inv_freq, transformer_config_from_hf

__all__ = ["build_gpt_model", "te_available"]


def te_available() -> bool:
    """True when Transformer Engine can be used (importable and a GPU present)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


ATTENTION_BACKENDS = ("sdpa", "megatron")


def _layer_spec(arch: HFArch, use_te: bool, attention: str):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_BACKENDS}")
    if attention == "sdpa":
        from parallel.attention import SDPACoreAttention

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


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
    ``critic=True`` (scalar value head instead of the LM head) is reserved for a
    later issue.  Without TE, ``attention="sdpa"`` swaps the local spec's core
    attention for :class:`parallel.attention.SDPACoreAttention` (same maths, fused
    kernel); ``attention="megatron"`` keeps megatron's ``DotProductAttention``.
    """
    if not groups.is_member:
        raise ValueError(f"build_gpt_model: rank is not one of the model's ranks {groups.ranks}")
    if critic:
        raise NotImplementedError("critic (scalar value head) models are not implemented yet")
    apply_cpu_compat()
    ensure_megatron_globals()
    from megatron.core.models.gpt.gpt_model import GPTModel

    use_te = te_available() if use_te is None else use_te
    strategy = groups.strategy
    overrides = dict(
        tensor_model_parallel_size=strategy.tp,
        pipeline_model_parallel_size=strategy.pp,
    )
    overrides.update(config_overrides or {})
    config = transformer_config_from_hf(hf_config, **overrides)
    arch = hf_arch(hf_config, tp_size=strategy.tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(arch, use_te, attention),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,  # logits stay vocab-sharded across tp; gathered by the engine
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        pg_collection=groups.pg_collection,
    )
    # RoPE frequencies exactly as transformers computes them (incl. llama3 scaling).
    rope = model.rotary_pos_emb
    rope.inv_freq = rope_inv_freq(arch).to(rope.inv_freq.device)
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model, arch
