"""Generated tasks by name: every entry makes its data, SFT and RL find the same files, and a
wrong task name is a one-line error naming the closest ones."""
import json
import os

import pytest

from experiments.tasks.registry import TASKS, get_task


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_writes_rows_the_reward_accepts(tmp_path, name):
    from mfc.reward import RewardConfig, RewardInput, compute_rewards

    task = get_task(name)
    task.ensure_dataset(str(tmp_path), 40, 10, 0, task.difficulty)
    rows = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    test = [json.loads(line) for line in open(tmp_path / "test.jsonl")]
    assert len(rows) == 40 and len(test) == 10
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in rows}
    # the SFT target is a correct answer; a wrong final answer is not
    good = compute_rewards([RewardInput(id=r["id"], prompt=r["prompt"], response=r["solution"], answer=r["answer"])
                            for r in rows], RewardConfig(name="arithmetic")).rewards
    bad = compute_rewards([RewardInput(id=r["id"], prompt=r["prompt"], response=f"#### {int(r['answer']) + 1}",
                                       answer=r["answer"]) for r in rows], RewardConfig(name="arithmetic")).rewards
    assert all(g > b for g, b in zip(good, bad))


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
