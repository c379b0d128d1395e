"""The synthetic arithmetic task: deterministic, disjoint splits, correct answers, cached files."""
import json
import os

import pytest

from experiments.tasks.arithmetic import ensure_dataset, generate_splits, solution_text


def _eval(prompt: str) -> int:
    expr = prompt.rstrip("=")
    for op in "+-*":
        if op in expr:
            a, b = expr.split(op)
            return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    raise AssertionError(prompt)


def test_same_arguments_give_same_rows_and_seed_changes_them():
    a = generate_splits(500, 100, seed=3, difficulty=3, style="reverse")
    b = generate_splits(500, 100, seed=3, difficulty=3, style="reverse")
    c = generate_splits(500, 100, seed=4, difficulty=3, style="reverse")
    assert a == b
    assert a[1] != c[1] and a[0] != c[0]


def test_splits_are_disjoint_and_test_prompts_distinct():
    train, test = generate_splits(5000, 300, seed=0, difficulty=2)
    test_prompts = [r["prompt"] for r in test]
    assert len(set(test_prompts)) == len(test_prompts)
    assert not set(test_prompts) & {r["prompt"] for r in train}
    assert len({r["id"] for r in train + test}) == len(train) + len(test)


def test_growing_train_keeps_the_test_split():
    assert generate_splits(100, 50, 0, 3)[1] == generate_splits(2000, 50, 0, 3)[1]


@pytest.mark.parametrize("style", ["direct", "reverse"])
def test_answers_are_correct_and_solutions_end_in_gsm8k_form(style):
    train, test = generate_splits(2000, 200, seed=1, difficulty=3, style=style)
    ops = set()
    for r in train + test:
        value = _eval(r["prompt"])
        assert r["answer"] == str(value) and value >= 0  # subtraction stays non-negative
        assert r["solution"].endswith(f"#### {r['answer']}")
        assert 1 <= r["digits"] <= 3 and r["op"] in "+-*"
        ops.add(r["op"])
    assert ops == set("+-*")
    assert solution_text("632", "reverse") == "236 #### 632"
    assert solution_text("632", "direct") == "#### 632"


def test_short_and_long_problems_are_both_common():
    train, _ = generate_splits(3000, 10, seed=0, difficulty=3)
    counts = {d: sum(r["digits"] == d for r in train) for d in (1, 2, 3)}
    assert all(c > 600 for c in counts.values()), counts


def test_bad_arguments_fail_with_clear_errors():
    with pytest.raises(ValueError, match="cannot draw 400 test problems"):
        generate_splits(10, 400, seed=0, difficulty=1)  # only 255 one-digit problems exist
    with pytest.raises(ValueError, match="unknown style 'chatty'"):
        generate_splits(10, 10, seed=0, difficulty=2, style="chatty")
    with pytest.raises(ValueError, match="ops must be"):
        generate_splits(10, 10, seed=0, difficulty=2, ops="/")


def test_ensure_dataset_is_idempotent_and_rebuilds_on_change(tmp_path):
    p = ensure_dataset(tmp_path, 300, 50, seed=0, difficulty=2)
    rows = [json.loads(line) for line in open(p.test)]
    assert len(rows) == 50 and {"id", "prompt", "answer", "solution"} <= set(rows[0])
    mtime = os.stat(p.train).st_mtime_ns
    assert ensure_dataset(tmp_path, 300, 50, seed=0, difficulty=2) == p
    assert os.stat(p.train).st_mtime_ns == mtime  # reused, not rewritten

    ensure_dataset(tmp_path, 400, 50, seed=0, difficulty=2)  # other parameters: rebuilt
    assert sum(1 for _ in open(p.train)) == 400

    with open(p.train, "a") as f:  # tampered file: hash mismatch -> rebuilt
        f.write('{"junk": 1}\n')
    ensure_dataset(tmp_path, 400, 50, seed=0, difficulty=2)
    assert sum(1 for _ in open(p.train)) == 400
    assert json.load(open(p.manifest))["params"]["n_train"] == 400
