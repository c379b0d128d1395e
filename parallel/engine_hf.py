"""A :class:`parallel.engine.MegatronEngine`'s weights under HF names: gathering, saving, LoRA adapters.

A mixin so that the engine's file holds building, inference and the train step, and this one
what leaves the engine as HF or PEFT tensors: the whole model (adapters merged, as PEFT merges
them), the adapters alone (what a LoRA run saves and sends to generation servers), the last
step's gradients (tests), and the tensors a colocated generator samples from.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.engine_lora import adapter_hf_state, save_lora
from parallel.hf_io import gather_hf_state, save_hf_checkpoint
from parallel.hf_layout import gather_hf_state_any

__all__ = ["EngineHFMixin"]


class EngineHFMixin:
    """Needs ``module``, ``groups``, ``hf_config``, ``arch``, ``critic``, ``lora``, ``optimizer``, ``base_path``."""

    # ------------------------------------------------------------------ checkpoints

    def full_hf_state(self, adapters_merged: bool = True) -> Optional[dict[str, torch.Tensor]]:
        """The whole model under HF names (CPU) on the writer (dp 0, tp 0, pp 0), None
        elsewhere.  Collective over the model's ranks of dp replica 0.  With LoRA the adapters
        are merged into the weights (as PEFT merges them) unless ``adapters_merged=False``."""
        state = gather_hf_state_any(self.module, self.groups, self.hf_config, self.arch,
                                    critic=self.critic)
        if self.lora is None or not adapters_merged:
            return state
        adapters = adapter_hf_state(self)
        if state is not None:
            from parallel.lora_io import merge_into_hf

            state.update(merge_into_hf(state, adapters, self.lora.cfg.scaling))
        return state

    # ------------------------------------------------------------------ LoRA

    @property
    def has_adapters(self) -> bool:
        """True when this engine trains LoRA adapters on a frozen base."""
        return self.lora is not None

    def adapters_disabled(self) -> Any:
        """Context manager: forwards inside run the base model (the KL reference of a LoRA run)."""
        if self.lora is None:
            raise RuntimeError("adapters_disabled() on an engine without LoRA adapters")
        return self.lora.disabled()

    def generation_weights(self) -> dict[str, torch.Tensor]:
        """Megatron-named tensors a colocated generator samples from (LoRA: merged weights; expert
        parallelism: every expert, gathered, see :mod:`parallel.engine_experts`)."""
        if self.lora is None:
            weights = dict(self.module.named_parameters())
            from parallel.engine_experts import gathered_expert_weights, needs_expert_gather

            return gathered_expert_weights(self, weights) if needs_expert_gather(self) else weights
        from parallel.engine_lora import generation_weights

        return generation_weights(self)

    def adapter_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The adapters under PEFT's names on the writer (dp 0, tp 0, pp 0), None elsewhere
        (collective over dp replica 0): what a weight update of a LoRA run carries."""
        if self.lora is None:
            raise RuntimeError("adapter_state() on an engine without LoRA adapters")
        return adapter_hf_state(self)

    def full_hf_grads(self) -> Optional[dict[str, torch.Tensor]]:
        """The last step's reduced gradients under HF names on the writer (dp == 1 only:
        the distributed optimizer leaves each dp rank only its shard of the reduced
        gradient).  For tests and debugging."""
        if self.groups.strategy.dp != 1 or self.optimizer is None:
            raise RuntimeError("full_hf_grads needs a trainable engine with dp == 1")
        if self.lora is not None:
            return adapter_hf_state(self, grads=True)
        return gather_hf_state_any(self.module, self.groups, self.hf_config, self.arch,
                                   critic=self.critic, tensor_of=lambda p: p.main_grad,
                                   dtype=torch.float32)

    def save_hf(self, path: str, tokenizer_dir: Optional[str] = None) -> None:
        """Save ONE HF checkpoint from any layout. Collective over the model's ranks: every
        rank calls it, the writer (dp 0, tp 0, pp 0) writes, all return once it exists.
        A critic is saved as ``*ForTokenClassification`` with ``num_labels=1``.  With LoRA,
        ``path`` becomes a PEFT adapter directory (plus ``path/merged`` with ``save_merged``)."""
        if self.lora is not None:
            return save_lora(self, path, tokenizer_dir, self.base_path)
        state = self.full_hf_state()
        if state is not None:
            cfg = self.hf_config
            if self.critic:
                from parallel.critic import critic_hf_config

                cfg = critic_hf_config(cfg)
            save_hf_checkpoint(path, state, cfg, tokenizer_dir)
        if len(self.groups.ranks) > 1:
            dist.barrier(group=self.groups.model_group)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under HF names (CPU copies; tp = 1: no gathering)."""
        if self.groups.strategy.tp != 1:
            raise RuntimeError("hf_state_dict is per rank and needs tp == 1; use full_hf_state")
        return gather_hf_state(self.module, self.hf_config, self.arch, critic=self.critic)
