"""Prompts and conversations to token ids: the one rendering every part of a run uses.

Why one module: a prompt rendered one way for training and another for generation
(a missing generation prompt, a BOS added twice, a system prompt only on one side)
trains the model on tokens it never sees when it generates. The data sets of the
trainer and of the evaluation, the rollout workers (whose ids the generation servers
receive as they are) and the agents' OpenAI-compatible proxy all call
:func:`render_chat_text` / :func:`prompt_ids` here, so the ids cannot drift.

``chat_template`` (``dataset.chat_template``):

* ``auto`` (default): the tokenizer's chat template when it has one, else the prompt
  text as it is (with the tokenizer's special tokens, e.g. BOS);
* ``none``: never a template: a plain prompt is encoded as it is;
* ``tokenizer`` (or ``True``): the tokenizer's template, an error when it has none.

A template file (``dataset.chat_template=PATH.jinja``) is read once by the experiment
(:func:`load_template_file` checks it) and its text travels in the data set's args
(``chat_template_text``), so every process renders with the same template.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

__all__ = ["PromptFormat", "Message", "Prompt", "CHAT_TEMPLATE_MODES", "render_chat_text", "prompt_ids",
           "render_prompts", "conversation_ids", "prompt_messages", "load_template_file", "template_of", "ChatTemplateError"]

Message = dict[str, Any]
Prompt = Union[str, Sequence[Message]]
CHAT_TEMPLATE_MODES = ("auto", "none", "tokenizer")
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A chat template that is missing, unreadable or does not parse (one line)."""


@dataclass
class PromptFormat:
    """How a row's prompt becomes the model's prompt (see the module docstring).

    ``prompt_template``: a ``str.format`` template with ``{prompt}`` applied to a plain text
    prompt first (e.g. an instruction to end with ``#### <answer>``). ``system_prompt``:
    a system message put first when the conversation has none (needs a template).
    ``add_generation_prompt``: end the prompt with the template's assistant header.
    """

    chat_template: Union[bool, str] = "auto"
    system_prompt: Optional[str] = None
    prompt_template: Optional[str] = None
    add_generation_prompt: bool = True
    template_text: Optional[str] = None  # a template to use instead of the tokenizer's (a file's text)

    def __post_init__(self) -> None:
        if isinstance(self.chat_template, bool):
            self.chat_template = "tokenizer" if self.chat_template else "none"
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template={self.chat_template!r}: one of {', '.join(CHAT_TEMPLATE_MODES)} "
                             "(a template file's text goes in template_text)")
        t = self.prompt_template
        if t is not None:
            try:
                t.format(prompt="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"prompt_template {t!r} is not a valid template with only "
                                 f"{{prompt}}: {type(e).__name__}: {e}") from None
            if "{prompt}" not in t:
                raise ValueError(f"prompt_template {t!r} must contain '{{prompt}}'")
        if self.system_prompt is not None and self.chat_template == "none":
            raise ValueError("system_prompt needs a chat template (chat_template=auto or tokenizer)")


def template_of(tokenizer: Any, fmt: PromptFormat) -> Optional[str]:
    """The chat template ``fmt`` renders with, or None for plain text."""
    if fmt.chat_template == "none":
        return None
    template = fmt.template_text or getattr(tokenizer, "chat_template", None) or None
    if template is None and (fmt.chat_template == "tokenizer" or fmt.system_prompt is not None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(f"tokenizer {name!r} has no chat template (set dataset.chat_template=none, or "
                                "dataset.chat_template=PATH.jinja to supply one)")
    return template


def render_chat_text(tokenizer: Any, messages: Sequence[Message], template: Optional[str] = None,
                     add_generation_prompt: bool = True, tools: Any = None) -> str:
    """``messages`` through the chat template (``template``, else the tokenizer's) as text."""
    return tokenizer.apply_chat_template(list(messages), tools=tools or None, chat_template=template,
                                         add_generation_prompt=add_generation_prompt, tokenize=False)


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    return [list(x) for x in tokenizer(texts, add_special_tokens=special)["input_ids"]]


def prompt_messages(prompt: Prompt, fmt: PromptFormat) -> list[Message]:
    """A prompt as chat messages: a text prompt (under ``prompt_template``) is one user turn;
    ``system_prompt`` goes first when the conversation has no system turn."""
    if isinstance(prompt, str):
        text = fmt.prompt_template.format(prompt=prompt) if fmt.prompt_template else prompt
        msgs = [{"role": "user", "content": text}]
    else:
        msgs = [dict(m) for m in prompt]
    if fmt.system_prompt and not any(m.get("role") == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": fmt.system_prompt})
    return msgs


def _plain_text(prompt: Prompt, fmt: PromptFormat) -> str:
    """A prompt without a chat template: its text (a conversation must be one user turn)."""
    if isinstance(prompt, str):
        return fmt.prompt_template.format(prompt=prompt) if fmt.prompt_template else prompt
    if len(prompt) == 1 and prompt[0].get("role") == "user":
        return _plain_text(str(prompt[0].get("content", "")), fmt)
    raise ChatTemplateError(f"a conversation of {len(prompt)} messages needs a chat template, and the tokenizer "
                            "has none (or dataset.chat_template=none): set dataset.chat_template=PATH.jinja")


def render_prompts(tokenizer: Any, prompts: Sequence[Prompt], fmt: Optional[PromptFormat] = None) -> list[list[int]]:
    """Token ids of each prompt (a text or a list of ``{role, content}`` messages) under ``fmt``.
    With a template the template owns special tokens (BOS), so none are added again."""
    fmt = fmt or PromptFormat()
    template = template_of(tokenizer, fmt)
    if template is None:
        return _encode(tokenizer, [_plain_text(p, fmt) for p in prompts], special=True)
    texts = [render_chat_text(tokenizer, prompt_messages(p, fmt), template, fmt.add_generation_prompt) for p in prompts]
    return _encode(tokenizer, texts, special=False)


def prompt_ids(tokenizer: Any, prompt: Prompt, fmt: Optional[PromptFormat] = None) -> list[int]:
    """Token ids of one prompt (see :func:`render_prompts`)."""
    return render_prompts(tokenizer, [prompt], fmt)[0]


def conversation_ids(tokenizer: Any, messages: Sequence[Message],
                     fmt: Optional[PromptFormat] = None) -> tuple[list[int], list[int]]:
    """(token ids, no-loss mask) of a whole conversation for SFT: the mask is 0 exactly on the
    tokens of assistant turns (their content and the template's end-of-turn markup), 1 on
    everything else (system, user and tool turns, and each assistant header).

    Turns are rendered one prefix at a time and tokenized piece by piece, so a token never
    straddles a turn boundary and the mask is exact; a template whose rendering of a prefix
    is not a prefix of the next rendering is refused (it could not be masked exactly).
    """
    fmt = fmt or PromptFormat()
    template = template_of(tokenizer, PromptFormat("tokenizer" if fmt.chat_template != "none" else "none",
                                                   template_text=fmt.template_text))
    if template is None:
        raise ChatTemplateError("a conversation needs a chat template (dataset.chat_template=auto with a "
                                "tokenizer that has one, or dataset.chat_template=PATH.jinja)")
    msgs = prompt_messages(list(messages), PromptFormat(system_prompt=fmt.system_prompt))
    ids: list[int] = []
    mask: list[int] = []
    done = ""

    def add(text: str, loss: bool) -> None:
        if text:
            piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.extend(piece)
            mask.extend([0 if loss else 1] * len(piece))

    for i, m in enumerate(msgs):
        if m.get("role") == "assistant":
            header = render_chat_text(tokenizer, msgs[:i], template, add_generation_prompt=True) if i else ""
            _check_prefix(done, header, i)
            add(header[len(done):], loss=False)
            done = header
        full = render_chat_text(tokenizer, msgs[: i + 1], template, add_generation_prompt=False)
        _check_prefix(done, full, i)
        add(full[len(done):], loss=m.get("role") == "assistant")
        done = full
    return ids, mask


def _check_prefix(done: str, text: str, i: int) -> None:
    if not text.startswith(done):
        raise ChatTemplateError(f"the chat template renders message {i} by changing the earlier messages' text, "
                                "so assistant tokens cannot be masked exactly; use a template whose rendering "
                                "of a conversation extends that of its prefix (dataset.chat_template=PATH.jinja)")


def load_template_file(path: str) -> str:
    """The text of a Jinja chat template file, checked to parse (an error names file and line)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ChatTemplateError(f"dataset.chat_template: cannot read {path}: {e.strerror or e}") from None
    import jinja2

    try:  # compiled as transformers compiles it (its extensions: loop controls, {% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # an older transformers: jinja2 itself, with the standard extensions
        compile_template = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"dataset.chat_template: {os.path.abspath(path)}:{e.lineno}: not a valid Jinja "
                                f"template: {e.message}") from None
    if not text.strip():
        raise ChatTemplateError(f"dataset.chat_template: {path} is empty")
    return text
