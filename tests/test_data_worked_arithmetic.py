"""The worked multi-step arithmetic task: deterministic, disjoint splits, answers the reward
accepts, a long-tailed solution length in the task's own tokens, cached files."""
import json
import os
import re

import pytest

from experiments.tasks.worked_arithmetic import (
    WorkedProblem,
    ensure_dataset,
    generate_splits,
    step_weights,
    widths,
)
from mfc.reward import RewardConfig, RewardInput, compute_rewards


def _eval(prompt: str) -> tuple[int, list[int]]:
    """Left-to-right value of ``a+b-c=`` and the running results."""
    tokens = re.findall(r"[+-]|\d+", prompt.rstrip("="))
    acc, running = int(tokens[0]), []
    for op, t in zip(tokens[1::2], tokens[2::2]):
        acc = acc + int(t) if op == "+" else acc - int(t)
        running.append(acc)
    return acc, running


def _percentile(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_same_arguments_give_same_rows_and_seed_changes_them():
    a = generate_splits(500, 100, seed=3)
    assert a == generate_splits(500, 100, seed=3)
    c = generate_splits(500, 100, seed=4)
    assert a[0] != c[0] and a[1] != c[1]
    assert generate_splits(100, 50, 0)[1] == generate_splits(2000, 50, 0)[1]  # test split stays


def test_splits_are_disjoint_and_test_prompts_distinct():
    train, test = generate_splits(5000, 300, seed=0)
    test_prompts = [r["prompt"] for r in test]
    assert len(set(test_prompts)) == len(test_prompts)
    assert not set(test_prompts) & {r["prompt"] for r in train}
    assert len({r["id"] for r in train + test}) == len(train) + len(test)


def test_solutions_are_worked_correctly_and_the_reward_accepts_them():
    train, test = generate_splits(2000, 200, seed=1)
    rows = train + test
    for r in rows:
        value, running = _eval(r["prompt"])
        lines = r["solution"].split("\n")
        assert r["answer"] == str(value) and min(running) >= 0  # never below zero
        assert r["steps"] == len(running) == len(lines) - 1
        assert lines[-1] == f"#### {value}"
        terms = [int(t) for t in re.findall(r"\d+", r["prompt"])]
        ops = re.findall(r"[+-]", r["prompt"])
        for line, a, op, t, acc in zip(lines, terms[:1] + running, ops, terms[1:], running):
            # "9100+70=6100": value before, operation, term, value after; reversed, zero-padded
            assert line == f"{str(a)[::-1]:0<4}{op}{str(t)[::-1]:0<2}={str(acc)[::-1]:0<4}", line
    samples = [RewardInput(id=r["id"], response=r["solution"], answer=r["answer"]) for r in rows]
    res = compute_rewards(samples, RewardConfig(name="arithmetic"))
    assert res.rewards == [1.0] * len(rows) and not res.errors
    wrong = [RewardInput(id=r["id"], response=r["solution"], answer=str(int(r["answer"]) + 1))
             for r in rows[:20]]
    assert compute_rewards(wrong, RewardConfig(name="arithmetic")).rewards == [0.0] * 20
    assert widths(6, 2) == (4, 2) and widths(9, 1) == (3, 1)
    p = WorkedProblem((12, 7, 5), ("+", "-"))
    assert (p.prompt, p.solution(), p.result) == ("12+7-5=", "210+7=910\n910-5=410\n#### 14", 14)
    assert p.solution("compact") == "+7=91\n-5=41\n#### 14"  # generator version 1's lines
    q = WorkedProblem((123, 45, 7), ("-", "+"), width=4, term_width=2)
    assert q.solution() == "3210-54=8700\n8700+70=5800\n#### 85"


def test_steps_are_heavy_tailed():
    train, _ = generate_splits(4000, 10, seed=0, max_steps=12, alpha=1.5)
    steps = [r["steps"] for r in train]
    assert min(steps) == 1 and max(steps) == 12
    assert 0.40 < steps.count(1) / len(steps) < 0.55  # most problems are short ...
    assert sum(s >= 6 for s in steps) / len(steps) > 0.08  # ... a few are long
    w = step_weights(4, 2.0)
    assert w == [1.0, 0.25, 1 / 9, 1 / 16]
    uniform, _ = generate_splits(2000, 10, seed=0, max_steps=3, alpha=0)
    assert all(550 < sum(r["steps"] == k for r in uniform) < 780 for k in (1, 2, 3))


def test_solution_lengths_in_task_tokens_have_a_long_tail(tmp_path):
    from transformers import AutoTokenizer

    from experiments.tasks.tokenizer import ensure_tokenizer

    p = ensure_dataset(tmp_path / "data", 3000, 200, seed=0)
    tok = AutoTokenizer.from_pretrained(ensure_tokenizer(tmp_path / "tok", [p.train]))
    rows = [json.loads(line) for line in open(p.train)]
    solutions = tok([r["solution"] for r in rows], add_special_tokens=False)["input_ids"]
    lengths = [len(ids) for ids in solutions]
    p50, p99 = _percentile(lengths, 0.50), _percentile(lengths, 0.99)
    assert 10 <= p50 <= 20, p50
    assert p99 / p50 >= 4, (p50, p99)
    assert max(lengths) <= 150
    prompts = tok([r["prompt"] for r in rows])["input_ids"]  # with BOS
    seq = [len(a) + len(b) + 1 for a, b in zip(prompts, solutions)]  # + EOS
    assert sum(s > 128 for s in seq) / len(seq) < 0.005  # fits the default tiny model


def test_bad_arguments_fail_with_clear_errors():
    with pytest.raises(ValueError, match="cannot draw 2500 test problems"):
        generate_splits(10, 2500, seed=0, max_steps=1, digits=1)  # < 2000 one-step prompts
    with pytest.raises(ValueError, match="unknown style 'pad'"):
        generate_splits(10, 10, seed=0, style="pad")
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        generate_splits(10, 10, seed=0, max_steps=0)
    with pytest.raises(ValueError, match="digits must be an integer >= 1"):
        generate_splits(10, 10, seed=0, digits=0)
    with pytest.raises(ValueError, match="n_test must be an integer >= 1"):
        generate_splits(10, 0, seed=0)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        generate_splits(10, 10, seed=0, alpha=-1)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        ensure_dataset("/nonexistent/never-created", 10, 10, seed=0, alpha=float("nan"))


def test_ensure_dataset_is_idempotent_and_rebuilds_on_change(tmp_path):
    p = ensure_dataset(tmp_path, 300, 50, seed=0)
    rows = [json.loads(line) for line in open(p.test)]
    assert len(rows) == 50 and {"id", "prompt", "answer", "solution", "steps"} == set(rows[0])
    mtime = os.stat(p.train).st_mtime_ns
    assert ensure_dataset(tmp_path, 300, 50, seed=0) == p
    assert os.stat(p.train).st_mtime_ns == mtime  # reused, not rewritten

    ensure_dataset(tmp_path, 400, 50, seed=0)  # other parameters: rebuilt
    assert sum(1 for _ in open(p.train)) == 400
    ensure_dataset(tmp_path, 400, 50, seed=0, alpha=2)  # alpha is a parameter too
    assert json.load(open(p.manifest))["params"]["alpha"] == 2.0

    with open(p.train, "a") as f:  # tampered file: hash mismatch -> rebuilt
        f.write('{"junk": 1}\n')
    ensure_dataset(tmp_path, 400, 50, seed=0, alpha=2)
    assert sum(1 for _ in open(p.train)) == 400
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no leftovers of atomic writes
