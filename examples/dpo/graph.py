"""The DPO graph: the reference model's log-probs of both responses, then the policy's step.

    ref_inf   (inference on ``ref``, interface ``ppo_ref``): packed_input_ids -> packed_ref_logprobs
    dpo_train (train_step on ``actor``, interface ``dpo``):  packed_input_ids, prompt_mask,
                                                            packed_ref_logprobs -> (stats)

The edge is the key ``packed_ref_logprobs``. ``ref`` may have its own layout (the allocation
string, e.g. ``dpo_train:d1t2,ref_inf:d2``): the master moves the log-probs between the
workers. ``ref_offload`` adds an offload hook that frees the reference's memory after its
call each step.
"""
from __future__ import annotations

from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import register_graph
from realflow.api.mfc import MFCDef, ModelInterfaceType, OffloadHook

ACTOR, REF = "actor", "ref"
REF_LOGPROBS = "packed_ref_logprobs"


@register_graph("dpo")
def build_dpo_graph(batch_size: int, mb_spec: MicroBatchSpec, beta: float = 0.1,
                    ref_offload: bool = False, ref_from_actor_base: bool = False) -> list[MFCDef]:
    """``ref_from_actor_base``: the policy trains LoRA adapters, so the reference is the policy's own
    frozen base with the adapters off (no second model)."""
    ref_role, ref_args = (ACTOR, {"temperature": 1.0, "adapters_off": True}) if ref_from_actor_base \
        else (REF, {"temperature": 1.0})
    return [
        MFCDef(name="ref_inf", model_name=ref_role, interface_type=ModelInterfaceType.INFERENCE,
               interface_impl="ppo_ref", interface_args=ref_args,
               input_keys=("packed_input_ids",), output_keys=(REF_LOGPROBS,), n_seqs=batch_size,
               mb_spec=mb_spec, post_hooks=[OffloadHook()] if ref_offload and not ref_from_actor_base else []),
        MFCDef(name="dpo_train", model_name=ACTOR, interface_type=ModelInterfaceType.TRAIN_STEP,
               interface_impl="dpo", interface_args={"beta": beta},
               input_keys=("packed_input_ids", "prompt_mask", REF_LOGPROBS), n_seqs=batch_size,
               mb_spec=mb_spec, log_return_value=True),
    ]
