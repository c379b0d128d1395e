"""Images in data rows: where a row's images come from, and where its prompt puts them.

Why one module: an image must be found (a path relative to the data file, base64, a data
URL, parquet bytes, a ``datasets`` Image struct), checked (exists, decodes, not too big) and
matched to its placeholder while the file is read -- so that a bad image fails at the edge as
``train.jsonl:17: field 'images'[0]: ...``, before a worker starts -- and every row then carries
its images as encoded bytes, whatever form the file held them in.

Conventions (verl / LLaVA / TRL):

* a row's images are in ``images`` (a list, or one item) or ``image`` (``dataset.image_key``
  names another field); an item is a path (relative to the data file's directory, or
  absolute), a base64 string, a ``data:image/...;base64,`` URL, raw bytes, or a dict
  ``{"bytes": ..., "path": ...}`` (``datasets``' Image feature in parquet);
* a text prompt marks image ``i`` with the ``i``-th ``<image>``; a conversational prompt with
  ``{"type": "image"}`` (or ``image_url``) content parts, which are read as ``<image>`` in the
  message's text. A part may carry its image inline (``"image"``, ``"image_url": {"url"}``)
  instead of an ``images`` field;
* a prompt with images but no placeholder gets them all **before** its text (in the first
  user turn), as verl's and TRL's processors do; a prompt with placeholders must have exactly
  as many as images.

Rendering turns each placeholder into ``<|vision_start|><|image_pad|><|vision_end|>`` (a VL
chat template does it from the image parts; without a template the text is replaced), and
``<|image_pad|>`` is then repeated to the image's feature count
(:func:`realflow.api.images.expand_image_tokens`).
"""
from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from realflow.api.data_formats import RowInvalid
from realflow.api.images import ImageError, ImageProcessing, decode_image

__all__ = ["IMAGE_FIELDS", "IMAGE_PLACEHOLDER", "IMAGE_PART_TYPES", "VisionTokens", "vision_tokens",
           "take_row_images", "resolve_image", "count_placeholders", "place_images", "to_content_parts",
           "plain_image_text", "is_vision_language", "first_image_row"]

IMAGE_FIELDS = ("images", "image")  # where a row keeps its images (dataset.image_key overrides)
IMAGE_PLACEHOLDER = "<image>"
IMAGE_PART_TYPES = ("image", "image_url")
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
_B64_MAGIC = ("iVBOR", "/9j/", "R0lG", "UklG", "Qk")  # PNG, JPEG, GIF, WEBP, BMP


# ----------------------------------------------------------------------------- sources -> bytes

def resolve_image(item: Any, base_dir: str, limits: ImageProcessing) -> bytes:
    """One image item of a row -> its encoded bytes, checked to decode within ``limits``.

    Raises :class:`ImageError` with the reason (the caller adds file, row and field)."""
    data = _image_bytes(item, base_dir, limits)
    decode_image(data, limits)  # corrupt, not an image, too many bytes or pixels: fail now
    return data


def _image_bytes(item: Any, base_dir: str, limits: ImageProcessing) -> bytes:
    if isinstance(item, dict):
        if item.get("bytes"):
            return _image_bytes(item["bytes"], base_dir, limits)
        if item.get("path"):
            return _read_file(str(item["path"]), base_dir, limits)
        raise ImageError(f"an image object needs 'bytes' or 'path', got keys {sorted(item)[:6]}")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if not isinstance(item, str) or not item.strip():
        raise ImageError(f"an image must be a path, base64 text, a data URL, bytes or {{bytes, path}}, "
                         f"got {type(item).__name__ if not isinstance(item, str) else 'an empty string'}")
    text = item.strip()
    if text.startswith("data:"):
        head, _, payload = text.partition(",")
        if ";base64" not in head:
            raise ImageError(f"data URL {head[:40]!r} is not base64-encoded")
        return _b64(payload)
    if text.startswith(("http://", "https://")):
        raise ImageError(f"remote image {text[:60]!r} is not fetched: download it and give its path")
    if text.startswith(_B64_MAGIC) or len(text) >= 4096:
        return _b64(text)
    return _read_file(text[7:] if text.startswith("file://") else text, base_dir, limits)


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"not valid base64 image data ({e})") from None


def _read_file(path: str, base_dir: str, limits: ImageProcessing) -> bytes:
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    try:
        size = os.path.getsize(full)
        if size > limits.max_image_bytes:
            raise ImageError(f"image file {full} has {size} bytes, more than the limit of "
                             f"{limits.max_image_bytes} bytes")
        with open(full, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ImageError(f"image file {full} does not exist") from None
    except IsADirectoryError:
        raise ImageError(f"image path {full} is a directory") from None
    except OSError as e:
        raise ImageError(f"cannot read image file {full}: {e.strerror or e}") from None


# ----------------------------------------------------------------------------- rows

def _inline_parts(value: Any) -> list[tuple[int, int, Any]]:
    """(message, part, source) of every image part that carries its image inline."""
    out = []
    if isinstance(value, (list, tuple)):
        for i, m in enumerate(value):
            content = m.get("content") if isinstance(m, dict) else None
            for j, p in enumerate(content if isinstance(content, list) else []):
                if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES:
                    src = p.get("image")
                    if src is None and isinstance(p.get("image_url"), dict):
                        src = p["image_url"].get("url")
                    elif src is None:
                        src = p.get("image_url")
                    if src is not None:
                        out.append((i, j, src))
    return out


def take_row_images(raw: dict, image_key: Optional[str], base_dir: str,
                    limits: ImageProcessing) -> tuple[dict, tuple[bytes, ...]]:
    """(the row without its image field, its images as checked bytes).

    The field is ``image_key`` when given, else ``images`` or ``image``; images inline in
    content parts are taken when the row has no such field. A bad image raises
    :class:`RowInvalid` naming the field and the item."""
    keys = (image_key,) if image_key else IMAGE_FIELDS
    present = [k for k in keys if k in raw]
    if len(present) > 1:
        raise RowInvalid(f"the row has both fields {present[0]!r} and {present[1]!r}: give its images in one")
    key = present[0] if present else None
    if image_key and key is None:
        raise RowInvalid(f"missing field {image_key!r} (dataset.image_key)")
    items: list[tuple[str, Any]] = []
    rest = raw
    if key is not None:
        rest = {k: v for k, v in raw.items() if k != key}
        value = raw[key]
        if value is None:
            value = []
        listed = value if isinstance(value, (list, tuple)) else [value]
        items = [(f"field {key!r}[{i}]", v) for i, v in enumerate(listed)]
    for field_name, value in raw.items():
        for i, j, src in _inline_parts(value):
            if key is not None:
                raise RowInvalid(f"field {field_name!r}[{i}] content part {j} carries an image and the row has "
                                 f"field {key!r} too: give each image once")
            items.append((f"field {field_name!r}[{i}] content part {j}", src))
    out = []
    for where, item in items:
        try:
            out.append(resolve_image(item, base_dir, limits))
        except ImageError as e:
            raise RowInvalid(f"{where}: {e}") from None
    return rest, tuple(out)


def count_placeholders(prompt: Any) -> int:
    """``<image>`` marks in a text prompt or in every message's text (image parts read as one)."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in prompt)


def place_images(prompt: Any, n_images: int, field_name: str = "prompt") -> Any:
    """``prompt`` with its ``n_images`` placeholders: unchanged when it has exactly that many, all
    images before the text (of the first user turn) when it has none; else :class:`RowInvalid`."""
    found = count_placeholders(prompt)
    if found == n_images:
        return prompt
    if found == 0:
        marks = IMAGE_PLACEHOLDER * n_images
        if isinstance(prompt, str):
            return marks + prompt
        msgs = [dict(m) for m in prompt]
        for m in msgs:
            if m.get("role") == "user":
                m["content"] = marks + str(m.get("content", ""))
                return msgs
        raise RowInvalid(f"field {field_name!r} has {n_images} image(s) but no user turn to show them in")
    more = "more" if n_images > found else "fewer"
    raise RowInvalid(f"field {field_name!r} has {found} image placeholder(s) ('<image>' or an image content "
                     f"part) but the row has {n_images} image(s): {more} images than placeholders")


def to_content_parts(messages: Sequence[dict]) -> list[dict]:
    """Messages whose text holds ``<image>`` -> content-part lists (``{"type": "image"}`` and
    ``{"type": "text"}``), the form VL chat templates (Qwen2.5-VL's) render images from."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts: list[dict] = []
            for k, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = dict(m, content=parts)
        out.append(m)
    return out


def plain_image_text(text: str) -> str:
    """A template-less prompt's text with each ``<image>`` as the vision markup."""
    return text.replace(IMAGE_PLACEHOLDER, VISION_START + IMAGE_PAD + VISION_END)


# ----------------------------------------------------------------------------- tokenizer, model

@dataclass(frozen=True)
class VisionTokens:
    """The ids of the vision markup in a tokenizer."""
    image_pad: int
    vision_start: int
    vision_end: int


def vision_tokens(tokenizer: Any) -> VisionTokens:
    """The tokenizer's ``<|image_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` ids; a tokenizer
    without them cannot carry images (a :class:`ValueError` naming the missing tokens)."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in (IMAGE_PAD, VISION_START, VISION_END) if t not in vocab]
    if missing:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"the data set has images but tokenizer {name!r} lacks the vision tokens "
                         f"{', '.join(missing)}: use a vision-language model's tokenizer (e.g. Qwen2.5-VL's)")
    return VisionTokens(vocab[IMAGE_PAD], vocab[VISION_START], vocab[VISION_END])


def is_vision_language(config: dict) -> bool:
    """Whether an HF ``config.json`` describes a model with a vision tower (Qwen2-VL, Qwen2.5-VL, ...)."""
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def first_image_row(path: str, image_key: Optional[str] = None) -> Optional[tuple[int, str, str]]:
    """(row number, unit, field) of the first row of ``path`` that has images, or None. Reads the
    rows only (no image is opened): the launcher's check that a text-only model gets no images."""
    from realflow.data.readers import read_records

    keys = (image_key,) if image_key else IMAGE_FIELDS
    for n, raw, unit in read_records(path, bad=[]):
        for k in keys:
            v = raw.get(k)
            if v not in (None, [], ()):
                return n, unit, k
        for name, value in raw.items():
            if isinstance(value, (list, tuple)) and any(
                    isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                    for m in value if isinstance(m, dict) and isinstance(m.get("content"), list)
                    for p in m["content"]):
                return n, unit, name
    return None
