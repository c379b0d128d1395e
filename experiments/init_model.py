"""Create a randomly initialised HF checkpoint for training from scratch.

Training "from scratch" is loading a checkpoint like any other: the launcher writes
a seeded random model once, and every worker loads its layout's slice of it. So
every data-parallel replica starts from the same weights without a broadcast, and
the run is reproducible from the seed.

``model.arch.vision=true`` makes the same language model a Qwen2.5-VL: a small vision tower
(``vision_depth`` blocks of width ``vision_hidden_size``, its merger projecting to the language
model's width) in front of it, and M-RoPE. The tokenizer must have Qwen2.5-VL's vision tokens
(``experiments.tasks.vl_tokenizer``), whose ids the config records.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class TinyArchConfig:
    """Shape of a from-scratch model: Qwen2, Qwen3-MoE with ``num_experts > 0``, or Qwen2.5-VL with ``vision``."""

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
    vision: bool = field(default=False, metadata={
        "help": "a Qwen2.5-VL model: a small vision tower in front of this language model, with M-RoPE (the "
                "tokenizer must have the vision tokens <|vision_start|> <|image_pad|> <|vision_end|>)"})
    vision_depth: int = field(default=2, metadata={"help": "vision: transformer blocks of the vision tower"})
    vision_hidden_size: int = field(default=32, metadata={"help": "vision: the vision tower's width (2 heads)"})

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
        if self.vision and (self.num_experts or self.vision_depth < 1 or self.vision_hidden_size % 2
                            or (self.hidden_size // self.num_attention_heads) % 8):
            raise ValueError(f"model.arch.vision: needs a dense model (num_experts=0), vision_depth >= 1, an even "
                             f"vision_hidden_size and a head width (hidden_size/num_attention_heads="
                             f"{self.hidden_size // self.num_attention_heads}) divisible by 8 (M-RoPE sections)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.arch.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads} (query groups share a KV head)")


def planned_hf_config(arch: TinyArchConfig) -> dict:
    """The structural HF config :func:`ensure_random_checkpoint` will write (for layout checks
    before it runs).  The vocabulary is the tokenizer's, unknown until it is built: a small
    stand-in (megatron pads the vocabulary to a multiple of 128 x tp, so tp always divides it)."""
    if arch.vision:
        text = {"vocab_size": 128, **_dense_fields(arch), "rope_parameters": _mrope(arch)}
        return {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"], "vocab_size": 128,
                "vocab_size_unknown": True, **_dense_fields(arch), "text_config": text,
                "vision_config": _vision_fields(arch),
                # stand-ins too: the tokenizer's vision ids are known once it is built
                "image_token_id": 0, "vision_start_token_id": 1, "vision_end_token_id": 2}
    if arch.num_experts:
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128,
                "vocab_size_unknown": True, **_moe_fields(arch)}
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 128,
            "vocab_size_unknown": True, **_dense_fields(arch)}


_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_VISION_KEYS = ("vision", "vision_depth", "vision_hidden_size")


def _dense_fields(arch: TinyArchConfig) -> dict:
    return {k: v for k, v in asdict(arch).items() if k not in _MOE_KEYS + _VISION_KEYS}


def _mrope(arch: TinyArchConfig) -> dict:
    """M-RoPE over the head's rotary pairs, split temporal/height/width as Qwen2.5-VL does (16/24/24 of 64)."""
    half = arch.hidden_size // arch.num_attention_heads // 2
    t = half // 4
    h = (half - t) // 2
    return {"rope_type": "default", "rope_theta": arch.rope_theta, "mrope_section": [t, h, half - t - h]}


def _vision_fields(arch: TinyArchConfig) -> dict:
    """The tower: Qwen2.5-VL's 14px patches, 2x2 merge, window attention with the last block full."""
    return {"depth": arch.vision_depth, "hidden_size": arch.vision_hidden_size, "num_heads": 2,
            "intermediate_size": 2 * arch.vision_hidden_size, "out_hidden_size": arch.hidden_size,
            "fullatt_block_indexes": [arch.vision_depth - 1], "window_size": 56, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}


def _vision_config(arch: TinyArchConfig, tok) -> object:
    """A Qwen2.5-VL config for ``tok``: the special ids inside ``text_config`` as well (transformers 5 reads them there)."""
    from transformers import Qwen2_5_VLConfig

    vocab = tok.get_vocab()
    missing = [t for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>") if t not in vocab]
    if missing:
        raise ValueError(f"model.arch.vision: the tokenizer lacks the vision tokens {', '.join(missing)}")
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(_dense_fields(arch), vocab_size=len(tok), rope_parameters=_mrope(arch), **ids)
    text.pop("rope_theta", None)
    return Qwen2_5_VLConfig(text_config=text, vision_config=_vision_fields(arch),
                            image_token_id=vocab["<|image_pad|>"], video_token_id=vocab.get("<|video_pad|>", 0),
                            vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
                            tie_word_embeddings=arch.tie_word_embeddings, torch_dtype="float32", **ids)


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
    """Write a seeded random Qwen2 (Qwen3-MoE, Qwen2.5-VL) model and the tokenizer to ``out_dir`` unless present."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    marker = os.path.join(out_dir, "realflow_init.json")
    recorded = asdict(arch) if arch.vision else {k: v for k, v in asdict(arch).items() if k not in _VISION_KEYS}
    params = {"arch": recorded, "seed": seed, "tokenizer": os.path.abspath(tokenizer_dir)}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == params:
                return out_dir
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the launcher's console to realflow's own lines
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if arch.vision:
        from transformers import Qwen2_5_VLForConditionalGeneration

        from realflow.api.images import ImageProcessing

        config = _vision_config(arch, tok)
        os.makedirs(out_dir, exist_ok=True)
        ImageProcessing().processor().save_pretrained(out_dir)  # preprocessor_config.json, as hub VL models have
        return _save_random(Qwen2_5_VLForConditionalGeneration, config, tok, seed, out_dir, marker, params)
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
    return _save_random(model_cls, config, tok, seed, out_dir, marker, params)


def _save_random(model_cls, config, tok, seed: int, out_dir: str, marker: str, params: dict) -> str:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    with open(marker, "w") as f:
        json.dump(params, f, indent=1)
    return out_dir
