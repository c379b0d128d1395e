"""A generation server's delta base: apply a versioned update message, hand the engine what changed.

Updates that carry a manifest (``delta`` in the body of ``/update_weights_from_tensor``
or ``/update_weights_from_distributed``; see :mod:`realflow.weights.delta`) go through
:class:`ServerDelta`: it checks the base and every digest against its copy of the last
applied version, patches the changed blocks into copies of their tensors, and hands the
engine only those tensors (plus the partners they convert with). The copy moves on only
when the engine's weights do: at once for an in-place update, at ``/commit_staged_weights``
for a staged one. Any update without a manifest (disk, or a writer with delta sync off)
makes the server forget its base: the next delta to it is refused, and the controller
sends it a full update.

Lock order (no cycle): ``stage_lock`` -> the backend lock -> ``ServerDelta.lock``.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

import torch

from realflow.weights.delta import DeltaError, DeltaReceiver, Pending

__all__ = ["ServerDelta"]


class ServerDelta:
    """The delta base of one server (its backend is the server's, called under the server's locks)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.receiver = DeltaReceiver()
        self.staged: Optional[Pending] = None  # verified and staged, in force at the commit
        self.lock = threading.Lock()
        groups = getattr(server.backend, "hf_weight_groups", None)
        self.groups: Optional[list[list[str]]] = groups() if callable(groups) else None

    @property
    def version(self) -> Optional[int]:
        """The version a delta must be based on to apply here (None: only a full update will do)."""
        return self.receiver.version

    def load(self, tensors: Mapping[str, torch.Tensor], fmt: str, version: Optional[int], stage: bool,
             manifest: Any) -> int:
        """Apply ``manifest`` with the sent ``tensors``; stage the result or update in place.
        Raises :class:`DeltaError` (the weights in use are unchanged) when it does not fit here."""
        if not isinstance(manifest, dict):
            raise DeltaError(f"delta must be a manifest object (realflow.weights.delta), got {type(manifest).__name__}")
        if fmt != "hf":
            raise DeltaError(f"a delta update carries HF-named tensors, not format={fmt!r}")
        if version is not None and version != manifest.get("version"):
            raise DeltaError(f"weight_version {version} differs from the manifest's version {manifest.get('version')}")
        b = self.server.backend
        if stage:
            with self.server.stage_lock, self.lock:
                p = self.receiver.apply(manifest, tensors)
                v = b.stage_weights_from_tensors(self.receiver.with_groups(p, self.groups), "hf", p.version)
                self.staged = p
                return v
        with self.server.lock, self.lock:
            p = self.receiver.apply(manifest, tensors)
            v = b.update_weights_from_tensors(self.receiver.with_groups(p, self.groups), "hf", p.version)
            self.receiver.commit(p)
            self.staged = None
            return v

    def plain_update(self, staged: bool) -> None:
        """An update without a manifest was loaded (``staged``: only staged, not yet in force)."""
        with self.lock:
            self.staged = None
            if not staged:
                self.receiver.forget()

    def committed(self, version: int) -> None:
        """The staged weights of ``version`` are in force (called under the server's locks)."""
        with self.lock:
            p, self.staged = self.staged, None
            if p is not None and p.version == version:
                self.receiver.commit(p)
            else:
                self.receiver.forget()

    def describe(self) -> dict[str, Any]:
        """For ``/health``: the version a delta may be based on, and its digest."""
        return {"weight_delta_base": self.receiver.version, "weight_root": self.receiver.root}
