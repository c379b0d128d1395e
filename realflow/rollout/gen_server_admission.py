"""Admission control of the gen server: request bounds and the queued-token budget.

Why a module of its own: the checks run on the event loop before the backend lock is
taken, so a request that is too big, or that comes while the server is full, costs the
engine nothing -- the step thread never waits behind a request it will not serve.

A sequence costs ``prompt tokens + new tokens it may produce`` (``max_new_tokens``
clipped to what the context leaves) from admission until its result is delivered.
While the sum over admitted sequences would pass ``max_queued_tokens``, new requests
are answered 429 with ``Retry-After``: the seconds the server needs, at its recent
token rate, to work off the excess (1 to :data:`MAX_RETRY_AFTER_S`).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

from realflow.api.generation import GenServerLimits, SamplingParams

__all__ = ["Admission", "Overloaded", "MAX_RETRY_AFTER_S"]

MAX_RETRY_AFTER_S = 30


class Overloaded(Exception):
    """The server is full: HTTP 429 with ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Checks requests against :class:`GenServerLimits` and keeps the queued-token count.

    ``reserve``/``release`` may be called from different threads (handlers on the event
    loop, results delivered by the step thread); one small lock guards the count.
    """

    def __init__(self, limits: GenServerLimits, max_context: int) -> None:
        self.limits = limits.validate()
        self.max_context = int(max_context)
        self.queued_tokens = 0
        self.rejected_total = 0  # 429s
        self._lock = threading.Lock()

    # ------------------------------------------------------------ bounds (400)

    def sequence_costs(self, prompts: Sequence[Any], params: Sequence[SamplingParams]) -> list[int]:
        """Tokens each prompt's sequences may hold at most, or ValueError naming the bound passed."""
        lim = self.limits
        total = sum(p.n for p in params)
        if total > lim.max_sequences_per_request:
            raise ValueError(f"sampling_params.n: {len(prompts)} prompt(s) x n asks for {total} sequences; at most "
                             f"{lim.max_sequences_per_request} per request (max_sequences_per_request; send "
                             f"several requests)")
        costs = []
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            where = f"input_ids[{i}]" if len(prompts) > 1 else "input_ids"
            n_prompt = len(ids) if isinstance(ids, list) else 0
            if lim.max_prompt_tokens is not None and n_prompt > lim.max_prompt_tokens:
                raise ValueError(f"{where} has {n_prompt} tokens; this server takes at most "
                                 f"{lim.max_prompt_tokens} (max_prompt_tokens)")
            cap = self.max_context if lim.max_new_tokens is None else lim.max_new_tokens
            if sp.max_new_tokens > cap:
                which = "the model's context" if lim.max_new_tokens is None else "max_new_tokens"
                raise ValueError(f"sampling_params.max_new_tokens={sp.max_new_tokens}: this server generates at "
                                 f"most {cap} new tokens per sequence ({which})")
            new = max(0, min(sp.max_new_tokens, self.max_context - n_prompt))
            costs.append(n_prompt + new)
        need = sum(c * sp.n for c, sp in zip(costs, params))
        if need > lim.max_queued_tokens:
            raise ValueError(f"request needs {need} tokens (prompt + max_new_tokens over its {total} sequences); "
                             f"the server queues at most {lim.max_queued_tokens} (max_queued_tokens): send "
                             f"smaller requests")
        return costs

    # ------------------------------------------------------------ budget (429)

    def reserve(self, tokens: int, tokens_per_second: Callable[[], float]) -> None:
        """Count ``tokens`` as queued, or raise :class:`Overloaded` (counting nothing).

        ``tokens_per_second()`` (the server's recent rate, for ``Retry-After``) is only
        called when the request is refused."""
        with self._lock:
            if self.queued_tokens + tokens <= self.limits.max_queued_tokens:
                self.queued_tokens += tokens
                return
            excess = self.queued_tokens + tokens - self.limits.max_queued_tokens
            self.rejected_total += 1
            queued = self.queued_tokens
        tps = tokens_per_second()
        wait = math.ceil(excess / tps) if tps > 0 else MAX_RETRY_AFTER_S
        retry = int(min(MAX_RETRY_AFTER_S, max(1, wait)))
        raise Overloaded(f"server is full: {queued} tokens queued, this request needs {tokens}, the limit is "
                         f"{self.limits.max_queued_tokens} (max_queued_tokens); retry after {retry} s", retry)

    def release(self, tokens: int) -> None:
        with self._lock:
            self.queued_tokens = max(0, self.queued_tokens - tokens)
