"""Plugins: the modules whose import registers what the runtime finds by name.

realflow's runtime (``realflow/system``, ``realflow/rollout``) knows experiments, graph
builders, MFC interfaces, agents, rewards, train backends and generation backends only
through registries (:mod:`realflow.api.registry`). Something must import the modules that
fill them; this is the one place that names them. Every process entry point -- the apps
(``realflow``, ``realflow-sft``, ...), the per-role process entry point
(:mod:`realflow.apps.worker`), the standalone generation server and the reward processes
of a rollout worker -- calls :func:`load_plugins`.

Three sources, imported in this order:

1. the built-in plugins below, by kind: ``train`` (every process that rebuilds an
   experiment) and ``generation`` (processes that run a generation backend);
2. setuptools entry points in the group ``realflow.plugins`` of installed packages
   (``entry_points={"realflow.plugins": ["my_pkg = my_pkg.realflow_plugin"]}``): each names
   a module that is imported (a callable there, ``module:function``, is called too);
3. the user's ``--import MODULE`` items.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import Iterable, Sequence

from realflow.api.config_values import ConfigError

__all__ = ["BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "load_plugins"]

#: the built-in plugin modules, by kind
BUILTIN_PLUGINS: dict[str, tuple[str, ...]] = {
    # the built-in experiments, with the graph builders, MFC interfaces, agents, rewards and the
    # megatron train backend they use (experiments/__init__.py imports graphs/, mfc/, parallel.backend)
    "train": ("experiments",),
    # the generation backends of a gen server: "builtin" (parallel/generation) and "sglang"
    "generation": ("parallel.generation",),
}
ENTRY_POINT_GROUP = "realflow.plugins"
_LOADED_ENTRY_POINTS: set[str] = set()  # each entry point's callable runs once per process


def _entry_points() -> list[metadata.EntryPoint]:
    try:
        return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    except Exception:  # noqa: BLE001 - broken metadata of some installed package: no entry points
        return []


def load_plugins(extra: Iterable[str] = (), *, kinds: Sequence[str] = ("train",)) -> None:
    """Import the built-in plugins of ``kinds``, the installed entry points and ``extra``
    (``--import`` modules), so that their registrations run; a failure names the module."""
    for kind in kinds:
        if kind not in BUILTIN_PLUGINS:
            raise ValueError(f"plugin kind {kind!r}: known: {', '.join(BUILTIN_PLUGINS)}")
    modules = [m for kind in kinds for m in BUILTIN_PLUGINS[kind]]
    for mod in modules:
        _import(mod, "built-in plugin")
    for ep in _entry_points():
        if ep.name in _LOADED_ENTRY_POINTS:
            continue
        _LOADED_ENTRY_POINTS.add(ep.name)
        try:
            obj = ep.load()
        except Exception as e:
            raise ConfigError(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}): cannot load it: "
                              f"{type(e).__name__}: {e}") from None
        if callable(obj):
            obj()
    for mod in extra:
        if mod not in modules:
            _import(mod, None)


def _import(mod: str, what: str | None) -> None:
    try:
        importlib.import_module(mod)
    except Exception as e:
        if what is None:  # the message of --import (realflow.config.cli.import_modules)
            raise ConfigError(f"--import {mod}: cannot import plugin module {mod!r}: {type(e).__name__}: {e}") from None
        raise ConfigError(f"{what} {mod!r}: cannot import it: {type(e).__name__}: {e}") from None
