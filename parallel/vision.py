"""Vision-language models (Qwen2.5-VL, Qwen2-VL): the vision tower and multimodal rotary positions.

Why the tower is transformers' own module: it is a small ViT (patch embedding, window
attention, the 2x2 patch merger) that costs a fraction of the language model, so each rank
that embeds tokens (the first pipeline stage of every data-parallel replica, on every tp rank)
keeps a whole replica of it; reusing ``Qwen2_5_VisionTransformerPretrainedModel`` makes its
features HF's by construction, and its parameters keep HF's names under ``visual.``. The
language model is megatron-core's GPT in every layout, with M-RoPE.

M-RoPE (multimodal rotary positions): every token has three positions (temporal, height,
width); text tokens have the same one on all three, an image's ``t x h x w`` (merged) grid
takes ``(t0+i, h0+j, w0+k)`` and the text after it continues from ``max + 1``. The rotary
channels are split in ``mrope_section`` chunks that rotate by the three positions in turn.
:func:`mrope_positions` is transformers' ``get_rope_index`` for one sequence (images only);
``delta`` (last position + 1 - length) shifts every later (generated) token's position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["VL_MODEL_TYPES", "VisionArch", "vision_arch", "language_config", "build_vision_tower",
           "vision_features", "mrope_positions", "image_layout", "packed_mrope_positions", "VISION_PREFIX"]

#: top-level model_type of the HF configs with a vision tower -> the class that loads them
VL_MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
#: our (and the legacy HF checkpoints') name prefix of the tower's parameters
VISION_PREFIX = "visual."


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


@dataclass(frozen=True)
class VisionArch:
    """The facts of a VL config the rest of realflow needs (the tower's own config stays HF's)."""

    model_type: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int
    mrope_section: tuple[int, ...]
    out_hidden_size: int


def language_config(hf_config: Any) -> Any:
    """The language model's config: ``text_config`` of a VL config (transformers 5 nests it), else itself."""
    text = _get(hf_config, "text_config", None)
    return hf_config if text is None else text


def vision_arch(hf_config: Any) -> Optional[VisionArch]:
    """The :class:`VisionArch` of a VL config; None for a text-only model."""
    model_type = _get(hf_config, "model_type")
    if model_type not in VL_MODEL_TYPES:
        return None
    vision = _get(hf_config, "vision_config")
    if vision is None:
        raise NotImplementedError(f"{model_type}: config has no vision_config")
    text = language_config(hf_config)
    rope = dict(_get(text, "rope_parameters", None) or _get(text, "rope_scaling", None)
                or _get(hf_config, "rope_scaling", None) or {})
    section = rope.get("mrope_section")
    if not section:
        raise NotImplementedError(f"{model_type}: rope parameters have no mrope_section")
    head_dim = int(_get(text, "hidden_size")) // int(_get(text, "num_attention_heads"))
    if 2 * sum(section) != head_dim:
        raise NotImplementedError(f"{model_type}: mrope_section {list(section)} does not cover head_dim/2="
                                  f"{head_dim // 2} rotary channels")
    out = _get(vision, "out_hidden_size", None) or _get(vision, "hidden_size")
    return VisionArch(
        model_type=model_type,
        image_token_id=int(_get(hf_config, "image_token_id")),
        vision_start_token_id=int(_get(hf_config, "vision_start_token_id")),
        vision_end_token_id=int(_get(hf_config, "vision_end_token_id")),
        spatial_merge_size=int(_get(vision, "spatial_merge_size", 2)),
        patch_size=int(_get(vision, "patch_size", 14)),
        temporal_patch_size=int(_get(vision, "temporal_patch_size", 2)),
        mrope_section=tuple(int(s) for s in section),
        out_hidden_size=int(out),
    )


def _hf_vl_config(hf_config: Any) -> Any:
    if isinstance(hf_config, dict):
        import transformers

        return transformers.AutoConfig.for_model(**hf_config)
    return hf_config


def build_vision_tower(hf_config: Any, dtype: torch.dtype = torch.float32,
                       device: Optional[torch.device] = None) -> torch.nn.Module:
    """A randomly initialised tower for ``hf_config`` (load HF weights into it by name)."""
    cfg = _hf_vl_config(hf_config)
    model_type = _get(cfg, "model_type")
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower)
    elif model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
    else:
        raise NotImplementedError(f"no vision tower for model_type={model_type!r}")
    vision_cfg = cfg.vision_config
    vision_cfg._attn_implementation = "sdpa"
    tower = Tower._from_config(vision_cfg)
    return tower.to(dtype=dtype, device=device)


def vision_features(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The merged features of every image, in order: ``[sum(t*h*w/merge**2), out_hidden]``."""
    dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(dtype), grid_thw=grid_thw)
    return out.pooler_output if hasattr(out, "pooler_output") else out


def mrope_positions(ids: torch.Tensor, grid_thw: Optional[torch.Tensor], arch: VisionArch) -> tuple[torch.Tensor, int]:
    """One sequence's ``[3, L]`` M-RoPE positions and its ``delta`` (exactly ``get_rope_index``).

    ``ids`` holds each image's placeholders already expanded (``t*h*w/merge**2`` of
    ``image_token_id`` per image, in order).
    """
    pos, delta, _ = image_layout(ids, grid_thw, arch)
    return pos, delta


def image_layout(ids: torch.Tensor, grid_thw: Optional[torch.Tensor], arch: VisionArch
                 ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(``[3, L]`` M-RoPE positions, delta, ``[L]`` bool: the tokens that take image features).

    The first runs of ``image_token_id`` are the images' placeholders, in order. Image tokens
    after the last image's are plain tokens: a policy may *generate* ``<|image_pad|>``, and the
    generator embedded it as a word at the next text position, which the trainer must do too
    (transformers tells them apart with the processor's ``mm_token_type_ids``: prompt only).
    """
    L = int(ids.numel())
    is_image = (ids == arch.image_token_id).tolist()
    grids = [] if grid_thw is None else [tuple(int(v) for v in g) for g in grid_thw.tolist()]
    merge = arch.spatial_merge_size
    out = torch.empty((3, L), dtype=torch.long)
    slots = torch.zeros(L, dtype=torch.bool)
    cur, i, g = 0, 0, 0
    while i < L:
        if not is_image[i] or g >= len(grids):
            j = i + 1
            while j < L and not (is_image[j] and g < len(grids)):
                j += 1
            out[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        t, h, w = grids[g][0], grids[g][1] // merge, grids[g][2] // merge
        n = t * h * w
        if i + n > L or not all(is_image[i:i + n]):
            raise ValueError(f"image {g} needs {n} consecutive placeholder tokens at position {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[0, i:i + n] = tt.reshape(-1) + cur
        out[1, i:i + n] = hh.reshape(-1) + cur
        out[2, i:i + n] = ww.reshape(-1) + cur
        slots[i:i + n] = True
        cur += max(h, w)
        g += 1
        i += n
    if g != len(grids):
        raise ValueError(f"{len(grids)} images but {g} placeholder runs in the sequence")
    delta = (int(out.max()) + 1 - L) if L else 0
    return out, delta, slots


def packed_mrope_positions(input_ids: torch.Tensor, seqlens: list[int], grids: list[Optional[torch.Tensor]],
                           arch: VisionArch) -> tuple[torch.Tensor, list[int]]:
    """Packed sequences -> ``[3, T]`` positions (each sequence from 0) and each sequence's delta."""
    parts, deltas, off = [], [], 0
    for n, grid in zip(seqlens, grids):
        pos, delta = mrope_positions(input_ids[off:off + n], grid, arch)
        parts.append(pos)
        deltas.append(delta)
        off += n
    return torch.cat(parts, dim=1) if parts else torch.zeros((3, 0), dtype=torch.long), deltas
