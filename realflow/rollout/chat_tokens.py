"""Chat messages to the exact token ids the policy sees, and generated text back to messages.

Why this is its own module: the proxy must train on the tokens the model actually
produced, never on a re-tokenization of text the agent sent back. An agent's second
request repeats the first turn as *text* (``{"role": "assistant", "content": ...}``);
re-tokenizing it may give different ids than the model generated (BPE is not
unique), and tool calls come back re-serialised. So a new prompt is *spliced*: when
its messages start with an earlier request's messages plus that request's reply, the
prompt is that completion's own prompt ids + output ids + the tokens of only what was
added since (the template's markup, user feedback, tool results). When no earlier
completion matches, the prompt is tokenized fresh and starts a new conversation.

Tool calls use the Hermes / Qwen format every open chat template uses:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the generated text.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from realflow.data.chat_render import render_chat_text

__all__ = ["PLAIN_CHAT_TEMPLATE", "ChatTokenizer", "parse_tool_calls", "normalize_messages", "message_images",
           "Spliced"]

#: For tokenizers without a chat template (the task tokenizers of the CPU defaults):
#: turns are concatenated as the models were trained (prompt, answer, eos), tools are
#: named on a first line, tool calls and results use the Hermes markup.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}tools: {% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'user' %}{{ m.content }}"
    "{%- elif m.role == 'assistant' %}{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for tc in (m.tool_calls or []) %}<tool_call>{{ {'name': tc.function.name, "
    "'arguments': tc.function.arguments} | tojson }}</tool_call>{% endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{%- endif %}{% endfor %}")

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, tool_calls) of generated ``text``; a block that is not a JSON call stays content."""
    calls, kept, pos = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name")
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name,
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _arguments(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def _image_url(part: dict[str, Any]) -> str:
    u = part.get("image_url")
    return u.get("url", "") if isinstance(u, dict) else str(u or "")


def message_images(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The data URLs of every ``image_url`` part, in the order the template renders them."""
    return [_image_url(p) for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: text content (parts joined), tool-call arguments as objects.

    A message with images keeps its parts, each image as ``{"type": "image"}`` (what vision-language
    chat templates render as the image's placeholder; Qwen2.5-VL's: ``<|vision_start|><|image_pad|>
    <|vision_end|>``) with the digest of its data, so that splicing never matches another image."""
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in c):
            m["content"] = [{"type": "image", "image_digest": hashlib.sha1(_image_url(p).encode()).hexdigest()}
                            if p.get("type") == "image_url" else {"type": "text", "text": p.get("text", "")}
                            for p in c if isinstance(p, dict)]
        elif isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
            m["content"] = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": tc.get("id"), "type": "function",
                                "function": {"name": tc["function"]["name"],
                                             "arguments": _arguments(tc["function"].get("arguments", {}))}}
                               for tc in m["tool_calls"]]
        out.append({k: v for k, v in m.items() if v is not None or k == "content"})
    return out


def _same_reply(sent: dict[str, Any], got: dict[str, Any]) -> bool:
    """Does the assistant message the agent sent back equal the reply the proxy gave?"""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "").strip() != (got.get("content") or "").strip():
        return False
    a = [(c["function"]["name"], c["function"]["arguments"]) for c in sent.get("tool_calls") or []]
    b = [(c["function"]["name"], c["function"]["arguments"]) for c in got.get("tool_calls") or []]
    return a == b


@dataclass
class Spliced:
    """A prompt's ids and, if it extends an earlier completion exactly, that completion's order."""

    ids: list[int]
    parent: Optional[int]


@dataclass
class _Turn:
    """What splicing needs of an earlier chat completion."""

    order: int
    messages: list[dict[str, Any]]  # normalized request messages
    tools: Any
    prompt_text: str
    prompt_ids: list[int]
    output_ids: list[int]
    reply: dict[str, Any]  # normalized assistant message the proxy returned


class ChatTokenizer:
    """Renders chat requests with the model's chat template and splices them onto earlier turns."""

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None) -> None:
        self.tok = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE
        self.end_markers = [t for t in {tokenizer.eos_token} if t]

    def render(self, messages: Sequence[dict[str, Any]], tools: Any, generation_prompt: bool = True) -> str:
        # the rendering the data sets use too (realflow.data.chat_render): ids never drift between them
        return render_chat_text(self.tok, messages, self.template, generation_prompt, tools)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def splice_chat(self, messages: list[dict[str, Any]], tools: Any, text: str,
                    turns: Sequence[_Turn]) -> Spliced:
        """The ids of a chat prompt (``text`` is its rendering): spliced on the latest matching turn."""
        for t in sorted(turns, key=lambda t: -t.order):
            j = len(t.messages)
            if (len(messages) <= j or messages[:j] != t.messages or t.tools != tools
                    or not _same_reply(messages[j], t.reply) or not text.startswith(t.prompt_text)):
                continue
            tail = self._after_reply(text[len(t.prompt_text):], t)
            if tail is not None:
                return Spliced(t.prompt_ids + t.output_ids + self.encode(tail), t.order)
        return Spliced(self.encode(text), None)

    def _after_reply(self, rest: str, t: _Turn) -> Optional[str]:
        """What the template put after the reply's tokens (None if it cannot be located)."""
        generated = self.decode(t.output_ids)
        if rest.startswith(generated):
            return rest[len(generated):]
        content = (t.reply.get("content") or "")
        if content and rest.startswith(content) and not t.reply.get("tool_calls"):
            return rest[len(content):]  # generated ended with a stop string the reply does not show
        for marker in self.end_markers:  # re-serialised tool calls: resume after the end of the turn
            if generated.endswith(marker) and marker in rest:
                return rest[rest.index(marker) + len(marker):]
        return None

    def splice_text(self, prompt: str, completions: Sequence[tuple[int, list[int], list[int]]]) -> Spliced:
        """A raw text prompt (``/v1/completions``) extending an earlier (order, prompt ids, output ids)."""
        for order, p_ids, o_ids in sorted(completions, key=lambda c: -c[0]):
            before = self.decode(p_ids + o_ids, skip_special=True)
            if p_ids and before and prompt.startswith(before):
                return Spliced(p_ids + o_ids + self.encode(prompt[len(before):]), order)
        return Spliced(list(self.tok.encode(prompt)), None)

    def new_turn(self, order: int, messages: list[dict[str, Any]], tools: Any, prompt_text: str,
                 prompt_ids: list[int], output_ids: list[int], reply: dict[str, Any]) -> _Turn:
        return _Turn(order, messages, tools, prompt_text, list(prompt_ids), list(output_ids),
                     normalize_messages([reply])[0])
