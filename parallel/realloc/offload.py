"""Release a model's parameter storage while it is not used; restore it bit-exactly.

Why storages, not ``param.data = ...``: the parameters keep their identity, shape
and dtype (optimizers, hooks and megatron's buffers keep pointing at them) and a
storage shared by several parameters (tied embeddings, megatron DDP's contiguous
param buffer) is saved once and released as a whole.  Offload copies every
distinct storage of the module's parameters into ONE compact host buffer (pinned
when the parameters are on a GPU, so the copies can run at full PCIe speed),
then ``resize_(0)``s the storages: their memory is returned to the allocator.
Reload resizes them back and copies the bytes in, so values are bit-identical.

On a CPU-only host the host buffer is the same memory kind as the parameters, so
offloading saves nothing per se -- but the path is the one a GPU host runs, and
the compact buffer can be handed to anything that wants the bytes (one
contiguous tensor).  Gradients and optimizer state are not touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch

__all__ = ["OffloadState", "offload", "reload", "is_offloaded"]

_ATTR = "_realflow_offload"
Module = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


@dataclass
class OffloadState:
    """Where an offloaded module's bytes are: (storage, offset in buffer, nbytes) per storage."""

    buffer: torch.Tensor  # uint8, host (pinned on GPU hosts)
    storages: list[tuple[Any, int, int, torch.device]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


def _params(module: Module) -> list[tuple[str, torch.Tensor]]:
    if isinstance(module, torch.nn.Module):
        return list(module.named_parameters())
    if isinstance(module, Mapping):
        return list(module.items())
    raise TypeError(f"offload: expected an nn.Module or a dict of tensors, got {type(module).__name__}")


def is_offloaded(module: Module) -> bool:
    """True when the module's parameters currently have no storage (offload() without reload())."""
    return isinstance(module, torch.nn.Module) and getattr(module, _ATTR, None) is not None


def offload(module: Module) -> OffloadState:
    """Copy the parameters' storages to one host buffer and release them.

    For an ``nn.Module`` the state is also kept on the module (``reload(module)``
    finds it); for a dict pass the returned state to :func:`reload`.
    """
    if is_offloaded(module):
        raise RuntimeError("offload: module is already offloaded")
    seen: dict[int, tuple[Any, torch.device]] = {}
    for name, p in _params(module):
        st = p.untyped_storage()
        if st.nbytes() == 0 and p.numel() > 0:
            raise RuntimeError(f"offload: parameter {name} has no storage (already offloaded?)")
        seen.setdefault(st.data_ptr(), (st, p.device))
    total = sum(st.nbytes() for st, _ in seen.values())
    on_gpu = any(dev.type == "cuda" for _, dev in seen.values())
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu)
    state = OffloadState(buffer)
    off = 0
    with torch.no_grad():
        for st, dev in seen.values():
            n = st.nbytes()
            buffer[off:off + n].copy_(_bytes_of(st, dev), non_blocking=on_gpu)
            state.storages.append((st, off, n, dev))
            off += n
        if on_gpu:
            torch.cuda.synchronize()
        for st, _, _, _ in state.storages:
            st.resize_(0)
    if isinstance(module, torch.nn.Module):
        module.__dict__[_ATTR] = state
    return state


def reload(module: Module, state: Optional[OffloadState] = None) -> None:
    """Give the parameters their storage back, bit-identical to before :func:`offload`."""
    if state is None:
        state = getattr(module, _ATTR, None) if isinstance(module, torch.nn.Module) else None
        if state is None:
            raise RuntimeError("reload: module is not offloaded (or pass the OffloadState for a dict)")
    with torch.no_grad():
        for st, off, n, dev in state.storages:
            st.resize_(n)
            _bytes_of(st, dev).copy_(state.buffer[off:off + n], non_blocking=dev.type == "cuda")
        if any(dev.type == "cuda" for _, _, _, dev in state.storages):
            torch.cuda.synchronize()
    if isinstance(module, torch.nn.Module):
        module.__dict__.pop(_ATTR, None)
    state.buffer = torch.empty(0, dtype=torch.uint8)
    state.storages = []


def _bytes_of(storage: Any, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),))
