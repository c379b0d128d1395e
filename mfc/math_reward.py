"""Verifiable math reward: read the final answer off a model response and compare it.

Why it is built this way: rewards are computed on raw model samples, which are
often malformed (unbalanced braces, no answer, pages of digits). A reward
function that raises would take down a worker in the middle of a step, so this
one never raises: a bad response is worth 0 and the reason says why.

Order of work, cheapest first: extract (``\\boxed{}``, then GSM8K ``####``,
then optionally the last number), compare normalized strings, compare as exact
rational numbers, and only then ask ``math-verify`` (sympy) for symbolic
equivalence (``\\frac{1}{2}`` vs ``0.5``). Plain integer tasks never reach sympy.
If math-verify is missing or fails on an input, a plain sympy check (LaTeX parsed
by ``latex2sympy2_extended``, never ``eval``) is the fallback.

Also here: format checks (is a ``#### answer`` / ``\\boxed{}`` present) and the
exact-format reward of our arithmetic task (``236 #### 632``).
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction

from realflow.data.dataset import extract_final_answer

__all__ = ["MathRewardResult", "extract_answer", "verify_answer", "math_reward", "has_answer_format",
           "arithmetic_reward"]

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_MAX_ANSWER_CHARS = 300  # longer "answers" are garbage; sympy on them could be slow
_MAX_SYMPY_CHARS = 120   # the sympy fallback has no timeout off the main thread: keep inputs small


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


def _math_verify_equal(gold: str, pred: str) -> bool | None:
    """True/False from math-verify; None when it cannot parse one side (sympy may still)."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    g = parse(f"${gold}$", parsing_timeout=5 if main else None)
    p = parse(f"${pred}$", parsing_timeout=5 if main else None)
    if not g or not p:
        return None
    return bool(verify(g, p, timeout_seconds=5 if main else None))


def _sympy_equal(gold: str, pred: str) -> bool:
    """Symbolic equality via sympy: both sides parsed from LaTeX (no ``eval`` of model text),
    equal when ``simplify(g - p) == 0``; sets/relations compare structurally."""
    import sympy
    from latex2sympy2_extended import latex2sympy

    g, p = latex2sympy(gold), latex2sympy(pred)
    if isinstance(g, sympy.Expr) and isinstance(p, sympy.Expr):
        return bool(sympy.simplify(g - p) == 0)
    return bool(g == p)


def verify_answer(response: str, answer: str, allow_last_number: bool = True,
                  use_math_verify: bool = True, symbolic: bool = True) -> MathRewardResult:
    """Score ``response`` against the reference ``answer``; never raises.

    ``symbolic=False`` stops after the exact and numeric comparisons (cheap; enough for
    integer tasks). ``use_math_verify=False`` goes straight to the sympy fallback.
    """
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
        if not symbolic:
            return MathRewardResult(0.0, "wrong", pred, method)
        mv_error = ""
        if use_math_verify:
            try:
                ok = _math_verify_equal(g, p)
            except Exception as e:  # math-verify missing, or failing on junk input: try sympy
                ok, mv_error = None, f"math_verify error: {type(e).__name__}"
            if ok is not None:
                return MathRewardResult(float(ok), "correct (math_verify)" if ok else "wrong", pred, method)
        if len(p) > _MAX_SYMPY_CHARS:
            return MathRewardResult(0.0, "wrong (too long for a sympy check)", pred, method)
        try:
            if _sympy_equal(g, p):
                return MathRewardResult(1.0, "correct (sympy)", pred, method)
        except Exception as e:  # sympy can fail in many ways on junk input
            why = f"sympy error: {type(e).__name__}"
            return MathRewardResult(0.0, f"{mv_error}; {why}" if mv_error else why, pred, method)
        return MathRewardResult(0.0, "wrong", pred, method)
    except Exception as e:  # last line of defence: a reward must never crash a worker
        return MathRewardResult(0.0, f"reward error: {type(e).__name__}: {e}"[:200], None, "none")


def math_reward(response: str, answer: str) -> float:
    """1.0 if ``response`` states ``answer`` (see :func:`verify_answer`), else 0.0."""
    return verify_answer(response, answer).reward


_FORMATS = ("any", "gsm8k", "boxed")


def has_answer_format(text: str, style: str = "any") -> bool:
    """Whether ``text`` states a final answer in the expected form: ``gsm8k`` (a non-empty
    ``#### answer``), ``boxed`` (a balanced, non-empty ``\\boxed{...}``) or ``any`` of them."""
    if style not in _FORMATS:
        raise ValueError(f"unknown answer format {style!r} (known: {', '.join(_FORMATS)})")
    if not isinstance(text, str):
        return False
    _, method = extract_final_answer(text)
    if style == "any":
        return method != "none"
    if style == "boxed":
        return method == "boxed"
    pos = text.rfind("####")
    return pos >= 0 and bool(text[pos + 4:].strip().split("\n", 1)[0].strip())


_ARITH_LINE = re.compile(r"\s*(\d+)(-?)\s+####\s+(-?\d+)\s*")


def arithmetic_reward(response: str, answer: str, strict_format: bool = False) -> MathRewardResult:
    """Our arithmetic task (``experiments/tasks/arithmetic.py``): the integer after the last
    ``####`` must equal ``answer`` exactly (no last-number fallback, no symbolic match).

    ``strict_format`` also requires the whole response to be the SFT target's shape,
    ``<answer digits reversed>[-] #### <answer>``, with the reversed digits consistent.
    Never raises.
    """
    if not isinstance(response, str) or not isinstance(answer, str):
        return MathRewardResult(0.0, "response and answer must be text", None, "none")
    gold = answer.strip()
    if strict_format:
        m = _ARITH_LINE.fullmatch(response) if len(response) <= 2 * _MAX_ANSWER_CHARS else None
        if not m:
            return MathRewardResult(0.0, "not in '<reversed> #### <answer>' format", None, "none")
        digits, sign, pred = m.groups()
        if pred != f"{sign}{digits[::-1]}":
            return MathRewardResult(0.0, "reversed digits disagree with the answer", pred, "####")
    else:
        pos = response.rfind("####")
        if pos < 0:
            return MathRewardResult(0.0, "no answer found", None, "none")
        pred = response[pos + 4:].strip().split("\n", 1)[0].strip()
        if len(pred) > _MAX_ANSWER_CHARS or not re.fullmatch(r"-?\d+", pred):
            return MathRewardResult(0.0, "answer is not an integer", pred[:40] or None, "####")
    ok = re.fullmatch(r"-?\d+", gold) is not None and int(pred) == int(gold)
    return MathRewardResult(float(ok), "correct (exact)" if ok else "wrong", pred, "####")
