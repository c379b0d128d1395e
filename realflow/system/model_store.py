"""The models of one worker, one engine per (role, layout), and the hooks that move their weights.

A role lives at *home* (its train layout: parameters + optimizer) and may run some MFCs
in other layouts (e.g. the actor generates at d2 but trains at t2). This worker holds an
engine for every (role, layout) it belongs to; engines outside home are built without
optimizer and without reading the checkpoint: their weights arrive by reallocation
before each MFC that uses them (the plan's ``ParamRealloc`` hooks).

Hooks are executed here, through the role's model backend (the runtime never imports
``parallel/``). Every hook that moves parameters is a collective over the workers of
both layouts; the master sends the hook request to exactly those workers, in one global
order, so the collectives line up without any extra coordination.

"Back home" reallocations: the home copy stays resident while an MFC runs in another
layout (it holds the optimizer's master weights anyway), so moving the weights back
would rewrite identical values. The hook therefore *releases* the MFC-layout copy
(frees its parameter storage) instead of copying; the next "to MFC layout" hook
refills it. A backend that is not :class:`~realflow.api.backend.Offloadable` keeps the copy.

What the runtime may do with a backend or an engine beyond building it is asked with
``isinstance`` against the capability protocols of :mod:`realflow.api.backend` and
:mod:`realflow.api.engine`; every engine a backend builds is checked against
:class:`~realflow.api.engine.TrainEngine` right away, so a user's backend learns which
members its engine lacks when the worker starts.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from realflow.api.backend import LocalStateful, ModelBackend, Offloadable, Reallocatable, model_backends
from realflow.api.engine import NonFiniteConfigurable, check_engine
from realflow.api.experiment import ExperimentSetup
from realflow.api.interface import Model
from realflow.api.layout import Layout
from realflow.base.logging import get_logger
from realflow.system.plan import ExecutionPlan
from realflow.system.plan_types import Hook, Offload, ParamRealloc, Reload

logger = get_logger("model_store")


class HookError(RuntimeError):
    """A hook cannot run (backend lacks the capability, or the model is not here)."""


class ModelStore:
    """Engines of this worker keyed by (role, layout), plus reallocation handles per layout pair."""

    def __init__(self, setup: ExperimentSetup, plan: ExecutionPlan, index: int) -> None:
        self.setup, self.plan, self.index = setup, plan, index
        self.models: dict[tuple[str, Layout], Model] = {}
        self._groups: dict[tuple[str, Layout], Any] = {}
        self._realloc: dict[tuple[str, Layout, str, Layout], Any] = {}
        self._offloaded: set[tuple[str, Layout]] = set()
        self._backends: dict[str, ModelBackend] = {}

    def backend(self, role: str) -> ModelBackend:
        """The role's model backend (one instance per backend name: it may cache per-process state)."""
        name = self.setup.models[role].backend
        if name not in self._backends:
            self._backends[name] = model_backends.get(name)()
        return self._backends[name]

    # ---- setup (collective over every worker, same order everywhere) --------------------------
    def build(self, total_train_steps: int, load_tokenizer) -> None:
        for role, layout in self.plan.group_order:
            self._groups[(role, layout)] = self.backend(role).build_groups(list(layout.workers), layout.strategy)
        # Home engines first: every other layout of a role is filled from home.
        keys = sorted(self._groups, key=lambda k: (k[1] != self.plan.role_home[k[0]], k[0]))
        for role, layout in keys:
            if self.index not in layout.workers:
                continue
            home = layout == self.plan.role_home[role]
            spec = self.setup.models[role]
            spec = dataclasses.replace(spec, precision=self.setup.model_precision(spec))
            if not home:
                spec = dataclasses.replace(spec, optimizer=None)
            elif spec.optimizer is not None:
                spec = dataclasses.replace(spec, total_train_steps=int(total_train_steps))
            backend = self.backend(role)
            if home:
                engine = backend.build_engine(spec, self._groups[(role, layout)], self.setup.seed)
            else:
                engine = backend.build_engine(spec, self._groups[(role, layout)], self.setup.seed,
                                              load_weights=False)
            if engine is not None:
                check_engine(engine, f"model backend '{spec.backend}' of role '{role}' (build_engine)")
            if home and spec.optimizer is not None and isinstance(engine, NonFiniteConfigurable):
                engine.configure_nonfinite(self.setup.on_nonfinite, self.setup.max_nonfinite_skips)
            tok = load_tokenizer(spec.tokenizer_path or spec.path)
            self.models[(role, layout)] = Model(name=role, module=engine, tokenizer=tok)
        used = {(h.src_role, h.src, h.dst_role, h.dst) for _, _, h in self.plan.hooks()
                if isinstance(h, ParamRealloc) and h.reason != "back home"}  # back home = release (see above)
        for pair in self.plan.realloc_pairs:
            if (pair.src_role, pair.src, pair.dst_role, pair.dst) not in used:
                continue
            backend = self.backend(pair.dst_role)
            if not isinstance(backend, Reallocatable):
                raise HookError(f"model backend '{self.setup.models[pair.dst_role].backend}' of role "
                                f"'{pair.dst_role}' cannot reallocate parameters (needed for {pair})")
            self._realloc[(pair.src_role, pair.src, pair.dst_role, pair.dst)] = backend.prepare_realloc(
                self.setup.models[pair.src_role], pair.src, self._groups[(pair.src_role, pair.src)],
                self.setup.models[pair.dst_role], pair.dst, self._groups[(pair.dst_role, pair.dst)])

    # ---- lookup -------------------------------------------------------------------------------
    def model(self, role: str, layout: Layout) -> Model:
        try:
            return self.models[(role, layout)]
        except KeyError:
            raise HookError(f"worker {self.index} holds no engine of role '{role}' in layout "
                            f"{layout.short()}") from None

    def home_model(self, role: str) -> Model | None:
        return self.models.get((role, self.plan.role_home[role]))

    def roles_here(self) -> list[str]:
        return sorted({r for r, _ in self.models if self.home_model(r) is not None})

    # ---- hooks --------------------------------------------------------------------------------
    @staticmethod
    def participants(hook: Hook) -> tuple[int, ...]:
        """Workers that must run ``hook`` (all ranks of a collective)."""
        if isinstance(hook, ParamRealloc):
            if hook.reason == "back home":  # a release: local to the MFC layout's workers
                return hook.src.workers
            return tuple(sorted(set(hook.src.workers) | set(hook.dst.workers)))
        return hook.layout.workers

    def run_hook(self, hook: Hook, src_version: int = 0) -> dict[str, Any]:
        """Run one hook; ``src_version`` (from the master) is the source role's weight version."""
        t0 = time.perf_counter()
        if isinstance(hook, ParamRealloc):
            if hook.reason == "back home":
                self._release(hook.src_role, hook.src)
            else:
                self._reallocate(hook, src_version)
        elif isinstance(hook, Offload):
            self._offload(hook.role, hook.layout)
        elif isinstance(hook, Reload):
            self._reload(hook.role, hook.layout)
        else:
            raise HookError(f"unknown hook {hook!r}")
        return {"seconds": time.perf_counter() - t0}

    def _reallocate(self, h: ParamRealloc, src_version: int) -> None:
        handle = self._realloc.get((h.src_role, h.src, h.dst_role, h.dst))
        if handle is None:
            raise HookError(f"no reallocation prepared for {h}")
        src = self.models.get((h.src_role, h.src))
        dst = self.models.get((h.dst_role, h.dst))
        for role, layout, m in ((h.src_role, h.src, src), (h.dst_role, h.dst, dst)):
            if m is not None and (role, layout) in self._offloaded:
                self._reload(role, layout)
        backend = self.backend(h.dst_role)
        if not isinstance(backend, Reallocatable):  # build() prepared the handle: cannot happen
            raise HookError(f"model backend of role '{h.dst_role}' cannot reallocate parameters ({h})")
        backend.reallocate(handle, src.module if src else None, dst.module if dst else None, h.eta)
        if dst is not None and h.src_role == h.dst_role:
            dst.version = src_version

    def _release(self, role: str, layout: Layout) -> None:
        if self.index in layout.workers and isinstance(self.backend(role), Offloadable):
            self._offload(role, layout)

    def _offload(self, role: str, layout: Layout) -> None:
        m = self.models.get((role, layout))
        if m is None or m.module is None or (role, layout) in self._offloaded:
            return  # not here, no model (rule-based role), or already offloaded
        backend = self.backend(role)
        if not isinstance(backend, Offloadable):
            return  # the backend keeps its models resident
        backend.offload(m.module)
        self._offloaded.add((role, layout))

    def _reload(self, role: str, layout: Layout) -> None:
        m = self.models.get((role, layout))
        if m is None or (role, layout) not in self._offloaded:
            return
        backend = self.backend(role)
        if not isinstance(backend, Offloadable):  # only an Offloadable backend's engines are offloaded
            raise HookError(f"model backend of role '{role}' cannot reload parameters")
        backend.reload(m.module)
        self._offloaded.discard((role, layout))

    def ensure_resident(self, role: str, layout: Layout) -> None:
        """Reload before use if a hook left the engine offloaded (e.g. eval after a release)."""
        if (role, layout) in self._offloaded:
            self._reload(role, layout)

    # ---- recover points -----------------------------------------------------------------------
    def local_state(self) -> dict[str, Any]:
        """This worker's part of every model: full training state at home, the version elsewhere
        (other layouts are refilled from home by the next reallocation)."""
        out: dict[str, Any] = {}
        for (role, layout), m in sorted(self.models.items(), key=lambda kv: (kv[0][0], kv[0][1].short())):
            entry: dict[str, Any] = {"version": int(m.version)}
            if m.module is not None and layout == self.plan.role_home[role]:
                backend = self.backend(role)
                if not isinstance(backend, LocalStateful):
                    raise HookError(f"model backend '{self.setup.models[role].backend}' of role '{role}' cannot "
                                    "write recover points; set recover_mode=off")
                self.ensure_resident(role, layout)
                entry["engine"] = backend.local_state(m.module)
            out[f"{role}@{layout.short()}"] = entry
        return out

    def load_local_state(self, state: dict[str, Any]) -> None:
        here = {f"{role}@{layout.short()}": (role, layout, m) for (role, layout), m in self.models.items()}
        if set(here) != set(state):
            raise HookError(f"worker {self.index}: the recover point holds models {sorted(state)}, "
                            f"this run builds {sorted(here)}")
        for key, entry in state.items():
            role, layout, m = here[key]
            if "engine" in entry:
                self.ensure_resident(role, layout)
                backend = self.backend(role)
                if not isinstance(backend, LocalStateful):
                    raise HookError(f"model backend '{self.setup.models[role].backend}' of role '{role}' cannot "
                                    "restore recover points")
                backend.load_local_state(m.module, entry["engine"])
            m.version = int(entry["version"])

