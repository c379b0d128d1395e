"""Asynchronous PPO's trainer graph: its source is the trajectory stream, not a data set.

::

    trajectories ── packed_input_ids, prompt_mask, packed_logprobs (behaviour),
         │          seq_no_eos_mask, rewards
         ├──> actor_inf ── proximal_logprobs ──┐
         ├──> ref_inf ── packed_ref_logprobs ──┤   (kl_coef > 0)
         └─────────────────────────────────────┴──> actor_train (decoupled PPO loss)

Generation and rewards happen on the rollout side (``realflow/rollout``); the trainer
recomputes the proximal policy's log-probs under the weights it is about to update
and trains with the decoupled objective (:func:`mfc.losses.ppo_actor_loss` with
``prox_logprobs``), whose behaviour weight corrects for the versions that generated
the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphs.ppo import ACTOR, ref_model
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import register_graph
from realflow.api.images import IMAGE_KEYS
from realflow.api.keys import (INPUT_IDS, LOGPROBS, NO_EOS, PROMPT_MASK, PROX_LOGPROBS, REF_LOGPROBS, REWARDS,
                               ROUTED_EXPERTS, VERSIONS)
from realflow.api.mfc import MFCDef, ModelInterfaceType


@dataclass
class AsyncPPOGraphConfig:
    batch_size: int  # rollouts per step (each a group of sequences)
    use_ref: bool = False
    ref_from_actor_base: bool = False  # LoRA actor: the reference is its base with adapters off
    #: MoE actor, rollout routing replay: actor_inf (proximal) and actor_train route each token to the
    #: experts the generation server chose (the trajectories carry them)
    routing_replay: bool = False
    #: vision-language actor: the trajectories' image keys reach every forward pass
    images: bool = False
    inf_mb: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    train_mb: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    actor_args: dict[str, Any] = field(default_factory=dict)


@register_graph("async_ppo")
def build_async_ppo_graph(cfg: AsyncPPOGraphConfig) -> list[MFCDef]:
    """``actor_inf`` (proximal log-probs) -> ``actor_train`` (decoupled loss), optionally ``ref_inf``."""
    I, T = ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP
    actor_args = dict(cfg.actor_args, decoupled=True)
    replay = [ROUTED_EXPERTS] if cfg.routing_replay else []
    img = list(IMAGE_KEYS) if cfg.images else []
    replay += img  # (the images ride along wherever the routes do: every actor forward pass)
    # VERSIONS: the mismatch stats split the behaviour/proximal gap by each token's version offset
    train_in = [INPUT_IDS, PROMPT_MASK, LOGPROBS, NO_EOS, REWARDS, PROX_LOGPROBS, VERSIONS, *replay]
    mfcs = [MFCDef(name="actor_inf", model_name=ACTOR, interface_type=I, interface_impl="ppo_actor",
                   interface_args=actor_args, input_keys=(INPUT_IDS, *replay), output_keys=(PROX_LOGPROBS,),
                   n_seqs=cfg.batch_size, mb_spec=cfg.inf_mb)]
    if cfg.use_ref:
        role, ref_args = ref_model(cfg.actor_args, cfg.ref_from_actor_base)
        mfcs.append(MFCDef(name="ref_inf", model_name=role, interface_type=I, interface_impl="ppo_ref",
                           interface_args=ref_args, input_keys=(INPUT_IDS, *img), output_keys=(REF_LOGPROBS,),
                           n_seqs=cfg.batch_size, mb_spec=cfg.inf_mb))
        train_in.append(REF_LOGPROBS)
    mfcs.append(MFCDef(name="actor_train", model_name=ACTOR, interface_type=T, interface_impl="ppo_actor",
                       interface_args=actor_args, input_keys=tuple(train_in), output_keys=(),
                       n_seqs=cfg.batch_size, mb_spec=cfg.train_mb, log_return_value=True))
    return mfcs
