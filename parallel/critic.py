"""Critic = the GPT trunk with a scalar value head (HF ``*ForTokenClassification``, 1 label).

HF format: ``Qwen2ForTokenClassification`` / ``LlamaForTokenClassification`` /
``Qwen3ForTokenClassification`` with ``num_labels=1``: the trunk under ``model.*``
exactly as in the causal LM, and ``score.weight [1, hidden]`` (+ ``score.bias [1]``
unless ``token_classification_bias=False``).  HF's classifier dropout is not
applied (RL critics train without it; with dropout 0 the outputs are identical).

Megatron side: we build the usual ``GPTModel`` without tied embeddings and swap
its ``output_layer`` for :class:`ValueHead`, which ``GPTModel`` calls exactly like
its LM head (``head(hidden, weight=None, runtime_gather_output=...) -> (out,
None)``).  The head is replicated on every tp rank: under sequence parallelism
it first all-gathers the sequence, and its backward only SPLITS the gradient
(``tensor_parallel_output_grad=False``): each tp rank computes the same,
replicated loss, so summing the ranks' gradients would count it tp times.

Initialising a critic from an LM checkpoint (no ``score.*`` tensors): the trunk
loads and the head starts at ZERO (weight and bias), so every value estimate
is exactly 0 at first, a neutral baseline, and the head is identical on every
rank without any RNG; ``lm_head.weight`` is ignored.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from parallel.hf_io import ParamMapping
from parallel.model_config import HFArch

__all__ = ["ValueHead", "critic_head_table", "critic_hf_config", "has_value_bias",
           "CRITIC_CLASSES"]

# model_type -> transformers class name of the critic checkpoint
CRITIC_CLASSES = {"qwen2": "Qwen2ForTokenClassification",
                  "llama": "LlamaForTokenClassification",
                  "qwen3": "Qwen3ForTokenClassification"}


def has_value_bias(hf_config: Any) -> bool:
    """HF's ``score`` Linear has a bias unless ``token_classification_bias=False``."""
    get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d: getattr(hf_config, k, d))
    return bool(get("token_classification_bias", True))


class ValueHead(torch.nn.Module):
    """``[s(/tp), b, h]`` final hidden states -> ``[s, b, 1]`` values (replicated over tp)."""

    def __init__(self, hidden_size: int, bias: bool, params_dtype: torch.dtype,
                 sequence_parallel: bool, tp_group: Any) -> None:
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1, bias=bias, dtype=params_dtype)
        with torch.no_grad():
            self.score.weight.zero_()
            if bias:
                self.score.bias.zero_()
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group)
        return self.score(hidden), None


def critic_head_table(hf_config: Any, arch: HFArch) -> list[ParamMapping]:
    """Mapping rows of the value head (appended to the trunk rows of ``param_table``)."""
    from parallel.model_config import config_value

    hidden = int(config_value(hf_config, "hidden_size"))
    rows = [ParamMapping("output_layer.score.weight", ("score.weight",), ((1, hidden),), "copy",
                         None)]
    if has_value_bias(hf_config):
        rows.append(ParamMapping("output_layer.score.bias", ("score.bias",), ((1,),), "copy", None))
    return rows


def critic_hf_config(hf_config: Any) -> Any:
    """A copy of ``hf_config`` describing the critic checkpoint (1-label token classifier)."""
    cfg = copy.deepcopy(hf_config)
    model_type = cfg["model_type"] if isinstance(cfg, dict) else cfg.model_type
    arch_name = CRITIC_CLASSES.get(model_type)
    if arch_name is None:
        raise NotImplementedError(f"critic for model_type={model_type!r}; supported: "
                                  f"{sorted(CRITIC_CLASSES)}")
    if isinstance(cfg, dict):
        cfg["architectures"] = [arch_name]
        cfg["num_labels"] = 1
        cfg["id2label"] = {"0": "LABEL_0"}
        cfg["label2id"] = {"LABEL_0": 0}
    else:
        cfg.architectures = [arch_name]
        cfg.num_labels = 1
    return cfg
