"""The first requests a generation server answers, as JSON lines: what the policy was really asked.

Why (as SGLang's ``--log-requests``): a prompt that went through a chat template, a proxy and a
rollout worker is only known for sure where it is generated from. Each line is one finished
sequence: its request id, the prompt's token ids and, with a tokenizer, its text, the answer's ids
and text, the finish reason and the weight version of its last token. Logging stops after
``limit`` sequences, so a long run's log stays small. The trainer's side is
:mod:`realflow.system.sample_log`.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Iterable, Optional

from realflow.api.generation import GenerationResult


class RequestLog:
    def __init__(self, path: str, limit: int, decode: Optional[Callable[[list[int]], Optional[str]]] = None) -> None:
        if limit < 1:
            raise ValueError(f"request log limit={limit} must be >= 1")
        self.path, self.limit, self.decode = path, limit, decode
        self.written = 0
        self._lock = threading.Lock()  # results are recorded from the server's request tasks

    def record(self, results: Iterable[GenerationResult]) -> None:
        with self._lock:
            self._record(results)

    def _record(self, results: Iterable[GenerationResult]) -> None:
        if self.written >= self.limit:
            return
        lines = []
        for r in results:
            if self.written + len(lines) >= self.limit:
                break
            rec: dict[str, Any] = {"rid": r.rid, "request_rid": r.request_rid, "prompt_ids": list(r.prompt_ids),
                                   "output_ids": list(r.output_ids), "finish_reason": r.finish_reason,
                                   "weight_version": r.weight_version}
            if self.decode is not None:
                rec["prompt"], rec["output"] = self.decode(list(r.prompt_ids)), self.decode(list(r.output_ids))
            lines.append(json.dumps(rec) + "\n")
        if not lines:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(lines)
        self.written += len(lines)
