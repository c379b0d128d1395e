"""Create a randomly initialised HF checkpoint for training from scratch.

Training "from scratch" is loading a checkpoint like any other: the launcher writes
a seeded random model once, and every worker loads its layout's slice of it. So
every data-parallel replica starts from the same weights without a broadcast, and
the run is reproducible from the seed.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class TinyArchConfig:
    """Shape of a from-scratch model: Qwen2, or Qwen3-MoE with ``num_experts > 0``."""

    hidden_size: int = field(default=128, metadata={"help": "model width"})
    num_hidden_layers: int = field(default=3, metadata={"help": "transformer layers"})
    num_attention_heads: int = field(default=4, metadata={"help": "query heads"})
    num_key_value_heads: int = field(default=2, metadata={"help": "key/value heads (GQA)"})
    intermediate_size: int = field(default=352, metadata={"help": "SwiGLU inner size"})
    max_position_embeddings: int = field(default=128, metadata={"help": "longest sequence"})
    rope_theta: float = field(default=10000.0, metadata={"help": "rotary base"})
    tie_word_embeddings: bool = field(default=True, metadata={"help": "share input/output embeddings"})
    num_experts: int = field(default=0, metadata={
        "help": "0: a dense Qwen2 model; N > 0: a Qwen3-MoE model with N experts in every layer"})
    num_experts_per_tok: int = field(default=2, metadata={"help": "MoE: experts per token (top-k)"})
    moe_intermediate_size: int = field(default=0, metadata={
        "help": "MoE: one expert's SwiGLU width (0: intermediate_size / num_experts_per_tok, so a token's "
                "active MLP width equals the dense model's)"})

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.arch.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.arch.hidden_size={self.hidden_size} must be a multiple of "
                             f"num_attention_heads={self.num_attention_heads} (heads split the width)")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"model.arch.num_experts={self.num_experts}, num_experts_per_tok="
                             f"{self.num_experts_per_tok}: need 0 (dense) or 1 <= num_experts_per_tok <= num_experts")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.arch.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads} (query groups share a KV head)")


def planned_hf_config(arch: TinyArchConfig) -> dict:
    """The structural HF config :func:`ensure_random_checkpoint` will write (for layout checks
    before it runs).  The vocabulary is the tokenizer's, unknown until it is built: a small
    stand-in (megatron pads the vocabulary to a multiple of 128 x tp, so tp always divides it)."""
    if arch.num_experts:
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128,
                "vocab_size_unknown": True, **_moe_fields(arch)}
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 128,
            "vocab_size_unknown": True, **_dense_fields(arch)}


_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _dense_fields(arch: TinyArchConfig) -> dict:
    return {k: v for k, v in asdict(arch).items() if k not in _MOE_KEYS}


def _moe_fields(arch: TinyArchConfig) -> dict:
    """Qwen3-MoE: every layer sparse, top-k renormalised (as Qwen3-30B-A3B), HF's aux coefficient."""
    out = _dense_fields(arch)
    out.update(num_experts=arch.num_experts, num_experts_per_tok=arch.num_experts_per_tok,
               moe_intermediate_size=arch.moe_intermediate_size or max(arch.intermediate_size
                                                                       // arch.num_experts_per_tok, 1),
               head_dim=arch.hidden_size // arch.num_attention_heads, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    return out


def ensure_random_checkpoint(out_dir: str, tokenizer_dir: str, arch: TinyArchConfig, seed: int) -> str:
    """Write a seeded random Qwen2 (or Qwen3-MoE) model and the tokenizer to ``out_dir`` unless present."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    marker = os.path.join(out_dir, "realflow_init.json")
    params = {"arch": asdict(arch), "seed": seed, "tokenizer": os.path.abspath(tokenizer_dir)}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == params:
                return out_dir
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the launcher's console to realflow's own lines
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if arch.num_experts:
        from transformers import Qwen3MoeConfig as config_cls, Qwen3MoeForCausalLM as model_cls
        fields = _moe_fields(arch)
    else:
        config_cls, model_cls, fields = Qwen2Config, Qwen2ForCausalLM, _dense_fields(arch)
    config = config_cls(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        **fields,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    with open(marker, "w") as f:
        json.dump(params, f, indent=1)
    return out_dir
