"""The ``code-tests`` reward: run the model's program against test cases, in the sandbox.

The reference answer of a row is a JSON list of test cases ``{"input": str, "output": str}``
(stdin, expected stdout, compared after stripping trailing whitespace per line).  The
program is the last fenced code block of the response (```python ... ```), or the whole
response when it has none.  Every test runs in its own bubblewrap sandbox
(:mod:`realflow.base.sandbox`: no network, read-only system, scrubbed environment,
CPU/memory/process/file/output/wall limits, every process killed at the end); the tests
of one response run concurrently in a bounded pool.  Model-written code never runs on
the host: without a working sandbox the reward raises, unless ``allow_unsandboxed``.

``cache`` (entries, default 0 = off): remember the outcome of each (program, stdin, limits)
in this process and reuse it.  Why: an RL group samples the same program several times
(and held-out evaluation scores a greedy and several sampled programs per prompt), and
each sandboxed run costs tens of milliseconds of mostly kernel time -- on a small CPU
machine the reward, not the model, then sets the pace.  Every outcome still comes from a
sandboxed run; a program whose output varies between runs keeps its first outcome.
``sample.meta["code_cached"]`` counts the reused test results.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from realflow.api.reward import RewardInput, register_reward
from realflow.base.sandbox import SandboxLimits, run_program

__all__ = ["code_tests_reward", "extract_program", "parse_tests", "MAX_PARALLEL"]

MAX_PARALLEL = max(1, min(8, (os.cpu_count() or 1) * 2))  # sandboxes of one process at once
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_slots = itertools.count()
_slot_lock = threading.Lock()
_cache: "OrderedDict[bytes, tuple[bool, str, str]]" = OrderedDict()  # key -> (ok, reason, stdout)
_cache_lock = threading.Lock()


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(answer: Any) -> list[dict[str, str]]:
    """The row's test cases; ValueError naming what is wrong (a data error, not the model's)."""
    tests = json.loads(answer) if isinstance(answer, str) else answer
    if not isinstance(tests, list) or not tests:
        raise ValueError("code-tests: the answer must be a non-empty JSON list of {input, output} test cases")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("input", ""), str) or not isinstance(t.get("output"), str):
            raise ValueError(f"code-tests: test case {i} must be {{'input': str, 'output': str}}, got {t!r:.80}")
    return tests


def _next_slot() -> int:
    """A sandbox slot (its own uid under root) unlikely to be in use by another reward process."""
    with _slot_lock:
        return (os.getpid() * 97 + next(_slots)) % 1000


def _same(got: str, want: str) -> bool:
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines())  # noqa: E731
    return norm(got) == norm(want)


def _run_cached(program: str, stdin: str, limits: SandboxLimits, allow_unsandboxed: bool,
                cache: int) -> tuple[bool, str, str, bool]:
    """(ok, reason, stdout, reused): one sandboxed run, or its remembered outcome (``cache`` > 0)."""
    key = hashlib.sha256(repr((program, stdin, limits, allow_unsandboxed)).encode()).digest()
    if cache > 0:
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return (*hit, True)
    r = run_program(program, stdin, limits, slot=_next_slot(), allow_unsandboxed=allow_unsandboxed)
    if cache > 0:
        with _cache_lock:
            _cache[key] = (r.ok, r.reason, r.stdout)
            while len(_cache) > cache:
                _cache.popitem(last=False)
    return r.ok, r.reason, r.stdout, False


@register_reward("code-tests")
def code_tests_reward(sample: RewardInput, wall_s: float = 5.0, cpu_s: int = 2, memory_mb: int = 256,
                      all_or_nothing: bool = False, allow_unsandboxed: bool = False, cache: int = 0) -> float:
    """The fraction of test cases the program passes (``all_or_nothing``: 1 only if all pass);
    ``cache``: outcomes of that many recent (program, stdin) runs are reused (see the module doc)."""
    tests = parse_tests(sample.answer)
    program = extract_program(sample.response)
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)
    sample.meta.setdefault("code_failures", [])
    reused = []

    def one(t: dict[str, str]) -> bool:
        ok, reason, stdout, hit = _run_cached(program, t.get("input", ""), limits, allow_unsandboxed, cache)
        reused.append(hit)
        if not ok:
            sample.meta["code_failures"].append(reason)
            return False
        return _same(stdout, t["output"])

    with ThreadPoolExecutor(min(MAX_PARALLEL, len(tests))) as pool:
        passed = list(pool.map(one, tests))
    if cache > 0:
        sample.meta["code_cached"] = sum(reused)
    if all_or_nothing:
        return float(all(passed))
    return sum(passed) / len(passed)
