"""Verifiable math reward: read the final answer off a model response and compare it.

Why it is built this way: rewards are computed on raw model samples, which are
often malformed (unbalanced braces, no answer, pages of digits). A reward
function that raises would take down a worker in the middle of a step, so this
one never raises: a bad response is worth 0 and the reason says why.

Order of work, cheapest first: extract (``\\boxed{}``, then GSM8K ``####``,
then optionally the last number), compare normalized strings, compare as exact
rational numbers, and only then ask ``math-verify`` (sympy) for symbolic
equivalence (``\\frac{1}{2}`` vs ``0.5``). Plain integer tasks never reach sympy.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction

from realflow.api.dataset import extract_final_answer

__all__ = ["MathRewardResult", "extract_answer", "verify_answer", "math_reward"]

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_MAX_ANSWER_CHARS = 300  # longer "answers" are garbage; sympy on them could be slow


@dataclass(frozen=True)
class MathRewardResult:
    reward: float            # 1.0 correct, 0.0 otherwise
    reason: str              # e.g. "correct (numeric)", "wrong", "no answer found"
    extracted: str | None    # the answer read off the response
    method: str              # "boxed", "####", "last_number" or "none"


def extract_answer(text: str, allow_last_number: bool = True) -> tuple[str | None, str]:
    """(answer, method): last ``\\boxed{}``, else text after the last ``####``,
    else (if allowed) the last number in the text, else (None, "none")."""
    ans, method = extract_final_answer(text)
    if ans is not None:
        return ans, method
    if allow_last_number:
        nums = _NUMBER.findall(text)
        if nums:
            return nums[-1], "last_number"
    return None, "none"


def _normalize(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\[,!;: ]", "", s)                 # LaTeX spacing
    s = re.sub(r"\\(?:text|mathrm)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?:\D|$))", "", s)  # 1,234 -> 1234
    s = s.rstrip(".").strip()
    return s.replace(" ", "")


def _as_number(s: str) -> Fraction | None:
    """Exact value of an integer, decimal, a/b or \\frac{a}{b}; else None."""
    m = re.fullmatch(r"([-+]?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", s)
    if m:
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _math_verify_equal(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    g = parse(f"${gold}$", parsing_timeout=5 if main else None)
    p = parse(f"${pred}$", parsing_timeout=5 if main else None)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=5 if main else None))


def verify_answer(response: str, answer: str, allow_last_number: bool = True,
                  use_math_verify: bool = True) -> MathRewardResult:
    """Score ``response`` against the reference ``answer``; never raises."""
    try:
        if not isinstance(response, str):
            return MathRewardResult(0.0, f"response is {type(response).__name__}, not text", None, "none")
        if not isinstance(answer, str) or not answer.strip():
            return MathRewardResult(0.0, "reference answer is empty", None, "none")
        gold = extract_final_answer(answer)[0] or answer
        pred, method = extract_answer(response, allow_last_number)
        if pred is None:
            return MathRewardResult(0.0, "no answer found", None, method)
        if len(pred) > _MAX_ANSWER_CHARS:
            return MathRewardResult(0.0, f"answer longer than {_MAX_ANSWER_CHARS} chars", pred[:40], method)
        g, p = _normalize(gold), _normalize(pred)
        if not p:
            return MathRewardResult(0.0, "empty answer", pred, method)
        if g == p:
            return MathRewardResult(1.0, "correct (exact)", pred, method)
        gn, pn = _as_number(g), _as_number(p)
        if gn is not None and pn is not None:
            ok = gn == pn
            return MathRewardResult(float(ok), "correct (numeric)" if ok else "wrong", pred, method)
        if use_math_verify:
            try:
                if _math_verify_equal(g, p):
                    return MathRewardResult(1.0, "correct (math_verify)", pred, method)
            except Exception as e:  # sympy can fail in many ways on junk input
                return MathRewardResult(0.0, f"math_verify error: {type(e).__name__}", pred, method)
        return MathRewardResult(0.0, "wrong", pred, method)
    except Exception as e:  # last line of defence: a reward must never crash a worker
        return MathRewardResult(0.0, f"reward error: {type(e).__name__}: {e}"[:200], None, "none")


def math_reward(response: str, answer: str) -> float:
    """1.0 if ``response`` states ``answer`` (see :func:`verify_answer`), else 0.0."""
    return verify_answer(response, answer).reward
