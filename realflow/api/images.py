"""Images as model inputs: what a vision-language prompt carries, one definition for every process.

Why here (``realflow/api``): the data layer makes image inputs, the generation engine, the gen
server, the OpenAI-compatible proxy and the trainer consume them; all of them may import the
api layer, none may import each other.

An image becomes model input exactly as Hugging Face's processor makes it:
:func:`process_images` runs transformers' Qwen2-VL image processor (resize to the pixel
budget, normalise, cut into ``temporal x patch x patch`` patches), so the pixels the vision
tower sees are bit-identical to ``AutoProcessor``'s. Each image then stands for
``t * h * w / merge**2`` placeholder tokens in the prompt (:func:`expand_image_tokens`), which the
model replaces by the vision tower's features.

On the data plane an image prompt is two keys (one "sequence" per sample, shared by all the
sample's responses): ``pixel_values`` ``[patches, channels * temporal * patch * patch]``
float32, all the sample's images in order, and ``image_grid_thw`` ``[images, 3]`` int64.
"""
from __future__ import annotations

import base64
import functools
import io
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

__all__ = ["IMAGE_PIXELS", "IMAGE_GRID", "IMAGE_KEYS", "IMAGES_EXTRA", "ImageInputs", "ImageProcessing", "ImageError", "ImageSource",
           "decode_image", "process_images", "image_token_counts", "expand_image_tokens"]

#: the processor's patches of a sample's images, ``[patches, C*T*P*P]`` float32 (one sequence per sample)
IMAGE_PIXELS = "pixel_values"
#: each image's ``(t, h, w)`` patch grid, ``[images, 3]`` int64 (one sequence per sample)
IMAGE_GRID = "image_grid_thw"

#: both keys, in the order graphs list them
IMAGE_KEYS = (IMAGE_PIXELS, IMAGE_GRID)

#: the key of a training micro-batch's ``extra`` holding one ImageInputs (or None) per sequence
IMAGES_EXTRA = "images"

#: what a caller may hand over as one image: encoded bytes, a base64 string (optionally a
#: ``data:image/...;base64,`` URL), a local path, or a PIL image
ImageSource = Union[bytes, str, Any]


class ImageError(ValueError):
    """An image that cannot be used; the message says which and why (callers add file/row/field)."""


@dataclass(frozen=True)
class ImageProcessing:
    """The pixel budget of the image processor (``dataset.min_pixels`` / ``dataset.max_pixels``).

    Defaults are Qwen2.5-VL's processor defaults scaled down to CPU-sized images; a model's own
    ``preprocessor_config.json`` values come through :meth:`from_pretrained_dir` when present.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    max_image_bytes: int = 64 << 20  # refuse bigger encoded images before decoding them
    #: refuse images of more pixels before decoding them (PIL's decompression-bomb limit, ~89 Mpx)
    max_image_pixels: int = 89_478_485

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ImageError(f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels}, "
                             f"max_pixels={self.max_pixels}")

    @classmethod
    def from_pretrained_dir(cls, path: Optional[str], **overrides: Any) -> "ImageProcessing":
        """The budget of a model's ``preprocessor_config.json`` (when ``path`` has one), then
        ``overrides`` (``None`` or 0 values are ignored: the model's, else the defaults, stay)."""
        import json
        import os

        fields: dict[str, Any] = {}
        cfg_path = os.path.join(path, "preprocessor_config.json") if path else ""
        if cfg_path and os.path.isfile(cfg_path):
            try:
                with open(cfg_path) as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise ImageError(f"cannot read {cfg_path}: {e}") from None
            size = cfg.get("size") or {}
            fields["min_pixels"] = cfg.get("min_pixels") or size.get("shortest_edge")
            fields["max_pixels"] = cfg.get("max_pixels") or size.get("longest_edge")
            for name in ("patch_size", "temporal_patch_size", "merge_size"):
                fields[name] = cfg.get(name)
        fields.update(overrides)
        return cls(**{k: int(v) for k, v in fields.items() if v})

    def processor(self) -> Any:
        """transformers' PIL-backed Qwen2-VL image processor with this budget (no torchvision needed)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                                        patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                                        merge_size=self.merge_size)


@dataclass
class ImageInputs:
    """A prompt's images as the vision tower takes them."""

    pixel_values: torch.Tensor  # [patches, C*T*P*P] float32
    grid_thw: torch.Tensor  # [images, 3] int64

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    @staticmethod
    def empty(patch_dim: int = 3 * 2 * 14 * 14) -> "ImageInputs":
        return ImageInputs(torch.zeros((0, patch_dim), dtype=torch.float32), torch.zeros((0, 3), dtype=torch.int64))

    @staticmethod
    def concat(parts: Sequence["ImageInputs"]) -> "ImageInputs":
        """The images of several prompts, in order (a micro-batch's, say)."""
        if not parts:
            return ImageInputs.empty()
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.grid_thw for p in parts]))


def decode_image(source: ImageSource, limits: Optional[ImageProcessing] = None) -> Any:
    """One image source -> an RGB PIL image, or :class:`ImageError` saying what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    limits = limits or ImageProcessing()
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, str):
        text = source
        if text.startswith("data:"):
            head, _, text = text.partition(",")
            if ";base64" not in head:
                raise ImageError(f"data URL {head[:40]!r} is not base64-encoded")
        elif len(text) < 4096 and not text.startswith(("iVBOR", "/9j/", "R0lG", "UklG", "Qk")):
            raise ImageError(f"{text!r} is neither an image file read by the data layer nor base64 image data")
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError as e:
            raise ImageError(f"not valid base64 image data ({e})") from None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        raise ImageError(f"an image must be bytes, a base64 string or a PIL image, got {type(source).__name__}")
    if len(data) > limits.max_image_bytes:
        raise ImageError(f"image of {len(data)} bytes is larger than the limit of {limits.max_image_bytes} bytes")
    try:
        with warnings.catch_warnings():  # the size is checked against our own limit just below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only: the size is known before decoding
        w, h = image.size
        if w * h > limits.max_image_pixels:
            raise ImageError(f"image of {w}x{h} pixels is larger than the limit of {limits.max_image_pixels} pixels")
        image.load()
    except Image.DecompressionBombError as e:
        raise ImageError(f"image too large to decode safely ({e})") from None
    except UnidentifiedImageError:
        raise ImageError(f"not a readable image: {len(data)} bytes in no image format PIL knows (corrupt, or "
                         "not an image)") from None
    except (OSError, ValueError, SyntaxError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"not a readable image ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


@functools.lru_cache(maxsize=8)
def _processor(processing: ImageProcessing) -> Any:
    """One processor per budget: building transformers' processor costs ~8 ms, several times
    what processing a small image does (a data set of 16k images loaded 5x faster)."""
    return processing.processor()


def process_images(sources: Sequence[ImageSource], processing: Optional[ImageProcessing] = None) -> ImageInputs:
    """Images -> :class:`ImageInputs` through transformers' processor (HF-exact pixels)."""
    processing = processing or ImageProcessing()
    if not sources:
        return ImageInputs.empty(3 * processing.temporal_patch_size * processing.patch_size ** 2)
    images = [decode_image(s, processing) for s in sources]
    out = _processor(processing)(images=images, return_tensors="pt")
    return ImageInputs(out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64))


def image_token_counts(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Placeholder tokens each image stands for: ``t * h * w / merge**2``."""
    return [int(n) for n in (grid_thw.prod(-1) // (merge_size * merge_size)).tolist()]


def expand_image_tokens(ids: Sequence[int], grid_thw: torch.Tensor, image_token_id: int,
                        merge_size: int) -> list[int]:
    """Prompt ids with one ``image_token_id`` per image -> each repeated to its feature count.

    Raises :class:`ImageError` when the prompt's placeholders and its images disagree in number.
    """
    counts = image_token_counts(grid_thw, merge_size)
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise ImageError(f"the prompt has {found} image placeholder(s) but {len(counts)} image(s) were given")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == image_token_id else [t])
    return out
