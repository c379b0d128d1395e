"""Rows with images to token ids: the chat rendering of :mod:`.chat_render`, plus the vision markup.

Why apart from :mod:`.chat_render`: text rows are rendered in one batched tokenizer call, and
nothing about them changes; a row with images is rendered on its own, because its ids depend
on its images' sizes -- each ``<|image_pad|>`` the template (or, without one, the ``<image>``
replacement) writes is repeated to ``t*h*w/merge**2`` tokens, the features the vision tower
gives for that image. The images are processed once here, by transformers' processor
(:func:`realflow.api.images.process_images`), so the grid that sizes the prompt and the pixels
the trainer sees cannot disagree.
"""
from __future__ import annotations

from typing import Any

from realflow.api.images import ImageError, ImageInputs, ImageProcessing, image_token_counts, process_images
from realflow.data.chat_render import (ChatTemplateError, PromptFormat, _plain_text, conversation_ids,
                                       prompt_messages, render_chat_text, template_of)
from realflow.data.images import VisionTokens, plain_image_text, to_content_parts, vision_tokens

__all__ = ["render_image_prompt", "render_image_conversation", "expand_with_mask"]


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer([text], add_special_tokens=special)["input_ids"][0])


def _inputs(row: Any, processing: ImageProcessing) -> ImageInputs:
    try:
        return process_images(list(row.images), processing)
    except ImageError as e:
        raise ImageError(f"row {row.id!r}: {e}") from None


def _tokens(tokenizer: Any, row: Any) -> VisionTokens:
    try:
        return vision_tokens(tokenizer)
    except ValueError as e:
        raise ValueError(f"row {row.id!r}: {e}") from None


def expand_with_mask(ids: list[int], mask: list[int], inputs: ImageInputs, tokens: VisionTokens,
                     merge_size: int, row_id: str = "") -> tuple[list[int], list[int]]:
    """``ids`` (one ``<|image_pad|>`` per image) with each image's pad repeated to its feature
    count, and ``mask`` repeated alongside; a rendering whose pads and images disagree in number
    (a chat template that drops image parts) is a :class:`ChatTemplateError`."""
    counts = image_token_counts(inputs.grid_thw, merge_size)
    found = sum(1 for t in ids if t == tokens.image_pad)
    if found != len(counts):
        raise ChatTemplateError(
            f"row {row_id!r}: the prompt renders {found} <|image_pad|> token(s) for {len(counts)} image(s): the "
            "chat template does not render image content parts (use a vision-language template such as "
            "Qwen2.5-VL's, or dataset.chat_template=none)")
    out_ids: list[int] = []
    out_mask: list[int] = []
    it = iter(counts)
    for t, m in zip(ids, mask):
        k = next(it) if t == tokens.image_pad else 1
        out_ids.extend([t] * k)
        out_mask.extend([m] * k)
    return out_ids, out_mask


def render_image_prompt(tokenizer: Any, row: Any, fmt: PromptFormat,
                        processing: ImageProcessing) -> tuple[list[int], ImageInputs]:
    """(prompt ids with the image tokens expanded, the processed images) of a row with images.

    With a chat template the ``<image>`` marks become ``{"type": "image"}`` parts, which the
    template renders (Qwen2.5-VL's writes ``<|vision_start|><|image_pad|><|vision_end|>``);
    without one each mark is replaced by that markup and the text encoded as it is."""
    tokens = _tokens(tokenizer, row)
    inputs = _inputs(row, processing)
    template = template_of(tokenizer, fmt)
    if template is None:
        ids = _encode(tokenizer, plain_image_text(_plain_text(row.prompt, fmt)), special=True)
    else:
        msgs = to_content_parts(prompt_messages(row.prompt, fmt))
        ids = _encode(tokenizer, render_chat_text(tokenizer, msgs, template, fmt.add_generation_prompt),
                      special=False)
    ids, _ = expand_with_mask(ids, [1] * len(ids), inputs, tokens, processing.merge_size, row.id)
    return ids, inputs


def render_image_conversation(tokenizer: Any, row: Any, fmt: PromptFormat,
                              processing: ImageProcessing) -> tuple[list[int], list[int], ImageInputs]:
    """(ids, no-loss mask, images) of an SFT row with images: the conversation through the chat
    template (assistant tokens carry the loss, image tokens never do), or without a template the
    prompt text (vision markup in place of ``<image>``) followed by the response and EOS."""
    tokens = _tokens(tokenizer, row)
    inputs = _inputs(row, processing)
    template = template_of(tokenizer, fmt)
    if template is None and row.messages is None and isinstance(row.prompt, str):
        p = _encode(tokenizer, plain_image_text(_plain_text(row.prompt, fmt)), special=True)
        a = _encode(tokenizer, row.response, special=False)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("SFTDataset: the tokenizer has no eos_token_id")
        if not a or a[-1] != eos:
            a = a + [eos]
        ids, mask = p + a, [1] * len(p) + [0] * len(a)
    else:
        msgs = row.messages
        if msgs is None:
            msgs = prompt_messages(row.prompt, fmt) + [{"role": "assistant", "content": row.response}]
        try:
            ids, mask = conversation_ids(tokenizer, to_content_parts(msgs), fmt)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"row {row.id!r}: {e}") from None
    ids, mask = expand_with_mask(ids, mask, inputs, tokens, processing.merge_size, row.id)
    return ids, mask, inputs
