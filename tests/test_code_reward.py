"""The code-tests reward: the model's program runs against test cases in the real sandbox."""
from __future__ import annotations

import json

import pytest

from mfc.code_reward import code_tests_reward, extract_program
from realflow.api.reward import REWARD_FUNCTIONS, RewardInput

TESTS = json.dumps([{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"},
                    {"input": "0 0\n", "output": "0"}, {"input": "7 8\n", "output": "15\n"}])


def _score(response: str, **kw) -> tuple[float, dict]:
    sample = RewardInput("r0", response, TESTS)
    return code_tests_reward(sample, **kw), sample.meta


def test_correct_partial_and_hostile_programs():
    assert REWARD_FUNCTIONS.get("code-tests") is code_tests_reward
    good = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    assert _score(good) == (1.0, {"code_failures": []})
    partial = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else a - b)\n```"
    assert _score(partial)[0] == 0.5  # "2 3" and "0 0" pass; "10 -4" and "7 8" do not
    hostile = "```python\nimport os\nwhile True:\n    os.fork()\n```"
    score, meta = _score(hostile, all_or_nothing=True)
    assert score == 0.0 and len(meta["code_failures"]) == 4
    assert all("process limit" in r or "killed by" in r for r in meta["code_failures"]), meta
    assert extract_program("no fence: print(1)") == "no fence: print(1)"


def test_bad_test_cases_are_a_data_error():
    with pytest.raises(ValueError, match="test case 1"):
        code_tests_reward(RewardInput("r", "print(1)", json.dumps([{"input": "", "output": "1"}, {"output": 3}])))
    with pytest.raises(ValueError, match="non-empty JSON list"):
        code_tests_reward(RewardInput("r", "print(1)", "[]"))
