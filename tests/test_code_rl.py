"""The code RL default (``async-grpo-code``) end to end: a small SFT start on the ``code_expr``
programs, then asynchronous GRPO whose every reward runs the sampled program in the sandbox.

Why its own data: the test has about two minutes on two shared cores, so the start must
leave RL a large, quickly learnable gain. The fixture writes ``code_expr`` rows of the
easy ``formula`` kind only, with 60% buggy demonstrations (the default has both kinds and
30%): the SFT model then writes one of the three bugs in about half of its samples, and
16 small GRPO steps cut that down (measured: reward 0.39 -> 0.68, first vs last 5 steps;
0.38 -> 0.63 first vs last third of the responses).

Why audited: a run whose reward silently fell back to something else (no sandbox, a math
reward, an error fallback) could still look like learning. The RL run scores with
``code-tests-audited`` (``tests/plugins/code_audit.py``: ``code-tests`` plus one line per
response), so the test sees each reward, where it ran, and re-scores some of them itself.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = os.path.join(REPO, "tests", "plugins")
SMALL_ARCH = ["model.arch.hidden_size=64", "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=128"]
STEPS, BATCH, N_SAMPLES = 16, 16, 4


def _run(module_args, fileroot, *overrides, timeout=300, env=None):
    cmd = [sys.executable, "-m", *module_args, f"fileroot={fileroot}", *overrides]
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([PLUGINS, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


# ---------------------------------------------------------------- configuration (no processes)


def test_code_default_scores_training_and_held_out_with_the_sandboxed_reward(tmp_path):
    importlib.import_module("experiments")  # registers the experiments, rewards and agents
    from realflow.config.cli import parse_overrides
    from realflow.api.experiment import experiment_registry

    cfg = parse_overrides(experiment_registry.get("async-grpo-code"), [f"fileroot={tmp_path}"])
    actor, tok, train, _ = cfg._paths()
    assert tok == actor == os.path.join(str(tmp_path), "sft", "code_expr", "checkpoints", "default", "final")
    assert "code-rl-d2-s1" in train
    setup = cfg.setup()
    agent = setup.rollout.agent_args
    assert agent["reward"] == "code-tests" and agent["reward_args"] == {"wall_s": 2.0, "cpu_s": 1, "cache": 4096}
    assert agent["max_new_tokens"] == 16
    assert setup.eval.interface_args["eval_reward"] == "code-tests"
    assert setup.eval.interface_args["eval_reward_args"] == agent["reward_args"]
    # the math default keeps its final-answer exact match
    math = parse_overrides(experiment_registry.get("async-grpo-math"), [f"fileroot={tmp_path}"])
    assert math._eval_reward() == ("", {})


def test_held_out_scores_use_the_named_reward():
    importlib.import_module("mfc.code_reward")  # registers code-tests
    from mfc.reward import held_out_scores

    tests = json.dumps([{"input": "2\n", "output": "7\n"}, {"input": "5\n", "output": "16\n"},
                        {"input": "9\n", "output": "28\n"}])
    progs = ["n=int(input());print(3*n+1)", "n=int(input());print(2*n+3)", "print(("]
    assert held_out_scores(progs, [tests] * 3, "code-tests") == [1.0, pytest.approx(1 / 3), 0.0]
    assert held_out_scores(["x #### 42", "#### 41"], ["42", "42"]) == [1.0, 0.0]  # "" = exact match


def test_code_cache_reuses_sandboxed_outcomes():
    from mfc.code_reward import code_tests_reward
    from realflow.api.reward import RewardInput

    tests = json.dumps([{"input": f"{n}\n", "output": f"{2 * n}\n"} for n in (3, 4, 5)])
    first = RewardInput("a", "import random\nn=int(input());print(2*n)", tests)
    assert code_tests_reward(first, cache=64) == 1.0 and first.meta["code_cached"] == 0
    again = RewardInput("b", "import random\nn=int(input());print(2*n)", tests)
    assert code_tests_reward(again, cache=64) == 1.0 and again.meta["code_cached"] == 3
    other = RewardInput("c", "import random\nn=int(input());print(2*n)", tests)
    assert code_tests_reward(other, wall_s=3.0, cache=64) == 1.0 and other.meta["code_cached"] == 0  # limits differ
    assert "code_cached" not in RewardInput("d", "", tests).meta


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def fileroot(tmp_path_factory):
    """SFT on generated rows with many buggy demonstrations (see the module doc); returns the
    file root, whose ``data/`` also holds the RL prompts (another seed)."""
    from experiments.tasks.code_expr import generate_splits

    root = tmp_path_factory.mktemp("code_rl")
    (root / "data").mkdir()
    for name, seed, n in (("sft", 0, 12000), ("rl", 1, 2000)):
        for split, rows in zip(("train", "test"), generate_splits(n, 16, seed, kinds=("formula",), bug_rate=0.6)):
            with open(root / "data" / f"{name}-{split}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    res = _run(["realflow.apps.main_sft"], root, "dataset.task=code_expr", "trial_name=code_expr",
               f"dataset.train_path={root}/data/sft-train.jsonl", f"dataset.test_path={root}/data/sft-test.jsonl",
               *SMALL_ARCH, "batch_size=64", "max_train_steps=300", "optimizer.lr=3e-3")
    assert res.returncode == 0, res.stderr[-3000:]
    greedy = float(res.stdout.split("held-out accuracy: ")[1].split(" -> ")[1].split()[0])
    assert greedy >= 0.75, res.stdout[-2000:]  # greedy decoding writes the majority: the correct program
    return root


@pytest.mark.timeout(900)  # the limit covers the module's SFT start too (~3 min on an idle 2-core host)
def test_async_grpo_code_learns_through_the_sandbox(fileroot):
    from mfc.code_reward import code_tests_reward
    from realflow.api.reward import RewardInput

    audit = fileroot / "audit.jsonl"
    res = _run(["realflow.apps.main_async_ppo", "--import", "code_audit"], fileroot, "experiment=async-grpo-code",
               f"dataset.train_path={fileroot}/data/rl-train.jsonl", f"dataset.test_path={fileroot}/data/rl-test.jsonl",
               # (the checkpoint's tokenizer: loaded as the SFT run's own, see realflow.base.tokenizer_loading)
               "eval_n_samples=2",
               f"max_train_steps={STEPS}", f"batch_size={BATCH}", f"ppo.n_samples={N_SAMPLES}",
               "actor_optimizer.lr=2e-4", "seed=1", "trial_name=learn",
               "reward=code-tests-audited", "eval_reward=code-tests-audited",
               env={"REALFLOW_CODE_AUDIT": str(audit)})
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = fileroot / "async-grpo-code" / "learn"
    with open(run_dir / "stats.jsonl") as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if "actor_train/reward" in r]
    assert len(rows) == STEPS
    # every trained reward is a fraction of the row's 3 test cases
    for r in rows:
        passed = r["actor_train/reward"] * BATCH * N_SAMPLES * 3  # test cases passed in the step
        assert abs(passed - round(passed)) < 1e-3, r["actor_train/reward"]
    first = sum(r["actor_train/reward"] for r in rows[:5]) / 5
    last = sum(r["actor_train/reward"] for r in rows[-5:]) / 5
    assert last > first + 0.12, (first, last, [round(r["actor_train/reward"], 3) for r in rows])
    # every response was scored by code-tests in a process where the sandbox works (reward pool, eval)
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    train = [x for x in lines if not x["id"].startswith("eval/")]
    assert len(train) >= STEPS * BATCH * N_SAMPLES
    # programs that fail every test get rarer, and so does the demonstrated bug whose first
    # token decides a reward of 0 (n=input()). Measured, first third -> last third of the
    # responses: all-fail 212 -> 127, n=input() 70 -> 46 (70 -> 49 on a loaded CI host). The
    # bounds leave about two standard deviations of sampling noise below those drops.
    third = len(train) // 3
    all_fail = [x["reward"] == 0.0 for x in train]
    no_int = [x["response"].startswith("n=input()") for x in train]
    counts = {name: (sum(v[:third]), sum(v[-third:])) for name, v in (("all_fail", all_fail), ("no_int", no_int))}
    assert counts["all_fail"][1] < 0.8 * counts["all_fail"][0], counts
    assert counts["no_int"][1] < counts["no_int"][0], counts
    assert {x["sandbox_problem"] for x in lines} == {""}
    assert all(x["reward"] in (0.0, 1 / 3, 2 / 3, 1.0) for x in lines)
    assert os.getpid() not in {x["pid"] for x in lines}
    # the test re-scores some of them itself (no cache): the same reward
    for x in lines[:: max(1, len(lines) // 20)]:
        again = code_tests_reward(RewardInput(x["id"], x["response"], x["answer"]), wall_s=5.0)
        assert again == pytest.approx(x["reward"]), x
    assert "held-out accuracy:" in res.stdout and "held-out sampled_accuracy:" in res.stdout
    assert any(x["id"].startswith("eval/") for x in lines)  # held-out programs ran in the sandbox too
