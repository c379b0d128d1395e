"""The data and prompt keys every experiment shares: where the data is, which fields hold what,
how prompts are rendered, and how long they may be.

Why one declaration: SFT, sync RL and async RL read the same files users bring (jsonl,
json, parquet, a saved ``datasets`` directory; see ``docs/data.md``) and must render
prompts identically in the trainer, the evaluation and the rollout workers. The keys are
declared once here and become one ``DatasetSpec.args`` dict (:meth:`UserDataConfig.data_args`),
which every process turns into the same rendering
(:func:`realflow.data.source.prompt_format_of`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from realflow.data.chat_render import load_template_file

DATA_FILES_HELP = "jsonl, json, parquet, or a directory saved by datasets' save_to_disk"


@dataclass
class UserDataConfig:
    """Data keys shared by every experiment (subclasses add their generated-task keys)."""

    train_path: str = field(default="", metadata={
        "help": f"training data: {DATA_FILES_HELP} ('' = the generated task)"})
    test_path: str = field(default="", metadata={
        "help": "held-out data, same formats ('' = the generated task's; none when train_path is given)"})
    prompt_key: str = field(default="", metadata={
        "help": "field holding the prompt: text or a list of {role, content} ('' = prompt | question | problem, "
                "or messages); dotted names reach nested fields"})
    answer_key: str = field(default="", metadata={
        "help": "field holding the reference answer ('' = answer | ground_truth | reward_model.ground_truth, or "
                "the final answer of solution / the last assistant message: '#### 19' or \\boxed{19})"})
    image_key: str = field(default="", metadata={
        "help": "field holding a row's images: a list of paths (relative to the data file), base64, data URLs, "
                "bytes or {bytes, path} ('' = images | image)"})
    min_pixels: int = field(default=0, metadata={
        "help": "images are resized to at least this many pixels (0 = the model's preprocessor_config.json, "
                "else 56*56)"})
    max_pixels: int = field(default=0, metadata={
        "help": "images are resized to at most this many pixels (0 = the model's preprocessor_config.json, "
                "else 28*28*1280); fewer pixels, fewer image tokens"})
    chat_template: str = field(default="auto", metadata={
        "help": "auto (the tokenizer's chat template when it has one) | none (prompt text as it is) | "
                "PATH.jinja (this template)"})
    system_prompt: str = field(default="", metadata={
        "help": "system message put first in every prompt without one (needs a chat template)"})
    add_generation_prompt: bool = field(default=True, metadata={
        "help": "end each prompt with the template's assistant header"})
    filter_overlong: bool = field(default=False, metadata={
        "help": "drop rows longer than the length limits (false: a run with such rows is refused before it "
                "starts, naming the count and the limit to set)"})

    def _check_user_data(self) -> None:
        if self.chat_template not in ("auto", "none"):
            if not self.chat_template.endswith((".jinja", ".j2", ".jinja2", ".txt")) \
                    and not os.path.exists(self.chat_template):
                raise ValueError(f"dataset.chat_template={self.chat_template!r}: auto | none | a template file "
                                 "(PATH.jinja)")
            load_template_file(self.chat_template)  # unreadable or not Jinja: file and line, now
        if self.system_prompt and self.chat_template == "none":
            raise ValueError("dataset.system_prompt needs a chat template (dataset.chat_template=auto or PATH.jinja)")
        if self.min_pixels < 0 or self.max_pixels < 0 or (self.min_pixels and self.max_pixels
                                                          and self.min_pixels > self.max_pixels):
            raise ValueError(f"dataset.min_pixels={self.min_pixels}, dataset.max_pixels={self.max_pixels}: need "
                             "0 <= min_pixels <= max_pixels (0 = the model's)")

    def data_args(self, image_inputs: bool = False, **limits: Optional[int]) -> dict[str, Any]:
        """``DatasetSpec.args`` of these keys plus the given length limits (None ones left out).
        ``image_inputs``: the model takes images (a VL experiment), so every sample carries the image
        keys, empty for a row without images (see :mod:`realflow.data.source`)."""
        args: dict[str, Any] = {k: v for k, v in limits.items() if v is not None}
        if image_inputs:
            args["image_inputs"] = True
        if self.chat_template in ("auto", "none"):
            args["chat_template"] = self.chat_template
        else:  # the template's text travels with the spec: every process renders with the same one
            args["chat_template"] = "tokenizer"
            args["chat_template_text"] = load_template_file(self.chat_template)
        if self.system_prompt:
            args["system_prompt"] = self.system_prompt
        if not self.add_generation_prompt:
            args["add_generation_prompt"] = False
        for key in ("prompt_key", "answer_key", "response_key", "image_key", "min_pixels", "max_pixels"):
            if getattr(self, key, ""):
                args[key] = getattr(self, key)
        if self.filter_overlong:
            args["filter_overlong"] = True
        return args


def context_length(hf_config: Optional[dict]) -> Optional[int]:
    """The model's context (``max_position_embeddings``, stretched by RoPE scaling), or None."""
    from realflow.base.hf_models import model_context_length

    return model_context_length(hf_config) if hf_config else None
