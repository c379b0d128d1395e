"""The reward-model graph: one ``train_step`` MFC on the ``reward`` model.

Its only inputs are the data set's preference pairs (``packed_input_ids``: chosen then
rejected per sample), so the graph has no edges; what makes it a reward model is the
interface (:mod:`examples.reward_model.interface`) and the model's scalar head.
"""
from __future__ import annotations

from typing import Any

from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import register_graph
from realflow.api.mfc import MFCDef, ModelInterfaceType

REWARD = "reward"


@register_graph("reward_model")
def build_reward_model_graph(batch_size: int, mb_spec: MicroBatchSpec,
                             interface_args: dict[str, Any] | None = None) -> list[MFCDef]:
    return [MFCDef(name="rm_train", model_name=REWARD, interface_type=ModelInterfaceType.TRAIN_STEP,
                   interface_impl="bradley_terry", interface_args=dict(interface_args or {}),
                   input_keys=("packed_input_ids",), output_keys=(), n_seqs=batch_size, mb_spec=mb_spec,
                   log_return_value=True)]
