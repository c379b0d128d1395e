"""``algorithm=NAME`` from the command line: what a preset sets, that it stays overridable, that bad
combinations fail before any worker starts naming both keys, and that presets run end to end
(sync and async, through the real launcher, from the shared small SFT start).

(Each preset's loss and gradients against its paper's formula: tests/test_algorithm_formulas.py;
every preset trained and compared on one task: ``python -m benchmarks.bench_algorithms``.)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import copy_sft_start

from experiments.algorithms import ALGORITHMS
from realflow.config.cli import ConfigError, import_modules, parse_overrides
from realflow.api.experiment import experiment_registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["dataset.task=arithmetic", "ppo.max_new_tokens=16", "dataset.n_test=16", "eval_n_samples=1",
        "dataset.n_train=2000", "batch_size=8", "ppo.n_samples=4", "max_train_steps=3"]


def _cli(app: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"realflow.apps.{app}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _config(exp: str, *over: str):
    import_modules(["experiments"])
    return parse_overrides(experiment_registry.get(exp), ["fileroot=/nonexistent", *over])


def test_a_preset_sets_its_keys_and_every_key_stays_overridable():
    dapo = _config("grpo-math", "algorithm=dapo").ppo
    assert (dapo.eps_clip, dapo.eps_clip_high, dapo.overlong_buffer_ratio) == (0.2, 0.28, 0.25)
    assert dapo.reward_norm.mean_level == dapo.reward_norm.std_level == "group"
    mine = _config("grpo-math", "algorithm=dapo", "ppo.eps_clip_high=0.3", "ppo.reward_norm.std_level=none").ppo
    assert mine.eps_clip_high == 0.3 and mine.reward_norm.std_level == "none" and mine.overlong_buffer_ratio == 0.25
    # switching presets leaves nothing of the other behind: a preset sets its neutral keys too
    gspo_then_grpo = _config("grpo-math", "algorithm=gspo", "algorithm=grpo").ppo
    assert gspo_then_grpo.importance_sampling_level == "token" and gspo_then_grpo.eps_clip_high is None
    dr = _config("async-grpo-math", "algorithm=dr_grpo").ppo
    assert dr.loss_agg == "seq-mean-token-sum-norm" and dr.reward_norm.std_level == "none"
    with pytest.raises(ConfigError, match=r"algorithm='dr_gpro' is not a preset; known: .*did you mean dr_grpo"):
        _config("grpo-math", "algorithm=dr_gpro")


@pytest.fixture(scope="module")
def sync_help() -> str:
    res = _cli("main_sync_ppo", "--help", timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_help_lists_every_preset_and_what_it_sets(sync_help):
    for name in ALGORITHMS:
        assert f"  algorithm={name}: ppo.estimator=" in sync_help, name
    assert "ppo.importance_sampling_level=sequence" in sync_help and "ppo.policy_loss=sapo" in sync_help


def test_help_shows_every_knob_with_the_help_of_its_one_declaration(sync_help):
    """Each knob of mfc.ppo_config.PPOConfig is the key ppo.<name>, its --help text the declaration's."""
    import dataclasses

    from mfc.ppo_config import PPOConfig

    lines = sync_help.splitlines()
    knobs = [f for f in dataclasses.fields(PPOConfig) if f.init]
    assert len(knobs) >= 30
    for f in knobs:
        at = [i for i, line in enumerate(lines) if line.startswith(f"  ppo.{f.name}: ")]
        assert len(at) == 1, f.name
        assert lines[at[0] + 1].strip() == f.metadata["help"], f.name
    assert "ppo.behav_cap_mode: " in sync_help and "ppo.reward_norm.std_of: " in sync_help


def test_presets_name_only_fields_of_the_knob_dataclass():
    """A preset sets knobs of mfc.ppo_config.PPOConfig (and the data-side dynamic_sampling) by their
    field names; a misspelt key or a bad value fails when the presets are checked (at import)."""
    from experiments.algorithms import _BASE, check_presets, preset_overrides
    from experiments.ppo_hyper import PPOHyperConfig
    from mfc.ppo_config import PPOConfig
    from realflow.api.config_values import field_paths

    knobs = set(field_paths(PPOConfig))
    for name in ALGORITHMS:
        keys = [item.split("=", 1)[0].removeprefix("ppo.") for item in preset_overrides(name)]
        assert set(keys) <= knobs | {"dynamic_sampling"}, (name, set(keys) - knobs)
    assert set(_BASE) <= set(field_paths(PPOHyperConfig))
    with pytest.raises(ConfigError, match=r"algorithm preset 'typo': unknown config key 'eps_clip_hihg'.*eps_clip_high"):
        check_presets({"typo": {"eps_clip_hihg": "0.28"}})
    with pytest.raises(ConfigError, match=r"algorithm preset 'bad': .*ppo.dual_clip=0.5 must be > 1"):
        check_presets({"bad": {"dual_clip": "0.5"}})


def test_the_kl_estimator_defaults_by_where_the_kl_goes():
    """k3 (low_var_kl) in the loss, k1 in the reward, as verl's defaults; an explicit one wins."""
    assert _config("grpo-math", "ppo.kl_coef=0.1", "ppo.kl_in=loss").ppo.kl_estimator_used() == "k3"
    assert _config("grpo-math", "ppo.kl_coef=0.1").ppo.kl_estimator_used() == "k1"
    assert _config("grpo-math", "ppo.kl_in=loss", "ppo.kl_estimator=k1").ppo.kl_estimator_used() == "k1"
    from realflow.api.interface import make_interface

    cfg = _config("grpo-math", "ppo.kl_coef=0.1", "ppo.kl_in=loss", "ppo.behav_cap_mode=mask").ppo
    actor = make_interface("ppo_actor", **cfg.actor_args())
    assert actor.ppo.kl_estimator_used() == "k3" and actor.ppo.kl_loss_coef() == 0.1
    assert actor.ppo.behav_cap_mode == "mask"  # the decoupled loss's cap mode, from the command line
    with pytest.raises(ValueError, match="ppo.behav_cap_mode='clip' must be one of truncate, mask"):
        _config("async-grpo-math", "ppo.behav_cap_mode=clip")


@pytest.mark.parametrize("app,args,needles", [
    ("main_sync_ppo", ["algorithm=sapo", "ppo.dual_clip=2"], ["ppo.policy_loss='sapo'", "ppo.dual_clip=2.0"]),
    ("main_sync_ppo", ["algorithm=dapo", "ppo.mask_truncated=true"],
     ["ppo.overlong_buffer_ratio=0.25", "ppo.mask_truncated=True"]),
    ("main_sync_ppo", ["algorithm=grpo", "ppo.n_samples=1"], ["ppo.reward_norm=", "ppo.n_samples=1"]),
    ("main_sync_ppo", ["algorithm=grpo", "ppo.kl_in=loss", "ppo.kl_ctl=adaptive"], ["ppo.kl_in='loss'",
                                                                                 "ppo.kl_ctl='adaptive'"]),
    ("main_sync_ppo", ["algorithm=ppo"], ["ppo.estimator=gae needs a critic", "experiment=grpo-math"]),
    ("main_async_ppo", ["algorithm=ppo"], ["ppo.estimator=gae needs a critic", "asynchronous"]),
])
def test_bad_combinations_fail_before_any_worker_starts(tmp_path, app, args, needles):
    res = _cli(app, f"fileroot={tmp_path}", *args, "--dry-run", timeout=120)
    assert res.returncode == 2, res.stdout[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in line, line
    assert not (tmp_path / "grpo-math").exists() and not (tmp_path / "async-grpo-math").exists()


@pytest.fixture(scope="module")
def fileroot(tmp_path_factory, small_sft_start):
    return copy_sft_start(small_sft_start, tmp_path_factory.mktemp("presets"))


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if "actor_train/loss" in r]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("app,exp,alg", [("main_sync_ppo", "grpo-math", "dr_grpo"),
                                         ("main_sync_ppo", "grpo-math", "sapo"),
                                         ("main_sync_ppo", "grpo-math", "dapo"),
                                         ("main_async_ppo", "async-grpo-math", "gspo"),
                                         ("main_async_ppo", "async-grpo-math", "dapo")])
def test_presets_run_to_completion(fileroot, app, exp, alg):
    dense = ["reward=arithmetic_consistency"] if alg == "dapo" else []  # the weak start: groups that differ
    res = _cli(app, f"fileroot={fileroot}", *FAST, f"algorithm={alg}", f"trial_name={alg}", *dense)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(fileroot / exp / alg)
    assert len(rows) == 3 and all(math.isfinite(r["actor_train/loss"]) for r in rows), rows
    assert "held-out" in res.stdout
    if alg == "dapo" and app == "main_sync_ppo":  # dynamic sampling: every trained group has a reward spread
        assert all(r["dynamic_sampling/kept_frac"] <= 1.0 and "dynamic_sampling/extra_rounds" in r for r in rows)
        with open(fileroot / exp / alg / "samples.jsonl") as f:  # every step trained a full batch
            assert [len(json.loads(line)["ids"]) for line in f if line.strip()] == [8, 8, 8]
    if alg == "dapo" and app == "main_async_ppo":
        assert "async/filtered_groups" in rows[-1]


def test_dynamic_sampling_that_cannot_fill_a_batch_stops_saying_why(fileroot):
    env_args = ["--import", "constant_reward"]
    plugins = os.path.join(REPO, "tests", "plugins")
    res = subprocess.run([sys.executable, "-m", "realflow.apps.main_sync_ppo", *env_args, f"fileroot={fileroot}", *FAST,
                          "algorithm=dapo", "reward=constant", "ppo.dynamic_sampling_max_rounds=2",
                          "trial_name=nofill"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([plugins, os.environ.get("PYTHONPATH", "")])))
    assert res.returncode != 0
    assert "dynamic sampling: after 2 extra round(s) only 0 of batch_size=8 groups had rewards that differ" \
        in res.stderr, res.stderr[-3000:]
    assert "24 of 24 drawn were all equal" in res.stderr and "ppo.dynamic_sampling_max_rounds" in res.stderr


def test_a_user_package_adds_a_policy_loss_without_editing_realflow():
    """The docs' example (docs/algorithms.md): a registered function is reachable by ppo.policy_loss."""
    import torch

    from mfc.losses import policy_losses, ppo_actor_loss, register_policy_loss
    from realflow.api.interface import make_interface

    @register_policy_loss("test_cispo")
    def cispo(ratio, adv, cfg):
        w = ratio.detach().clamp(max=1.0 + (cfg.eps_clip_high or cfg.eps_clip))
        return -w * adv * torch.log(ratio), ratio.detach() > 1.0 + (cfg.eps_clip_high or cfg.eps_clip)

    try:
        cfg = _config("grpo-math", "algorithm=dapo", "ppo.policy_loss=test_cispo").ppo
        actor = make_interface("ppo_actor", **{**cfg.actor_args(), "seed": 1})
        lp = torch.tensor([-0.8, -0.5, -2.0], requires_grad=True)  # first ratio e^0.4 > 1.28: capped
        old, adv = torch.tensor([-1.2, -0.5, -1.0]), torch.tensor([1.0, -1.0, 2.0])
        loss, stats = ppo_actor_loss(lp, old, adv, torch.ones(3, dtype=torch.bool), actor.ppo, seqlens=[3])
        loss.backward()
        w = torch.exp(lp.detach() - old).clamp(max=1.28)
        assert torch.allclose(lp.grad, -w * adv) and stats["clipped_tokens"] == 1.0
        with pytest.raises(ValueError, match="policy_loss='nope' must be one of clip, sapo"):
            _config("grpo-math", "ppo.policy_loss=nope")
    finally:
        policy_losses.unregister("test_cispo")
