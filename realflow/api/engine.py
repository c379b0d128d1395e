"""The algorithm <-> engine seam: what an interface may ask of a model engine.

Interfaces (``mfc/`` and user packages) receive a :class:`~realflow.api.interface.Model`
whose ``module`` is a :class:`TrainEngine`; ``parallel/`` implements it
(:class:`parallel.engine.MegatronEngine`), and a user package may bring its own engine
class through a registered model backend (:mod:`realflow.api.backend`). Anything an
algorithm calls on an engine is declared here and nowhere else, so a reader can follow
a PPO step from the loss into the engine by going to definitions, and a user engine is
checked against one list (:func:`check_engine`) when the worker builds it, not when an
MFC first calls a missing method minutes into a run.

Besides the contract every engine meets, small capability protocols name what only
some engines can do (:class:`NonFiniteConfigurable`); the runtime asks
``isinstance(engine, Capability)`` instead of probing attribute names. Capabilities of
a model *backend* (reallocation, offload, recover points) are in
:mod:`realflow.api.backend`.

Conventions every engine follows (see :mod:`parallel.engine` for the megatron one):
token tensors are packed (sequence after sequence, ``seqlens`` gives the lengths);
per-token results come back on the data-parallel head of each replica (``None`` on the
other ranks of the replica); every method is collective over the ranks of one replica
or of the whole model, and those ranks pass the same inputs.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from realflow.api.allocation import ParallelStrategy
from realflow.api.generation import GenerationResult, SamplingParams

__all__ = [
    "TrainEngine", "TokenOutputs", "BatchGenerator", "LossFn", "MicroBatches",
    "NonFiniteConfigurable", "AdapterEngine", "has_adapters", "PadFreeEngine", "runs_pad_free", "check_engine",
    "protocol_members", "GENERATOR_SETTINGS",
]

#: keyword settings of :meth:`TrainEngine.generator` beyond the context (``ppo.<key>`` in PPO
#: experiments); a caller passes only those the user set, so engines written before one still work
GENERATOR_SETTINGS = ("gpu_memory_utilization", "max_model_len", "enforce_eager", "kv_block_size", "prefix_sharing")


class TokenOutputs(Protocol):
    """What a loss function may ask of the model's outputs for one micro-batch's real tokens.

    Rows are in packed order; everything is differentiable (except :meth:`argmax`) and, on
    a tensor-parallel model, collective over the tp group (a deterministic loss makes the
    same calls on every tp rank by construction).
    """

    @property
    def n_tokens(self) -> int:
        """Number of rows (real tokens of the micro-batch)."""
        ...

    def logprobs(self, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log p(targets[t])`` per token under the logits divided by ``temperature`` (LM only)."""
        ...

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of each token's next-token distribution at ``temperature`` (LM only)."""
        ...

    def logprobs_and_entropy(self, targets: torch.Tensor, temperature: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both of the above in one pass (LM only)."""
        ...

    def argmax(self) -> torch.Tensor:
        """The most likely next token per row, no gradient (LM only)."""
        ...

    def logits(self) -> torch.Tensor:
        """Full-vocabulary logits ``[n_tokens, vocab]`` (tp times the memory: avoid in losses; LM only)."""
        ...

    def values(self) -> torch.Tensor:
        """The value head's output ``[n_tokens]`` (critic only)."""
        ...


#: ``loss_fn(outputs of one micro-batch's real tokens, the micro-batch's extra) -> (loss SUM, stats)``
LossFn = Callable[[TokenOutputs, Any], tuple[torch.Tensor, dict[str, float]]]
#: ``(packed input_ids, seqlens, extra)`` per micro-batch; ``extra`` is what the loss function gets
MicroBatches = list[tuple[torch.Tensor, list[int], Any]]


@runtime_checkable
class BatchGenerator(Protocol):
    """A sampler over a train engine's current weights (what :meth:`TrainEngine.generator` returns).

    Its requests and results are those of the generation servers
    (:mod:`realflow.api.generation`), so an algorithm samples the same way in a model
    worker and behind a server.
    """

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]],
                 images: Optional[Sequence[Any]] = None) -> list[GenerationResult]:
        """Run every prompt to completion; results in prompt order, the ``n`` samples of a prompt by index;
        ``images``: each prompt's :class:`realflow.api.images.ImageInputs` (None: text), VL models only."""
        ...


@runtime_checkable
class TrainEngine(Protocol):
    """What an algorithm's interface may ask of the model engine it receives as ``model.module``."""

    @property
    def strategy(self) -> ParallelStrategy:
        """The layout this engine runs in (data, tensor and pipeline parallel degrees)."""
        ...

    @property
    def is_critic(self) -> bool:
        """True for a value model (``values``), False for a language model (``logprobs``, generation)."""
        ...

    def train_batch(self, micro_batches: MicroBatches, loss_fn: LossFn, loss_weight_fn: Callable[[Any], float],
                    sample_ids: Optional[list[Sequence[Any]]] = None) -> dict[str, float]:
        """One optimizer step over this replica's micro-batches, minimising sum(loss sums) / sum(weights) over dp;
        returns loss, grad_norm, lr, n_tokens, loss_weight, n_mbs, update_successful and the loss's stats summed."""
        ...

    def logprobs(self, input_ids: torch.Tensor, seqlens: list[int], max_tokens_per_mb: Optional[int] = None, *,
                 temperature: float = 1.0, with_entropy: bool = False,
                 routed_experts: Optional[torch.Tensor] = None, images: Optional[list[Any]] = None) -> Any:
        """Packed ``log p(next token)`` per position (0 at each sequence's last), or ``(logprobs, entropy)``;
        an MoE model routes each token to ``routed_experts`` (``[tokens, layers, k]``, routing replay) when given;
        a vision-language model sees ``images`` (one :class:`realflow.api.images.ImageInputs` or None per
        sequence; training micro-batches carry them as ``extra["images"]``)."""
        ...

    def values(self, input_ids: torch.Tensor, seqlens: list[int],
               max_tokens_per_mb: Optional[int] = None) -> Optional[torch.Tensor]:
        """A critic's packed per-token values (None off the output ranks)."""
        ...

    def dp_sum(self, values: list[float]) -> list[float]:
        """``values`` summed element-wise over the engine's data-parallel group (collective)."""
        ...

    def dp_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over the engine's data-parallel group (collective)."""
        ...

    def greedy_generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Optional[int] = None,
                        max_tokens_per_mb: Optional[int] = None, *,
                        images: Optional[list[Any]] = None) -> list[list[int]]:
        """Greedy continuations (new tokens only) on every rank of the replica; works in any layout."""
        ...

    def generator(self, context: int, *, version: int, tokenizer: Any = None,
                  max_running: int = 256, gpu_memory_utilization: Optional[float] = None,
                  max_model_len: Optional[int] = None, enforce_eager: Optional[bool] = None,
                  kv_block_size: Optional[int] = None, prefix_sharing: Optional[bool] = None) -> BatchGenerator:
        """The engine's own sampler over its current weights for prompt + answer up to ``context`` tokens,
        built on first use and kept; ``version`` (the model's weight version) tells it the weights moved.
        ``gpu_memory_utilization`` / ``max_model_len`` size its KV cache, ``enforce_eager``,
        ``kv_block_size`` and ``prefix_sharing`` set its engine (None: the engine's defaults; see
        :data:`GENERATOR_SETTINGS`: callers pass only what the user set)."""
        ...

    def save_hf(self, path: str, tokenizer_dir: Optional[str] = None) -> None:
        """Write one HF checkpoint of the whole model to ``path`` (collective; one rank writes)."""
        ...

    def full_hf_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The whole model under HF names on the writing rank (None elsewhere), for weight publication."""
        ...


@runtime_checkable
class NonFiniteConfigurable(Protocol):
    """An engine that can be told what a train step with a non-finite loss or gradient does."""

    def configure_nonfinite(self, mode: str, max_skips: int) -> None:
        """``stop`` (raise) or ``skip`` (apply no update, at most ``max_skips`` steps in a row)."""
        ...


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that trains low-rank adapters on a frozen base (``model.lora.enabled``)."""

    @property
    def has_adapters(self) -> bool:
        """True when this engine's model trains adapters (its base is frozen)."""
        ...

    def adapters_disabled(self) -> Any:
        """Context manager: forwards inside it run the base model (the KL reference of a LoRA run)."""
        ...

    def adapter_state(self) -> Optional[dict[str, Any]]:
        """The adapters under PEFT's names on one writer rank (None elsewhere; collective)."""
        ...


def has_adapters(engine: Any) -> bool:
    """True when ``engine`` trains LoRA adapters (and so offers :class:`AdapterEngine`)."""
    return isinstance(engine, AdapterEngine) and bool(engine.has_adapters)


@runtime_checkable
class PadFreeEngine(Protocol):
    """An engine that may run micro-batches pad-free (their sequences concatenated, no padding)."""

    @property
    def pad_free(self) -> bool:
        """True when a micro-batch costs its real tokens (not sequences x longest)."""
        ...


def runs_pad_free(engine: Any) -> bool:
    """True when ``engine``'s micro-batches run pad-free: cut them by real tokens
    (``SequenceBatch.micro_batches(spec, packed=True)``), as few as the budget allows."""
    return isinstance(engine, PadFreeEngine) and bool(engine.pad_free)


_PROTOCOL_BASES = frozenset({"Protocol", "Generic", "object"})


def protocol_members(proto: type) -> tuple[str, ...]:
    """The names a class must have to implement ``proto`` (its methods, properties and annotated fields)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls.__name__ in _PROTOCOL_BASES:
            continue
        names.update(vars(cls).get("__annotations__", {}))
        names.update(k for k in vars(cls) if not k.startswith("_"))
    return tuple(sorted(names))


def check_engine(obj: Any, where: str, proto: type = TrainEngine) -> Any:
    """Return ``obj`` if it implements ``proto``; else raise TypeError naming what is missing.

    ``where`` says who made the object (e.g. "model backend 'mine' of role 'actor'"), so a
    user's backend learns at build time which members its engine lacks, instead of an
    AttributeError at the first MFC that needs one.
    """
    missing, not_callable = [], []
    for name in protocol_members(proto):
        declared = getattr(proto, name, None)
        try:
            value = getattr(obj, name)
        except AttributeError:
            missing.append(name)
            continue
        except Exception:  # noqa: BLE001 - a property that fails to compute still exists
            continue
        if callable(declared) and not isinstance(declared, property) and not callable(value):
            not_callable.append(name)
    if missing or not_callable:
        cls = obj if isinstance(obj, type) else type(obj)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"not callable: {', '.join(not_callable)}"] if not_callable else [])
        raise TypeError(f"{where}: {cls.__module__}.{cls.__qualname__} is not a {proto.__name__} "
                        f"({'; '.join(parts)}); the contract is {proto.__module__}.{proto.__name__}")
    return obj
