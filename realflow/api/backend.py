"""Model backends: how a worker builds process groups and model engines.

The runtime (``realflow/system``) must not import ``parallel/`` (dependencies point
one way), so a backend registers itself here and the worker looks it up by the name
in :class:`~realflow.api.experiment.ModelSpec`. ``parallel/`` registers "megatron".

Two methods are optional (the plan compiler calls them when present): model-aware
checks of a layout and of a reallocation pair. They exist so that a layout that
cannot work (tp not dividing the heads, pp above the layer count, a shard that
cannot fit in memory) fails when the plan is compiled, in one line that names
the MFC and the numbers, instead of minutes later deep inside megatron.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from realflow.api.allocation import ParallelStrategy
from realflow.api.experiment import ModelSpec
from realflow.api.registry import Registry


class NonFiniteError(ValueError):
    """A train step met a non-finite loss, gradient norm or parameter (``on_nonfinite``): its
    update was not applied (parameters: see parallel.nonfinite). Raised by a backend's engine;
    the model worker adds the MFC and model, the master the step and the last good checkpoint."""


class LayoutError(ValueError):
    """A model cannot run in a layout (or cannot be reallocated into another model); names the numbers."""


class ModelBackend(Protocol):
    """Factory for one family of model engines."""

    def build_groups(self, ranks: list[int], strategy: ParallelStrategy) -> Any:
        """Create the process groups of one model layout.

        Collective over the whole default process group: every worker calls it for
        every layout of the plan, in the same order, whether or not it is a member.
        """

    def build_engine(self, spec: ModelSpec, groups: Any, seed: int) -> Any:
        """Build the engine of ``spec`` on the members of ``groups`` (collective among them)."""

    # ---- optional: model-aware plan checks (looked up with getattr) -----------------------------

    def check_layout(self, spec: ModelSpec, strategy: ParallelStrategy, trained: bool,
                     n_workers_per_host: int, capacity_bytes: Optional[int] = None) -> Optional[str]:
        """Raise :class:`LayoutError` if ``spec`` cannot run as ``strategy``.

        ``trained``: the layout also holds gradients and optimizer states.
        ``n_workers_per_host``: workers sharing one host's memory (CPU) or 1 per device.
        ``capacity_bytes``: a worker's memory on a planned cluster (passed only when planning).
        Must be deterministic (every process compiles the same plan), so memory limits
        are capacities, not momentary free memory. Returns a note when something could
        not be checked (e.g. the checkpoint does not exist yet in a dry run), else None.
        """

    def check_same_architecture(self, source: ModelSpec, target: ModelSpec) -> Optional[str]:
        """Raise :class:`LayoutError` unless ``source``'s parameters can be copied into ``target``'s.

        Returns a note when it could not check (e.g. a checkpoint is not written yet), else None.
        """


model_backends: Registry = Registry("model backend")


def register_backend(name: str):
    """Class decorator: ``@register_backend("megatron") class MegatronBackend: ...``."""

    return model_backends.register(name)


@register_backend("none")
class NoModelBackend:
    """A role without a model (e.g. a rule-based reward): no process groups, no engine.

    Its MFCs still get a placement (where their inputs are staged and their code runs);
    the interface receives ``model.module is None`` and uses only the tokenizer.
    """

    def build_groups(self, ranks: list[int], strategy: ParallelStrategy) -> None:
        return None

    def build_engine(self, spec: ModelSpec, groups: Any, seed: int, *, load_weights: bool = True) -> None:
        return None

    def check_layout(self, spec: ModelSpec, strategy: ParallelStrategy, trained: bool,
                     n_workers_per_host: int, capacity_bytes: Optional[int] = None) -> Optional[str]:
        if trained:
            raise LayoutError(f"role {spec.role!r} has no model (backend 'none') and cannot be trained")
        return None
