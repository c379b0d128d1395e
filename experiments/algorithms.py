"""The PPO family as presets of ``ppo.*`` keys: ``algorithm=ppo|grpo|dr_grpo|lite_ppo|rloo|reinforce_pp|dapo|gspo|sapo``.

Why presets and not classes: every algorithm here is the same actor loss and advantage code
with different values (docs/algorithms.md gives each formula). A preset sets every key that
defines its algorithm -- also the ones it leaves at their neutral value, so switching presets
never inherits another's settings -- and nothing else: each key stays overridable by a later
``key=value``, and ``--help`` lists what each preset sets.

A preset names fields of :class:`experiments.ppo_hyper.PPOHyperConfig` (the knobs of
:class:`mfc.ppo_config.PPOConfig`, and ``dynamic_sampling``) and is checked against it when this
module is imported (:func:`check_presets`): a misspelt key or a bad value fails at import, naming
the preset, not when a user picks it.
"""
from __future__ import annotations

from typing import Any

from realflow.config.cli import ConfigError, parse_overrides

# the neutral value of every key an algorithm may set
_BASE: dict[str, Any] = {
    "estimator": "grpo", "reward_norm": "none", "adv_norm.mean_level": "none", "adv_norm.std_level": "none",
    "adv_norm.mean_leave1out": "false", "adv_norm.std_unbiased": "true", "adv_norm.eps": "1e-5",
    "eps_clip": "0.2", "eps_clip_high": "none", "dual_clip": "none", "policy_loss": "clip",
    "importance_sampling_level": "token", "loss_agg": "token-mean", "loss_agg_norm_len": "none",
    "adv_norm.std_of": "centred", "mask_truncated": "false", "overlong_buffer_ratio": "0", "kl_in": "reward",
    "dynamic_sampling": "false",
}


def _norm(prefix: str, mean: str, std: str, leave1out: bool = False, unbiased: bool = True,
          eps: str = "1e-6") -> dict[str, str]:
    return {f"{prefix}.mean_level": mean, f"{prefix}.std_level": std,
            f"{prefix}.mean_leave1out": str(leave1out).lower(), f"{prefix}.std_unbiased": str(unbiased).lower(),
            f"{prefix}.eps": eps, f"{prefix}.std_of": "centred"}


_GROUP_Z = _norm("reward_norm", "group", "group")  # GRPO's group-normalised reward
_BATCH_ADV = {"adv_norm.mean_level": "batch", "adv_norm.std_level": "batch"}

ALGORITHMS: dict[str, dict[str, Any]] = {
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): critic + GAE, batch-normalised advantages
    "ppo": {"estimator": "gae", **_BATCH_ADV},
    # GRPO (Shao et al. 2024): (r - mean_group) / std_group on every token, each sequence's token mean
    "grpo": {**_GROUP_Z, "loss_agg": "seq-mean-token-mean"},
    # Dr. GRPO (Liu et al. 2025): no std scaling, a constant length normaliser
    "dr_grpo": {**_norm("reward_norm", "group", "none"), "loss_agg": "seq-mean-token-sum-norm"},
    # LitePPO (Liu et al. 2025, "Tricks or Traps"): group mean, batch std (of the group-centred rewards, as
    # AReaL and ROLL), token-level loss
    "lite_ppo": {**_norm("reward_norm", "group", "batch")},
    # RLOO (Ahmadian et al. 2024): r_i - mean of the other responses to the same prompt
    "rloo": {"estimator": "rloo", **_norm("reward_norm", "group", "none", leave1out=True)},
    # REINFORCE++ (Hu 2025): discounted return-to-go, normalised over the global batch
    "reinforce_pp": {"estimator": "reinforce++", **_BATCH_ADV},
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, soft overlong punishment, dynamic sampling
    "dapo": {**_GROUP_Z, "eps_clip_high": "0.28", "overlong_buffer_ratio": "0.25", "dynamic_sampling": "true"},
    # GSPO (Zheng et al. 2025): the sequence-level ratio exp(mean log-ratio), clipped per sequence
    "gspo": {**_GROUP_Z, "importance_sampling_level": "sequence", "eps_clip": "3e-4", "eps_clip_high": "4e-4",
             "loss_agg": "seq-mean-token-mean"},
    # SAPO (Gao et al. 2025): soft gates (4 / tau) sigmoid(tau (ratio - 1)) instead of the clip
    "sapo": {**_GROUP_Z, "policy_loss": "sapo", "loss_agg": "seq-mean-token-mean"},
}


def preset_overrides(name: str, prefix: str = "ppo.") -> list[str]:
    """The ``key=value`` items of preset ``name`` (every defining key; see the module docstring)."""
    items = dict(_BASE)
    if any(k.startswith("reward_norm.") for k in ALGORITHMS[name]):
        items.pop("reward_norm")  # its fields are set one by one
    items.update(ALGORITHMS[name])
    return [f"{prefix}{k}={v}" for k, v in items.items()]


def presets(prefix: str = "ppo.") -> dict[str, dict[str, list[str]]]:
    """The ``PRESETS`` table of an RL experiment config (``realflow.config.cli.expand_presets``)."""
    return {"algorithm": {name: preset_overrides(name, prefix) for name in ALGORITHMS}}


def check_presets(table: dict[str, dict[str, Any]] | None = None) -> None:
    """Build :class:`~experiments.ppo_hyper.PPOHyperConfig` from every preset's items: a key that is
    not a field, or a value its field rejects, raises :class:`ConfigError` naming the preset."""
    from experiments.ppo_hyper import PPOHyperConfig

    table = ALGORITHMS if table is None else table
    for name, keys in table.items():
        items = dict(_BASE)
        if any(k.startswith("reward_norm.") for k in keys):
            items.pop("reward_norm")
        items.update(keys)
        try:
            parse_overrides(PPOHyperConfig, [f"{k}={v}" for k, v in items.items()])
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"algorithm preset {name!r}: {e}") from None


check_presets()
