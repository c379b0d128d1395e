"""Parsing and validating OpenAI API request bodies, with OpenAI-style errors.

Why strict: an agent framework that sends a parameter realflow would silently
ignore (a presence penalty, top log-probs) would train on something other than what
it asked for. Parameters that do not change what is sampled (``user``,
``metadata``...) are accepted; ones that would, and that the engine does not do,
are refused with a 400 naming the parameter, as OpenAI refuses unknown ones.

``top_k`` and ``min_p`` are accepted as extra body fields (the openai client's
``extra_body``), as vLLM and SGLang accept them: ``top_k`` -1 or 0 = off, ``min_p``
in [0, 1] (0 = off). Like ``top_p`` they sample from a truncation of the policy that
is trained; the recorded behaviour log-probs are the gen server's (``logprob_mode``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "parse_chat", "parse_completion"]

#: accepted and without effect on sampling
_HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
             "reasoning_effort", "modalities", "prediction", "web_search_options", "safety_identifier",
             "prompt_cache_key", "verbosity", "suffix"}
_SAMPLING = {"model", "n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "stop",
             "stream", "seed", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias",
             "echo", "best_of"}
_CHAT = _SAMPLING | {"messages", "tools", "tool_choice", "response_format", "functions", "function_call"}
_COMPLETION = _SAMPLING | {"prompt"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class _Common:
    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0  # 0 = off
    max_tokens: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: Optional[int] = None
    logprobs: bool = False


@dataclass
class ChatRequest(_Common):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = "auto"


@dataclass
class CompletionRequest(_Common):
    prompt: Any = ""  # a string or a list of token ids


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {why}", param=param)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(name, f"expected a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(name, f"expected an integer {bound}, got {v!r}")
    return int(v)


def _common(body: Any, allowed: set[str], served: str, max_n: int) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed - _HARMLESS)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "you must provide a model parameter", param="model")
    if model != served:
        raise APIError(404, f"The model '{model}' does not exist; this proxy serves '{served}'",
                       param="model", code="model_not_found")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _bad(name, "penalties are not supported (they would change what is trained)")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "not supported (it would change what is trained)")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "not supported; use n")
    if body.get("echo"):
        raise _bad("echo", "not supported")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "expected a non-empty string or a list of at most 4 non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected a boolean, got {stream!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "expected an object")
    top_p = body.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise _bad("top_p", f"expected a number in (0, 1], got {top_p!r}")  # 0 would keep nothing: the engine's range
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise _bad("top_k", f"expected an integer >= 1, or -1 / 0 for off, got {top_k!r}")
    seed = _int(body, "seed", -(2 ** 63))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    return {"model": model, "n": _int(body, "n", 1, max_n) or 1,
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": 1.0 if top_p is None else float(top_p), "top_k": -1 if top_k in (None, 0) else top_k,
            "min_p": _number(body, "min_p", 0.0, 0.0, 1.0), "max_tokens": max_tokens, "stop": stop,
            "stream": stream, "include_usage": bool(opts.get("include_usage")), "seed": seed}


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, "expected an object with 'role' and 'content'")
    role = m.get("role")
    if role not in _ROLES:
        raise _bad(f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
    content = m.get("content")
    if content is None and not (role == "assistant" and m.get("tool_calls")):
        raise APIError(400, f"Missing required parameter: '{where}.content'", param=f"{where}.content")
    if content is not None and not isinstance(content, (str, list)):
        raise _bad(f"{where}.content", "expected a string or a list of text parts")
    if isinstance(content, list):
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("text", "image_url"):
                raise _bad(f"{where}.content[{j}]", "only text and image_url parts are supported")
            if p["type"] == "image_url":
                _image_url(f"{where}.content[{j}].image_url", p.get("image_url"))
    for j, tc in enumerate(m.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}]", "expected {'type': 'function', 'function': {'name', 'arguments'}}")
    if role == "developer":
        m = dict(m, role="system")
    return m


def _image_url(where: str, part: Any) -> None:
    """An ``image_url`` part must carry its image (workers have no network to fetch one)."""
    url = part.get("url") if isinstance(part, dict) else part
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}.url", "expected a data: URL (data:image/png;base64,...)")
    if not url.startswith("data:"):
        raise _bad(f"{where}.url", f"only data: URLs are accepted (the policy's workers fetch no URL), got "
                                   f"{url[:40]!r}")


def parse_chat(body: Any, served: str, max_n: int) -> ChatRequest:
    kw = _common(body, _CHAT, served, max_n)
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "Missing required parameter: 'messages'", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty list of messages")
    if body.get("top_logprobs"):
        raise _bad("top_logprobs", "alternatives are not returned; use logprobs=true")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise _bad("logprobs", f"expected a boolean, got {logprobs!r}")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools)):
        raise _bad("tools", "expected a list of {'type': 'function', 'function': {'name', ...}}")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise _bad("tool_choice", "only 'auto' and 'none' are supported (the model decides)")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise _bad("response_format", "only {'type': 'text'} is supported")
    if body.get("functions") or body.get("function_call"):
        raise _bad("functions", "deprecated; use tools")
    return ChatRequest(**kw, logprobs=logprobs, messages=[_message(i, m) for i, m in enumerate(msgs)],
                       tools=tools if tools and choice != "none" else None, tool_choice=choice)


def parse_completion(body: Any, served: str, max_n: int) -> CompletionRequest:
    kw = _common(body, _COMPLETION, served, max_n)
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "Missing required parameter: 'prompt'", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ok = (isinstance(prompt, str) and prompt) or (isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt))
    if not ok:
        raise _bad("prompt", "expected a non-empty string or list of token ids (one prompt per request)")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
        raise _bad("logprobs", f"expected an integer in [0, 5], got {lp!r}")
    if kw["max_tokens"] is None:
        kw["max_tokens"] = 16  # OpenAI's default for completions
    return CompletionRequest(**kw, logprobs=lp is not None, prompt=prompt)
