"""``image_data`` of the gen server's ``/generate`` (vision-language models), as SGLang takes it.

Why a module of its own: parsing and processing images is the one part of a request that
costs real CPU before the engine sees it, so it runs on a worker thread, never on the event
loop (``/health`` must answer at once) nor under the backend lock (the engine keeps stepping).

Forms (SGLang's): for one prompt, ``image_data`` is one image or a list of them; for a batch of
prompts, a list with one entry per prompt (an image, a list of images, or null). An image is a
base64 string or a ``data:image/...;base64,`` URL (no URLs: servers fetch nothing). The prompt's
``input_ids`` hold either one ``image_token_id`` per image, which the server expands to each
image's feature count with its pixel budget (``--min-pixels`` / ``--max-pixels``), or every
image's placeholders already expanded (what a trainer-side data set stores).
"""
from __future__ import annotations

from typing import Any, Optional

from realflow.rollout.gen_server_state import BadRequest

__all__ = ["parse_image_data", "prepare_images"]


def _one(entry: Any, where: str) -> Optional[list[str]]:
    if entry is None:
        return None
    items = entry if isinstance(entry, list) else [entry]
    for j, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise BadRequest(f"{where}[{j}] must be a base64 string or a data: URL, got {type(item).__name__}")
        if item.startswith(("http://", "https://", "file:")):
            raise BadRequest(f"{where}[{j}]: only base64 images and data: URLs are accepted (the server fetches "
                             f"no URL): {item[:60]!r}")
    return list(items) or None


def parse_image_data(body: dict[str, Any], n_prompts: int, single: bool) -> Optional[list[Optional[list[str]]]]:
    """Each prompt's image sources (None: no image), or None when the request has no ``image_data``."""
    data = body.get("image_data")
    if data is None:
        return None
    if single:
        return [_one(data, "image_data")]
    if not isinstance(data, list) or len(data) != n_prompts:
        raise BadRequest(f"image_data must be a list with one entry per prompt ({n_prompts}), each an image, "
                         f"a list of images or null")
    out = [_one(d, f"image_data[{i}]") for i, d in enumerate(data)]
    return out if any(x is not None for x in out) else None


def prepare_images(prompts: list[Any], sources: list[Optional[list[str]]], image_tokens: Optional[tuple[int, int]],
                   min_pixels: int, max_pixels: int) -> tuple[list[list[int]], list[Any]]:
    """(prompts with expanded placeholders, each prompt's ``ImageInputs`` or None); BadRequest naming the
    prompt on a bad image or a placeholder count that fits neither form. Runs on a worker thread."""
    from realflow.api.images import ImageError, ImageProcessing
    from realflow.rollout.image_prompts import prompt_images

    if image_tokens is None:
        raise BadRequest("image_data: this model is text-only (it has no vision tower); send no images")
    processing = ImageProcessing(min_pixels=min_pixels, max_pixels=max_pixels)
    many = len(prompts) > 1
    out_ids, out_images = [], []
    for i, (ids, srcs) in enumerate(zip(prompts, sources)):
        where = f"prompt {i}: " if many else ""
        if srcs is None:
            out_ids.append(ids)
            out_images.append(None)
            continue
        try:
            ids, images = prompt_images(ids, srcs, image_tokens, processing)
        except ImageError as e:
            raise BadRequest(f"{where}image_data: {e} (min_pixels={min_pixels}, max_pixels={max_pixels})") from None
        out_ids.append(ids)
        out_images.append(images)
    return out_ids, out_images
