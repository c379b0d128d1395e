"""Seeding and RNG state.

``set_seed`` seeds every generator a worker uses (python ``random``, numpy, torch
CPU and CUDA). Workers must not share a seed where their randomness should differ
(sampling on different data-parallel ranks) and must share one where it should
agree (weight init across tensor-parallel ranks); ``derive_seed`` makes both
explicit and reproducible: the same (base, keys) always gives the same seed, on any
host and Python version (it hashes with SHA-256, not Python's salted ``hash``).

``get_rng_state`` / ``set_rng_state`` capture and restore all generators for
recover points, so that a resumed run continues the same random streams.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any


def derive_seed(base_seed: int, *keys: str | int) -> int:
    """A seed in [0, 2**31) determined by ``base_seed`` and ``keys``."""
    if not isinstance(base_seed, int):
        raise TypeError(f"base_seed must be an int, got {type(base_seed).__name__}")
    text = "\x1f".join([str(base_seed), *(f"{type(k).__name__}:{k}" for k in keys)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % (2**31)


def worker_seed(base_seed: int, worker_index: int, purpose: str = "worker") -> int:
    """Per-worker seed: distinct across workers, stable across runs."""
    return derive_seed(base_seed, purpose, int(worker_index))


def set_seed(seed: int, *keys: str | int) -> int:
    """Seed python, numpy and torch (and all CUDA devices when present).

    With ``keys`` (e.g. the worker index) the generators get ``derive_seed(seed, *keys)``
    instead, so that workers differ but stay reproducible. Returns the seed used.
    """
    import numpy as np
    import torch

    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if keys:
        seed = derive_seed(seed, *keys)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def get_rng_state() -> dict[str, Any]:
    """States of python, numpy, torch CPU (and CUDA) generators; save with torch.save."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned."""
    import numpy as np
    import torch

    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        raise KeyError(f"RNG state lacks {missing}; was it made by get_rng_state()?")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def get_rng_state_plain() -> dict[str, Any]:
    """``get_rng_state`` with numpy's key array as a list, so the whole state loads with
    ``torch.load(weights_only=True)`` (recover points unpickle no arbitrary objects)."""
    state = get_rng_state()
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state_plain(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state_plain`` returned."""
    import numpy as np

    name, keys, pos, has_gauss, cached = state["numpy"]
    python = state["python"]
    set_rng_state({**state, "python": (python[0], tuple(python[1]), python[2]),
                   "numpy": (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)})
