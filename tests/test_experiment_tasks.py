"""Generated tasks by name: every entry makes its data, SFT and RL find the same files, and a
wrong task name is a one-line error naming the closest ones."""
import importlib
import json
import os

import pytest

from experiments.tasks.registry import TASKS, get_task


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_writes_rows_the_reward_accepts(tmp_path, name):
    importlib.import_module("mfc.code_reward")  # registers code-tests
    from mfc.reward import RewardConfig, RewardInput, compute_rewards

    task = get_task(name)
    task.ensure_dataset(str(tmp_path), 40, 10, 0, task.difficulty)
    rows = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    test = [json.loads(line) for line in open(tmp_path / "test.jsonl")]
    assert len(rows) == 40 and len(test) == 10
    # held-out problems are new ones (an image task asks the same words of different images)
    def problem(r):
        return (r["prompt"], tuple(r.get("images", ())))
    assert not {problem(r) for r in test} & {problem(r) for r in rows}
    # the SFT target is a correct answer (under the task's reward); a wrong one is not
    if task.reward == "code-tests":
        # each row runs its tests in the sandbox; rows with a deliberate bug (code_expr) are not targets to check
        rows = [r for r in rows if not r.get("bug")][:8]
        wrong = [r["solution"].replace("print(", "print(1+") for r in rows]
    else:
        wrong = [f"#### {int(r['answer']) + 1}" for r in rows]
    good = compute_rewards([RewardInput(id=r["id"], prompt=r["prompt"], response=r["solution"], answer=r["answer"])
                            for r in rows], RewardConfig(name=task.reward)).rewards
    bad = compute_rewards([RewardInput(id=r["id"], prompt=r["prompt"], response=w, answer=r["answer"])
                           for r, w in zip(rows, wrong)], RewardConfig(name=task.reward)).rewards
    assert all(g > b for g, b in zip(good, bad)) and all(g == 1.0 for g in good)


def test_unknown_task_names_the_closest():
    with pytest.raises(ValueError, match=r"dataset.task='worked'.*did you mean worked_arithmetic"):
        get_task("worked")


def test_sft_and_rl_agree_on_the_task_files(tmp_path):
    """The RL config looks for the SFT start where the SFT run of its task writes it, and
    generates its own prompts beside (not inside) the SFT data."""
    from experiments.ppo_math import GRPOMathConfig
    from experiments.sft import SFTConfig

    for name, task in TASKS.items():
        rl = GRPOMathConfig(fileroot=str(tmp_path))
        rl.dataset.task = name
        actor, _, train, _ = rl._paths()
        sft = SFTConfig(fileroot=str(tmp_path), trial_name=task.sft_trial)
        sft.dataset.task = name
        assert actor.startswith(sft.run_dir("sft") + os.sep), (actor, sft.run_dir("sft"))
        assert os.path.basename(os.path.dirname(train)).startswith(f"{task.data_prefix}-rl-d{task.difficulty}")
        assert sft._data_dir().endswith(f"{task.data_prefix}-d{task.difficulty}-s0")
