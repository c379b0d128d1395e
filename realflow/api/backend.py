"""Model backends: how a worker builds process groups and model engines.

The runtime (``realflow/system``) must not import ``parallel/`` (dependencies point
one way), so a backend registers itself here and the worker looks it up by the name
in :class:`~realflow.api.experiment.ModelSpec`. ``parallel/`` registers "megatron".

What an engine must offer the algorithms is :class:`realflow.api.engine.TrainEngine`;
what a backend can do besides building engines is named by the capability protocols
below (:class:`Reallocatable`, :class:`Offloadable`, :class:`LocalStateful`), which the
runtime checks with ``isinstance``.

Two methods are optional (the plan compiler calls them when present): model-aware
checks of a layout and of a reallocation pair. They exist so that a layout that
cannot work (tp not dividing the heads, pp above the layer count, a shard that
cannot fit in memory) fails when the plan is compiled, in one line that names
the MFC and the numbers, instead of minutes later deep inside megatron.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from realflow.api.allocation import ParallelStrategy
from realflow.api.engine import TrainEngine
from realflow.api.experiment import ModelSpec
from realflow.api.layout import Layout
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

    def build_engine(self, spec: ModelSpec, groups: Any, seed: int, *, load_weights: bool = True) -> TrainEngine:
        """Build the engine of ``spec`` on the members of ``groups`` (collective among them).

        ``load_weights=False``: a layout whose weights arrive by reallocation (no checkpoint read).
        The worker checks the result with :func:`realflow.api.engine.check_engine`.
        """

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


# ---- capabilities of a backend (the runtime asks isinstance(backend, X)) -------------------------


@runtime_checkable
class Reallocatable(Protocol):
    """A backend that copies parameters between two layouts of a model (the plan's ParamRealloc hooks)."""

    def prepare_realloc(self, src_spec: ModelSpec, src_layout: Layout, src_groups: Any,
                        dst_spec: ModelSpec, dst_layout: Layout, dst_groups: Any) -> Any:
        """Plan and resources of one (source layout, destination layout) pair; collective over the world."""
        ...

    def reallocate(self, handle: Any, src: Optional[TrainEngine], dst: Optional[TrainEngine],
                   eta: float) -> Any:
        """``dst = eta*src + (1-eta)*dst`` over both layouts' workers (None where this worker holds no side)."""
        ...


@runtime_checkable
class Offloadable(Protocol):
    """A backend that can release an engine's parameter storage while unused and restore it bit-exactly."""

    def offload(self, engine: TrainEngine) -> None:
        """Move ``engine``'s parameters out of device memory (kept on the host)."""
        ...

    def reload(self, engine: TrainEngine) -> None:
        """Give back what :meth:`offload` took, bit-identical."""
        ...


@runtime_checkable
class LocalStateful(Protocol):
    """A backend that saves and restores this rank's exact training state of an engine (recover points)."""

    def local_state(self, engine: TrainEngine) -> dict[str, Any]:
        """This rank's parameters, optimizer shard, schedule position and weight version (CPU copies)."""
        ...

    def load_local_state(self, engine: TrainEngine, state: dict[str, Any]) -> None:
        """Restore what :meth:`local_state` returned on the same rank of the same layout."""
        ...


model_backends: Registry = Registry("model backend")

#: backend name -> ``measure(world: int, quick: bool) -> dict`` of the planner's framework costs
#: (the DeviceProfile fields a train backend's own overheads fill; ``realflow calibrate`` calls it).
#: Why a registry: the planner must not import a model package by name.
engine_cost_meters: Registry = Registry("engine cost meter")


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
