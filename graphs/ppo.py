"""PPO-family graphs: actor generation -> reward / reference / critic inference -> training.

``ppo``::

    dataset ── packed_prompts ──> actor_gen ── packed_input_ids, prompt_mask,
                                     │         packed_logprobs, seq_no_eos_mask
              answer ─────────────┐  ▼
                          reward_inf  ref_inf  critic_inf   (all read packed_input_ids)
                               │ rewards │ packed_ref_logprobs │ values
                               ▼         ▼                     ▼
                          actor_train  and  critic_train

``grpo`` is the same graph without the critic (advantages come from the group of
``n_samples`` responses to each prompt) and, when ``kl_coef == 0``, without the
reference model.

The graph only names interfaces ("ppo_actor", "ppo_critic", "ppo_ref",
"rule_reward"); their implementations register themselves from ``mfc/``. Keys come
from :mod:`realflow.api.keys`, so that interfaces, the runtime and tests agree on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import register_graph
from realflow.api.images import IMAGE_KEYS
from realflow.api.keys import (ANSWER, INPUT_IDS, LOGPROBS, NO_EOS, PROMPT_MASK, PROMPTS,  # noqa: F401
                               PROX_LOGPROBS, REF_LOGPROBS, REWARDS, ROUTED_EXPERTS, VALUES)
from realflow.api.mfc import MFCDef, ModelInterfaceType, ParamReallocHook


ACTOR, CRITIC, REF, REWARD = "actor", "critic", "ref", "reward"


@dataclass
class PPOGraphConfig:
    """What varies between PPO-family graphs; every MFC uses the same global batch."""

    batch_size: int
    n_samples: int = 1
    use_critic: bool = True
    use_ref: bool = True
    ref_ema_eta: float | None = None  # set: ref <- eta*actor + (1-eta)*ref after each actor update
    #: the actor trains LoRA adapters: the reference is the actor's base with adapters off (no REF model)
    ref_from_actor_base: bool = False
    #: MoE actor, rollout routing replay: actor_gen emits the experts it chose per token and
    #: actor_train routes every token to them (the critic and the reference route on their own)
    routing_replay: bool = False
    #: vision-language actor: each prompt's images (the data set's image keys) reach generation and
    #: every forward pass of the actor and the reference
    images: bool = False
    #: ``actor_inf`` recomputes the trainer's log-probs of the sampled tokens before actor_train, which
    #: then uses the decoupled objective (ppo.recompute_logprobs, or a ppo.mismatch_correction)
    recompute_logprobs: bool = False
    gen_mb: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    inf_mb: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    train_mb: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    actor_args: dict[str, Any] = field(default_factory=dict)  # "ppo_actor" interface fields
    critic_args: dict[str, Any] = field(default_factory=dict)  # "ppo_critic" interface fields
    reward_args: dict[str, Any] = field(default_factory=dict)  # "rule_reward" interface fields


def _mfc(name: str, role: str, kind: ModelInterfaceType, impl: str, args: dict, ins, outs,
         cfg: PPOGraphConfig, mb: MicroBatchSpec, **kw) -> MFCDef:
    return MFCDef(name=name, model_name=role, interface_type=kind, interface_impl=impl,
                  interface_args=dict(args), input_keys=tuple(ins), output_keys=tuple(outs),
                  n_seqs=cfg.batch_size, mb_spec=mb, **kw)


def ref_model(actor_args: dict[str, Any], from_actor_base: bool,
              ema_eta: float | None = None) -> tuple[str, dict[str, Any]]:
    """(role, interface args) of ``ref_inf``: the REF model, or the actor with its LoRA adapters off."""
    args: dict[str, Any] = {"temperature": actor_args["temperature"]} if "temperature" in actor_args else {}
    if not from_actor_base:
        return REF, args
    if ema_eta is not None:
        raise ValueError("ref_ema_eta (an EMA reference) needs its own REF model; with LoRA the reference is "
                         "the actor's frozen base (set ref_ema_eta=None or model.lora.enabled=false)")
    return ACTOR, {**args, "adapters_off": True}


def build_ppo_family(cfg: PPOGraphConfig) -> list[MFCDef]:
    """The MFCs of PPO (with critic) or GRPO-style training (without)."""
    G, I, T = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP
    actor_args = dict(cfg.actor_args, n_samples=cfg.n_samples)
    train_in = [INPUT_IDS, PROMPT_MASK, LOGPROBS, NO_EOS, REWARDS]
    replay = [ROUTED_EXPERTS] if cfg.routing_replay else []
    if cfg.images and cfg.use_critic:
        raise ValueError("a vision-language actor trains without a critic here (use the grpo graph): "
                         "critics are text-only models")
    img = list(IMAGE_KEYS) if cfg.images else []
    train_in += img
    mfcs = [
        _mfc("actor_gen", ACTOR, G, "ppo_actor", actor_args, [PROMPTS, *img],
             [INPUT_IDS, PROMPT_MASK, LOGPROBS, NO_EOS, *replay], cfg, cfg.gen_mb),
        _mfc("reward_inf", REWARD, I, "rule_reward", cfg.reward_args, [INPUT_IDS, PROMPT_MASK, ANSWER],
             [REWARDS], cfg, cfg.inf_mb),
    ]
    if cfg.use_ref:
        role, ref_args = ref_model(cfg.actor_args, cfg.ref_from_actor_base, cfg.ref_ema_eta)
        mfcs.append(_mfc("ref_inf", role, I, "ppo_ref", ref_args, [INPUT_IDS, *img], [REF_LOGPROBS], cfg,
                         cfg.inf_mb))
        train_in.append(REF_LOGPROBS)
    if cfg.use_critic:
        mfcs.append(_mfc("critic_inf", CRITIC, I, "ppo_critic", cfg.critic_args, [INPUT_IDS], [VALUES],
                         cfg, cfg.inf_mb))
        train_in.append(VALUES)
    train_args = actor_args
    if cfg.recompute_logprobs:  # the trainer's own old log-probs, on the weights that generated
        mfcs.append(_mfc("actor_inf", ACTOR, I, "ppo_actor", actor_args, [INPUT_IDS, *replay, *img],
                         [PROX_LOGPROBS], cfg, cfg.inf_mb))
        train_in.append(PROX_LOGPROBS)
        train_args = dict(actor_args, decoupled=True)
    hooks = []
    if cfg.use_ref and cfg.ref_ema_eta is not None:
        hooks.append(ParamReallocHook(source_role=ACTOR, target_role=REF, eta=cfg.ref_ema_eta))
    mfcs.append(_mfc("actor_train", ACTOR, T, "ppo_actor", train_args, train_in + replay, [], cfg, cfg.train_mb,
                     post_hooks=hooks, log_return_value=True))
    if cfg.use_critic:
        mfcs.append(_mfc("critic_train", CRITIC, T, "ppo_critic", cfg.critic_args, train_in, [], cfg,
                         cfg.train_mb, log_return_value=True))
    return mfcs


@register_graph("ppo")
def build_ppo_graph(cfg: PPOGraphConfig) -> list[MFCDef]:
    """Actor-critic PPO with a reference model (KL penalty) and a rule-based reward."""
    if not cfg.use_critic:
        raise ValueError("the 'ppo' graph needs a critic (use_critic=True); use the 'grpo' graph without one")
    return build_ppo_family(cfg)
