"""The rejection-sampling fine-tuning graph: generate n -> reward -> train on the rewarded.

    actor_gen  (generate on ``actor``, built-in ``ppo_actor``):  packed_prompts -> packed_input_ids,
                                                                 prompt_mask, packed_logprobs, seq_no_eos_mask
    reward_inf (inference on ``reward``, built-in ``rule_reward``): packed_input_ids, prompt_mask,
                                                                    answer -> rewards
    rft_train  (train_step on ``actor``, this package's ``rft``):  packed_input_ids, prompt_mask,
                                                                 rewards -> (stats)

Two of the three calls are realflow's own interfaces, used by name: a user algorithm
composes them with its own, and the plan compiler moves the actor's weights when its
generation and training layouts differ.
"""
from __future__ import annotations

from typing import Any

from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import register_graph
from realflow.api.mfc import MFCDef, ModelInterfaceType

ACTOR, REWARD = "actor", "reward"
GEN_OUT = ("packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask")


@register_graph("rft")
def build_rft_graph(batch_size: int, mb_spec: MicroBatchSpec, gen_args: dict[str, Any],
                    reward_args: dict[str, Any], train_args: dict[str, Any]) -> list[MFCDef]:
    G, I, T = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP
    return [
        MFCDef(name="actor_gen", model_name=ACTOR, interface_type=G, interface_impl="ppo_actor",
               interface_args=dict(gen_args), input_keys=("packed_prompts",), output_keys=GEN_OUT,
               n_seqs=batch_size),
        MFCDef(name="reward_inf", model_name=REWARD, interface_type=I, interface_impl="rule_reward",
               interface_args=dict(reward_args), input_keys=("packed_input_ids", "prompt_mask", "answer"),
               output_keys=("rewards",), n_seqs=batch_size),
        MFCDef(name="rft_train", model_name=ACTOR, interface_type=T, interface_impl="rft",
               interface_args=dict(train_args), input_keys=("packed_input_ids", "prompt_mask", "rewards"),
               n_seqs=batch_size, mb_spec=mb_spec, log_return_value=True),
    ]
