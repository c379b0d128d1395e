"""The code_expr task: deterministic per seed, disjoint splits, and test cases whose expected
outputs (computed by the generator) are what the reference programs print in the real sandbox."""
import json
import re

import pytest

from experiments.tasks.code_expr import (BUGS, KINDS, N_TESTS, SKELETON, CodeProblem, ensure_dataset,
                                         generate_splits, sample_problem)


def test_same_arguments_give_same_rows_and_seed_changes_them():
    a = generate_splits(400, 50, seed=3)
    assert a == generate_splits(400, 50, seed=3)
    b = generate_splits(400, 50, seed=4)
    assert a[0] != b[0] and a[1] != b[1]
    assert generate_splits(50, 50, seed=3)[1] == a[1]  # growing train keeps the test split


def test_splits_are_disjoint_and_rows_well_formed():
    train, test = generate_splits(3000, 300, seed=0, difficulty=2)
    prompts = [r["prompt"] for r in test]
    assert len(set(prompts)) == len(prompts) and not set(prompts) & {r["prompt"] for r in train}
    kinds = {k: 0 for k in KINDS}
    bugs = {k: 0 for k in ("",) + BUGS}
    for r in train + test:
        kinds[r["kind"]] += 1
        bugs[r["bug"]] += 1
        a, b = r["a"], r["b"]
        assert 1 <= a <= 9 and abs(b) <= 99
        if r["bug"]:  # a buggy demonstration (train rows only)
            assert r["id"].startswith("train") and r["solution"] != f"{SKELETON}{a}*n{b:+d})"
        else:
            assert r["solution"] == f"{SKELETON}{a}*n{b:+d})"
        if r["kind"] == "formula":
            assert r["prompt"] == f"f(n)={a}n{b:+d}:"
        else:  # the spec states f(0) and f(1): the slope must be worked out
            f0, f1 = map(int, re.fullmatch(r"f\(0\)=(-?\d+),f\(1\)=(-?\d+):", r["prompt"]).groups())
            assert (f0, f1 - f0) == (b, a)
        tests = json.loads(r["answer"])
        assert len(tests) == N_TESTS and len({t["input"] for t in tests}) == N_TESTS
        for t in tests:
            n = int(t["input"])
            assert n >= 2 and t["output"] == f"{a * n + b}\n"
    assert all(c > 1000 for c in kinds.values()), kinds
    assert 0.25 < sum(bugs[b] for b in BUGS) / len(train) < 0.35 and all(bugs[b] > 200 for b in BUGS), bugs
    assert not any(r["bug"] for r in test)
    assert not any(r["bug"] for r in generate_splits(500, 10, seed=0, bug_rate=0.0)[0])


def test_reference_programs_pass_their_tests_in_the_sandbox_and_wrong_ones_do_not():
    from mfc.code_reward import code_tests_reward
    from realflow.api.reward import RewardInput
    from realflow.base.sandbox import SandboxLimits, run_program

    _, test = generate_splits(10, 6, seed=5)
    for r in test:
        for t in json.loads(r["answer"]):  # the generator's expected output is what the program prints
            res = run_program(r["solution"], t["input"], SandboxLimits(wall_s=5, cpu_s=2))
            assert res.ok and res.sandboxed and res.stdout == t["output"], (r, t, res)
        assert code_tests_reward(RewardInput(r["id"], r["solution"], r["answer"])) == 1.0
        wrong = r["solution"].replace("*n", "*n+1")  # off by one everywhere
        assert code_tests_reward(RewardInput(r["id"], wrong, r["answer"])) == 0.0
        p = CodeProblem(r["a"], r["b"], r["kind"], tuple(int(t["input"]) for t in json.loads(r["answer"])))
        for bug in BUGS:  # every demonstrated bug fails every test
            if bug != "sign" or p.b != 0:
                assert code_tests_reward(RewardInput(r["id"], p.buggy_program(bug), r["answer"])) == 0.0, bug


def test_ensure_dataset_caches_and_rebuilds_on_change(tmp_path):
    p = ensure_dataset(tmp_path, 100, 20, seed=0)
    first = open(p.train).read()
    mtime = (tmp_path / "train.jsonl").stat().st_mtime_ns
    assert ensure_dataset(tmp_path, 100, 20, seed=0).train == p.train
    assert (tmp_path / "train.jsonl").stat().st_mtime_ns == mtime  # cached: not rewritten
    ensure_dataset(tmp_path, 100, 20, seed=1)
    assert open(p.train).read() != first
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["params"]["generator"] == "code_expr" and man["params"]["seed"] == 1


def test_bad_arguments_fail_with_clear_errors():
    import random

    with pytest.raises(ValueError, match="difficulty must be an integer >= 1"):
        generate_splits(10, 10, 0, difficulty=0)
    with pytest.raises(ValueError, match="kinds must be a non-empty subset"):
        generate_splits(10, 10, 0, kinds=("loops",))
    with pytest.raises(ValueError, match="bug_rate must be in"):
        generate_splits(10, 10, 0, bug_rate=1.5)
    with pytest.raises(ValueError, match="cannot draw 200 test problems"):
        generate_splits(10, 200, 0, difficulty=1, kinds=("formula",))  # 9 x 19 functions
    assert sample_problem(random.Random(0), 1, ("formula",)).kind == "formula"
