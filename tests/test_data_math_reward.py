"""Math reward: answer extraction and verification; malformed output scores 0 and never raises."""
import logging
import threading

import pytest

from mfc.math_reward import arithmetic_reward, extract_answer, has_answer_format, math_reward, verify_answer
from mfc.reward import REWARD_FUNCTIONS, RewardConfig, RewardInput, compute_rewards, register_reward


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{579}.", ("579", "boxed")),
    ("\\boxed{1} no wait \\boxed{\\frac{3}{4}}", ("\\frac{3}{4}", "boxed")),
    ("975 #### 579", ("579", "####")),
    ("#### 12\n#### 13\nbye", ("13", "####")),
    ("I think 12 or maybe 1,234.", ("1,234", "last_number")),
    ("no digits here", (None, "none")),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_number_fallback_can_be_disabled():
    assert extract_answer("it is 42", allow_last_number=False) == (None, "none")
    assert verify_answer("it is 42", "42", allow_last_number=False).reward == 0.0
    assert verify_answer("it is 42", "42").reward == 1.0


@pytest.mark.parametrize("response,answer,reason", [
    ("975 #### 579", "579", "correct (exact)"),
    ("\\boxed{579}", "579", "correct (exact)"),
    ("#### 1,234", "1234", "correct (exact)"),
    ("#### 0579", "579", "correct (numeric)"),
    ("\\boxed{-7}", "-7", "correct (exact)"),
    ("\\boxed{0.5}", "1/2", "correct (numeric)"),
    ("\\boxed{\\frac{1}{2}}", "0.5", "correct (numeric)"),
    ("#### 579.", "579", "correct (exact)"),
    ("\\boxed{\\sqrt{4}}", "2", "correct (math_verify)"),
    ("\\boxed{x+1}", "1+x", "correct (math_verify)"),
])
def test_correct_answers(response, answer, reason):
    r = verify_answer(response, answer)
    assert (r.reward, r.reason) == (1.0, reason)
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize("response,answer,reason", [
    ("975 #### 578", "579", "wrong"),
    ("#### 5790", "579", "wrong"),
    ("\\boxed{x+2}", "x+1", "wrong"),
    ("", "579", "no answer found"),
    ("#### ", "579", "no answer found"),
    ("#### " + "9" * 400, "579", "answer longer than"),
    ("\\boxed{\\frac{", "1", "no answer found"),
    ("\\boxed{}}}{{", "1", "no answer found"),
    (None, "1", "response is NoneType"),
    (123, "123", "response is int"),
    ("#### 5", "", "reference answer is empty"),
    ("\\boxed{$$\\\\}", "1", ""),
])
def test_malformed_or_wrong_scores_zero_without_raising(response, answer, reason):
    r = verify_answer(response, answer)
    assert r.reward == 0.0 and reason in r.reason


def test_unbalanced_box_falls_back_to_last_number_only_if_allowed():
    assert verify_answer("\\boxed{57", "57").reward == 1.0
    r = verify_answer("\\boxed{57", "57", allow_last_number=False)
    assert (r.reward, r.reason) == (0.0, "no answer found")


def test_reference_in_gsm8k_or_boxed_form_is_read_too():
    assert verify_answer("#### 7", "3 + 4 = 7\n#### 7").reward == 1.0
    assert verify_answer("#### 7", "\\boxed{7}").reward == 1.0


def test_symbolic_check_works_off_the_main_thread():
    # math-verify's own timeout uses SIGALRM, which only works in the main thread
    out = []
    t = threading.Thread(target=lambda: out.append(verify_answer("\\boxed{\\sqrt{4}}", "2")))
    t.start()
    t.join(30)
    assert out and out[0].reward == 1.0, out


# ----------------------------------------------------------------------------- sympy fallback, formats


def test_sympy_fallback_when_math_verify_is_off_or_fails(monkeypatch):
    r = verify_answer("\\boxed{\\frac{1}{2}x}", "x/2", use_math_verify=False)
    assert (r.reward, r.reason) == (1.0, "correct (sympy)")
    assert verify_answer("\\boxed{x+2}", "x+1", use_math_verify=False).reason == "wrong"

    import mfc.math_reward as mr

    def broken(gold, pred):
        raise ImportError("math_verify unavailable")

    monkeypatch.setattr(mr, "_math_verify_equal", broken)
    r = verify_answer("\\boxed{\\sqrt{4}}", "2")
    assert (r.reward, r.reason) == (1.0, "correct (sympy)")
    # with no symbolic check at all, only exact / numeric comparisons count
    assert verify_answer("\\boxed{\\sqrt{4}}", "2", symbolic=False).reward == 0.0


@pytest.mark.parametrize("text,style,ok", [
    ("work #### 42", "gsm8k", True),
    ("work #### 42", "boxed", False),
    ("work #### 42", "any", True),
    ("so \\boxed{\\frac{1}{2}}", "boxed", True),
    ("so \\boxed{\\frac{1}{2}}", "gsm8k", False),
    ("so \\boxed{", "any", False),
    ("#### ", "gsm8k", False),
    ("just 42", "any", False),
    (None, "any", False),
])
def test_has_answer_format(text, style, ok):
    assert has_answer_format(text, style) is ok


def test_has_answer_format_rejects_unknown_style():
    with pytest.raises(ValueError, match="unknown answer format 'latex'"):
        has_answer_format("x", "latex")


@pytest.mark.parametrize("response,answer,strict,reward,reason", [
    ("236 #### 632", "632", True, 1.0, "correct (exact)"),
    ("63- #### -36", "-36", True, 1.0, "correct (exact)"),
    ("237 #### 632", "632", True, 0.0, "reversed digits disagree"),
    ("636 #### 636", "632", True, 0.0, "wrong"),
    ("the answer #### 632", "632", True, 0.0, "format"),
    ("the answer #### 632", "632", False, 1.0, "correct (exact)"),
    ("#### 0632", "632", False, 1.0, "correct (exact)"),
    ("it is 632", "632", False, 0.0, "no answer found"),
    ("#### 632.0", "632", False, 0.0, "not an integer"),
    ("#### " + "9" * 5000, "632", False, 0.0, "not an integer"),
    (None, "632", False, 0.0, "must be text"),
])
def test_arithmetic_reward_exact_format(response, answer, strict, reward, reason):
    r = arithmetic_reward(response, answer, strict_format=strict)
    assert r.reward == reward and reason in r.reason


def test_arithmetic_reward_accepts_the_task_own_solutions():
    from experiments.tasks.arithmetic import generate_splits

    train, _ = generate_splits(200, 10, seed=3, difficulty=4)
    for row in train:
        assert arithmetic_reward(row["solution"], row["answer"], strict_format=True).reward == 1.0, row


# ----------------------------------------------------------------------------- registry and isolation


def _samples():
    return [RewardInput("a", "236 #### 632", "632"), RewardInput("b", "\\boxed{\\frac{1}{2}}", "0.5"),
            RewardInput("c", "no idea", "3"), RewardInput("d", "#### 7", None)]


def test_builtin_rewards_by_name():
    res = compute_rewards(_samples(), RewardConfig("math"))
    assert res.rewards == [1.0, 1.0, 0.0, 0.0] and res.errors == {} and not any(res.skipped)
    assert compute_rewards(_samples(), RewardConfig("arithmetic")).rewards == [1.0, 0.0, 0.0, 0.0]
    assert compute_rewards(_samples(), RewardConfig("format")).rewards == [1.0, 1.0, 0.0, 1.0]
    assert compute_rewards(_samples(), RewardConfig("format", {"style": "boxed"})).rewards == [0, 1, 0, 0]
    r = compute_rewards(_samples(), RewardConfig("math_with_format", {"format_bonus": 0.5})).rewards
    assert r == [1.5, 1.5, 0.0, 0.5]
    with pytest.raises(KeyError, match="unknown reward function 'mth'.*did you mean 'math'"):
        RewardConfig("mth")


def test_failing_user_reward_is_isolated_and_reported_once(caplog):
    calls = []

    @register_reward("test_flaky")
    def flaky(sample, bonus=0.0):
        calls.append(sample.id)
        if sample.id == "b":
            raise RuntimeError("boom on b")
        if sample.id == "c":
            return float("nan")
        if sample.id == "d":
            return "1"
        return 1.0 + bonus

    try:
        with caplog.at_level(logging.WARNING, logger="mfc.reward"):
            res = compute_rewards(_samples(), RewardConfig("test_flaky", {"bonus": 0.5}, fallback_reward=-1.0))
            assert res.rewards == [1.5, -1.0, -1.0, -1.0] and res.skipped == [False] * 4
            assert set(res.errors) == {"b", "c", "d"} and res.n_errors == 3
            assert "RuntimeError: boom on b" in res.errors["b"]
            assert "non-finite" in res.errors["c"] and "not a number" in res.errors["d"]
            again = compute_rewards(_samples(), RewardConfig("test_flaky", on_error="skip"))
        assert again.skipped == [False, True, True, True]
        warned = [r.getMessage() for r in caplog.records if "test_flaky" in r.getMessage()]
        assert len(warned) == 3 and any("'b'" in w and "boom on b" in w for w in warned)
        assert calls == ["a", "b", "c", "d"] * 2
    finally:
        REWARD_FUNCTIONS.unregister("test_flaky")
    with pytest.raises(ValueError, match="on_error must be 'fallback' or 'skip'"):
        RewardConfig("math", on_error="ignore")


def test_arithmetic_consistency_reward():
    from mfc.reward import REWARD_FUNCTIONS, RewardInput

    fn = REWARD_FUNCTIONS.get("arithmetic_consistency")
    assert fn(RewardInput("a", "621 #### 126")) == 1.0
    assert fn(RewardInput("b", "14 #### 45")) == 0.0
    assert fn(RewardInput("c", "42")) == 0.0
    assert fn(RewardInput("d", "7 #### -7")) == 1.0
