"""Prompts with images on the rollout side: placeholders, the model's image token, wire form.

Why one module: the gen server, the rollout worker and the OpenAI proxy all turn "ids + images"
into what the engine and the trainer take -- each image's placeholder expanded to its feature
count (``t*h*w / merge**2`` tokens, from the processor's grid) -- and must agree exactly. A
prompt may hold one placeholder per image (a chat template's rendering), every image's
expanded run (a data set's, or a resubmitted prompt), or both (a proxy prompt spliced onto an
earlier, already expanded turn): :func:`expand_prompt` takes all three.
"""
from __future__ import annotations

import base64
import json
import os
from typing import Any, Optional, Sequence

from realflow.api.images import ImageError, ImageInputs, ImageProcessing, image_token_counts, process_images

__all__ = ["VL_MODEL_TYPES", "image_tokens_of", "expand_prompt", "prompt_images", "wire_images"]

#: model types whose configs carry a vision tower (as parallel.vision.VL_MODEL_TYPES; realflow never imports parallel)
VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


def image_tokens_of(model_path: str) -> Optional[tuple[int, int]]:
    """``(image_token_id, spatial merge size)`` of a checkpoint's ``config.json``; None for a text model."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in VL_MODEL_TYPES:
        return None
    return int(cfg["image_token_id"]), int((cfg.get("vision_config") or {}).get("spatial_merge_size", 2))


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == token:
            j = i
            while j < n and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_prompt(ids: Sequence[int], grid_thw: Any, token: int, merge: int) -> list[int]:
    """``ids`` with every image's placeholders expanded; :class:`ImageError` naming the counts when
    the placeholders fit the images in no form (one per image, expanded, or a mix by run)."""
    counts = image_token_counts(grid_thw, merge)
    ids = [int(t) for t in ids]
    runs = _runs(ids, token)
    found = sum(n for _, n in runs)
    if found == sum(counts) and (len(runs) == len(counts) or not counts):
        return ids
    if len(runs) != len(counts) or any(n not in (1, c) for (_, n), c in zip(runs, counts)):
        raise ImageError(f"the prompt holds {found} image placeholder token(s) (image_token_id={token}) in "
                         f"{len(runs)} run(s) for {len(counts)} image(s) of {'+'.join(map(str, counts)) or '0'} "
                         f"tokens: give one placeholder per image, or each image's expanded run")
    out, pos = [], 0
    for (start, n), c in zip(runs, counts):
        out += ids[pos:start] + [token] * c
        pos = start + n
    return out + ids[pos:]


def wire_images(sources: Sequence[Any]) -> list[str]:
    """Images as JSON carries them: bytes -> base64; base64 strings and data URLs unchanged."""
    out = []
    for s in sources:
        if isinstance(s, (bytes, bytearray, memoryview)):
            out.append(base64.b64encode(bytes(s)).decode("ascii"))
        elif isinstance(s, str):
            out.append(s)
        else:
            raise ImageError(f"an image to send must be bytes, a base64 string or a data URL, got {type(s).__name__}")
    return out


def prompt_images(ids: Sequence[int], sources: Sequence[Any], image_tokens: Optional[tuple[int, int]],
                  processing: ImageProcessing) -> tuple[list[int], ImageInputs]:
    """(expanded ids, the images as the trainer takes them) of one prompt; ImageError says what is wrong."""
    if image_tokens is None:
        raise ImageError("this model is text-only (no vision tower): it takes no images")
    images = process_images(list(sources), processing)
    token, merge = image_tokens
    return expand_prompt(ids, images.grid_thw, token, merge), images
