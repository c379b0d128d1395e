"""Image prompts in the MFCs: from the batch's image keys to the engine's per-sequence images.

A sample of a vision-language data set carries its prompt's images once (keys
``pixel_values`` / ``image_grid_thw``, one "sequence" each per sample, see
:mod:`realflow.api.images`), while its ``packed_input_ids`` hold ``n`` responses to that
prompt: every response is conditioned on the same images. The engines take one
:class:`ImageInputs` (or None) per packed sequence, so the sample's images are repeated
for each of its sequences here, the one place that knows both layouts.
"""
from __future__ import annotations

from typing import Optional

from realflow.api.batch import SequenceBatch
from realflow.api.images import IMAGE_GRID, IMAGE_PIXELS, ImageInputs
from realflow.api.keys import INPUT_IDS

__all__ = ["has_images", "sample_images", "sequence_images", "image_data"]


def has_images(batch: SequenceBatch) -> bool:
    return IMAGE_PIXELS in batch.data and IMAGE_GRID in batch.data


def sample_images(batch: SequenceBatch, index: int) -> Optional[ImageInputs]:
    """Sample ``index``'s images (None when it has none or the batch carries no images)."""
    if not has_images(batch):
        return None
    grid = batch.sequences(IMAGE_GRID, index)[0]
    if grid.shape[0] == 0:
        return None
    return ImageInputs(batch.sequences(IMAGE_PIXELS, index)[0].float(), grid.long().reshape(-1, 3))


def sequence_images(batch: SequenceBatch, key: str = INPUT_IDS) -> Optional[list[Optional[ImageInputs]]]:
    """One entry per packed sequence of ``key`` (a sample's images for each of its sequences);
    None for a batch without image keys (text-only data: nothing changes)."""
    if not has_images(batch):
        return None
    out: list[Optional[ImageInputs]] = []
    for i, lens in enumerate(batch.seqlens[key]):
        images = sample_images(batch, i)
        out.extend([images] * len(lens))
    return out


def image_data(batch: SequenceBatch) -> tuple[dict[str, list[list[int]]], dict]:
    """The image keys' ``(seqlens, data)`` of ``batch`` (empty when it has none), to carry them
    into a derived batch (e.g. the PPO update's mini-batches)."""
    if not has_images(batch):
        return {}, {}
    keys = (IMAGE_PIXELS, IMAGE_GRID)
    return {k: batch.seqlens[k] for k in keys}, {k: batch.data[k] for k in keys}
