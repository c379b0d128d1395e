"""How a model is trained to fit memory: LoRA adapters, activation recompute, optimizer offload.

These are user keys (``model.lora.*``, ``training.*``) carried per model on
:class:`realflow.api.experiment.ModelSpec`, so one run may give its actor LoRA and its critic
full fine-tuning. The backend (``parallel/``) reads them; nothing here imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["LoRAConfig", "TrainingMemoryConfig", "MoEConfig", "LORA_TARGETS", "LORA_INITS", "RECOMPUTE_MODES",
           "PAD_FREE_MODES", "SHARED_PREFIX_MODES", "ROUTING_REPLAY_MODES"]

#: HF module names LoRA may target (Qwen2/Qwen3/Llama), each a part of one fused megatron linear
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: PEFT's ``init_lora_weights``: default (A kaiming-uniform, B zero), gaussian (A normal 1/r, B zero)
LORA_INITS = ("default", "gaussian")
RECOMPUTE_MODES = ("none", "full", "selective")
#: ``training.pad_free``: concatenated (THD) micro-batches where supported / required / never
PAD_FREE_MODES = ("auto", "on", "off")
#: ``training.shared_prefix``: a sample group's common prompt computed once where it saves work / required / never
SHARED_PREFIX_MODES = ("auto", "on", "off")
#: auto: ``rollout`` for an MoE model in an RL experiment, ``off`` otherwise
ROUTING_REPLAY_MODES = ("auto", "off", "rollout")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the model's linears (PEFT's LoRA: ``W x + (alpha / r) B A x``)."""

    enabled: bool = field(default=False, metadata={
        "help": "train LoRA adapters instead of the whole model (the base is frozen; the KL reference "
                "is the base with adapters off; weight updates carry the adapters only)"})
    r: int = field(default=16, metadata={"help": "adapter rank"})
    alpha: float = field(default=32.0, metadata={"help": "scaling numerator: updates are (alpha / r) B A"})
    dropout: float = field(default=0.05, metadata={"help": "dropout on the adapters' input (training only)"})
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      metadata={"help": "HF module names: " + ", ".join(LORA_TARGETS)
                                                + " (or all-linear)"})
    init: str = field(default="default", metadata={"help": "adapter init as PEFT's init_lora_weights: "
                                                           + " | ".join(LORA_INITS)})
    path: str = field(default="", metadata={
        "help": "a PEFT adapter directory to start from (adapter_config.json + adapter_model.safetensors)"})
    save_merged: bool = field(default=False, metadata={
        "help": "also write a merged HF checkpoint beside the adapter when the model is saved"})

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [t.strip() for t in self.target_modules.split(",") if t.strip()]
        if list(self.target_modules) == ["all-linear"]:
            self.target_modules = list(LORA_TARGETS)
        if not self.enabled:
            return
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"model.lora.r={self.r!r} must be an integer >= 1 (e.g. 16)")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha!r} must be > 0 (e.g. 2 * r)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout!r} must be in [0, 1)")
        if self.init not in LORA_INITS:
            raise ValueError(f"model.lora.init={self.init!r} must be one of {', '.join(LORA_INITS)}")
        if not self.target_modules:
            raise ValueError(f"model.lora.target_modules is empty; name some of {', '.join(LORA_TARGETS)}")
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            import difflib

            near = sorted({c for t in unknown for c in difflib.get_close_matches(t, LORA_TARGETS, 3, 0.5)})
            raise ValueError(f"model.lora.target_modules names {unknown}, which are no module of this model; "
                             f"{'did you mean ' + ', '.join(near) + '? ' if near else ''}"
                             f"valid: {', '.join(LORA_TARGETS)} (or all-linear)")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / float(self.r)

    def as_dict(self) -> dict[str, Any]:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules), "init": self.init}


@dataclass
class TrainingMemoryConfig:
    """Memory-for-time trades of a trained model (and ``pad_free``: not computing padding)."""

    gradient_checkpointing: str = field(default="none", metadata={
        "help": "recompute activations in the backward: none | full (whole layers) | selective "
                "(the attention core only)"})
    optimizer_offload: bool = field(default=False, metadata={
        "help": "keep the optimizer state in pinned host memory between train steps (GPU; a no-op on CPU)"})
    offload_master_weights: bool = field(default=False, metadata={
        "help": "with optimizer_offload: the fp32 master weights live on the host too"})
    pad_free: str = field(default="auto", metadata={
        "help": "run each micro-batch's sequences concatenated (no padding in the layers; attention and "
                "rotary positions per sequence) in log-probs, values and train steps: auto (pad-free where "
                "supported: models built with the sdpa attention, dense, MoE or vision-language; padded with "
                "megatron's attention or TransformerEngine) | on (error where unsupported) | off (right-padded [B, S])"})
    shared_prefix: str = field(default="auto", metadata={
        "help": "compute the common prefix of consecutive sequences (a GRPO group's prompt, an agent's "
                "earlier turns) once per micro-batch, every sample attending to it: the same loss and "
                "gradients with fewer tokens. auto (pad-free dense language models, prefixes of 4+ "
                "tokens) | on (error where unsupported or when a batch shares nothing) | off"})

    def __post_init__(self) -> None:
        if self.gradient_checkpointing not in RECOMPUTE_MODES:
            raise ValueError(f"training.gradient_checkpointing={self.gradient_checkpointing!r} must be one of "
                             f"{', '.join(RECOMPUTE_MODES)}")
        if self.pad_free not in PAD_FREE_MODES:
            raise ValueError(f"training.pad_free={self.pad_free!r} must be one of {', '.join(PAD_FREE_MODES)}")
        if self.shared_prefix not in SHARED_PREFIX_MODES:
            raise ValueError(f"training.shared_prefix={self.shared_prefix!r} must be one of "
                             f"{', '.join(SHARED_PREFIX_MODES)}")
        if self.offload_master_weights and not self.optimizer_offload:
            raise ValueError("training.offload_master_weights=true needs training.optimizer_offload=true")


@dataclass
class MoEConfig:
    """Mixture-of-experts options of a model (``moe.*``); refused on a dense model."""

    routing_replay: str = field(default="auto", metadata={
        "help": "rollout routing replay (R3): the trainer's forward passes route each generated sample's "
                "tokens to the experts the generator chose (rollout) or to its own router's choice (off); "
                "auto = rollout for MoE models in RL runs, off otherwise"})
    aux_loss_coef: Optional[float] = field(default=None, metadata={
        "help": "load-balancing loss coefficient (HF's formula); default: the checkpoint's "
                "router_aux_loss_coef; 0 turns it off"})

    def __post_init__(self) -> None:
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"moe.routing_replay={self.routing_replay!r} must be one of "
                             f"{', '.join(ROUTING_REPLAY_MODES)}")
        if self.aux_loss_coef is not None and not float(self.aux_loss_coef) >= 0.0:
            raise ValueError(f"moe.aux_loss_coef={self.aux_loss_coef!r} must be >= 0 (e.g. 0.001)")

    def is_default(self) -> bool:
        return self.routing_replay == "auto" and self.aux_loss_coef is None
