"""Registries of the diagnostic tools (``realflow doctor WHAT``).

Why a registry: a doctor replays a run on real engines (``parallel/``), but the command lives in
``realflow/apps``, which reaches model code only through what plugins register; the built-in
``mismatch`` doctor registers itself here when the ``train`` plugins are imported.

A doctor is ``fn(run_dir, step, samples) -> report`` (a JSON-able dict; see
``experiments/mismatch_doctor.py`` for the keys of ``mismatch``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from realflow.api.registry import Registry

__all__ = ["Doctor", "doctors"]

Doctor = Callable[[str, Optional[int], Optional[int]], dict[str, Any]]
doctors: Registry[Doctor] = Registry("doctor")
