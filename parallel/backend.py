"""The "megatron" model backend: what a model worker calls to build groups and engines.

Thin adapter from the runtime's :class:`realflow.api.backend.ModelBackend`
protocol to :func:`parallel.groups.build_model_groups` and
:class:`parallel.engine.MegatronEngine`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from realflow.api.allocation import ParallelStrategy
from realflow.api.backend import register_backend

from parallel.engine import MegatronEngine
from parallel.groups import ModelGroups, build_model_groups
from parallel.optim import OptimizerConfig

__all__ = ["MegatronBackend"]

_BACKEND_ARGS = ("config_overrides", "attention")


@register_backend("megatron")
class MegatronBackend:
    """Megatron-core GPT models from HF checkpoints (see :mod:`parallel.engine`)."""

    def build_groups(self, ranks: list[int], strategy: ParallelStrategy) -> ModelGroups:
        return build_model_groups(ranks, strategy)

    def build_engine(self, spec: Any, groups: ModelGroups, seed: int) -> MegatronEngine:
        unknown = sorted(set(spec.backend_args) - set(_BACKEND_ARGS))
        if unknown:
            raise ValueError(f"model {spec.role!r}: unknown megatron backend_args {unknown}; "
                             f"known: {list(_BACKEND_ARGS)}")
        opt = None
        if spec.optimizer is not None:
            fields = dataclasses.asdict(spec.optimizer)
            opt = OptimizerConfig(**fields, total_train_steps=max(int(spec.total_train_steps), 1))
        return MegatronEngine(spec.path, groups, spec.path, opt, seed,
                              config_overrides=spec.backend_args.get("config_overrides"),
                              attention=spec.backend_args.get("attention", "sdpa"))
