"""Supervised fine-tuning: a single train_step MFC on the data set's token keys."""
from __future__ import annotations

from typing import Any

from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import register_graph
from realflow.api.images import IMAGE_KEYS
from realflow.api.mfc import MFCDef, ModelInterfaceType


@register_graph("sft")
def build_sft_graph(
    batch_size: int,
    mb_spec: MicroBatchSpec,
    role: str = "default",
    interface_args: dict[str, Any] | None = None,
    images: bool = False,
) -> list[MFCDef]:
    """``sft_train``: consumes ``packed_input_ids`` and ``prompt_mask`` from the data set (and, for a
    vision-language model, ``images=True``, each sample's image keys)."""
    return [
        MFCDef(
            name="sft_train",
            model_name=role,
            interface_type=ModelInterfaceType.TRAIN_STEP,
            interface_impl="sft",
            interface_args=dict(interface_args or {}),
            input_keys=("packed_input_ids", "prompt_mask", *(IMAGE_KEYS if images else ())),
            output_keys=(),
            n_seqs=batch_size,
            mb_spec=mb_spec,
            log_return_value=True,
        )
    ]
