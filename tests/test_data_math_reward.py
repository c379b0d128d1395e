"""Math reward: answer extraction and verification; malformed output scores 0 and never raises."""
import threading

import pytest

from mfc.math_reward import extract_answer, math_reward, verify_answer


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
