"""Model backends: how a worker builds process groups and model engines.

The runtime (``realflow/system``) must not import ``parallel/`` (dependencies point
one way), so a backend registers itself here and the worker looks it up by the name
in :class:`~realflow.api.experiment.ModelSpec`. ``parallel/`` registers "megatron".
"""
from __future__ import annotations

from typing import Any, Protocol

from realflow.api.allocation import ParallelStrategy
from realflow.api.experiment import ModelSpec
from realflow.api.registry import Registry


class ModelBackend(Protocol):
    """Factory for one family of model engines."""

    def build_groups(self, ranks: list[int], strategy: ParallelStrategy) -> Any:
        """Create the process groups of one model layout.

        Collective over the whole default process group: every worker calls it for
        every layout of the plan, in the same order, whether or not it is a member.
        """

    def build_engine(self, spec: ModelSpec, groups: Any, seed: int) -> Any:
        """Build the engine of ``spec`` on the members of ``groups`` (collective among them)."""


model_backends: Registry = Registry("model backend")


def register_backend(name: str):
    """Class decorator: ``@register_backend("megatron") class MegatronBackend: ...``."""

    return model_backends.register(name)
