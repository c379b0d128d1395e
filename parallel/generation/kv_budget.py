"""How many KV-cache slots fit: the generation engine allocates its cache once, up front.

Why: slots x context x layers x kv-heads is easily more than a GPU holds (a 7B Qwen2.5 at its
32k context: ~1.9 GB per slot; 64 slots ~120 GB), and an allocation that fails takes the
process down with a CUDA out-of-memory error that names nothing the user can change. So the
engine asks here first: the requested slots if they fit in a fraction of the device's free
memory, fewer if not (logged: generation still runs, with fewer sequences at a time), and a
clear error naming ``max_running_requests``, ``max_model_len`` and the numbers when not even one
slot fits.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from parallel.generation.blocks import blocks_for
from parallel.generation.paged_cache import block_bytes

__all__ = ["free_bytes", "slot_bytes", "fit_slots", "kv_layout"]

logger = logging.getLogger("realflow.generation")


def free_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` now: the GPU's (CUDA's own count), the host's MemAvailable on a CPU
    (None where the OS does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def slot_bytes(num_layers: int, kv_groups: int, head_dim: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of one slot's keys and values over every layer (this tp rank's kv heads)."""
    return 2 * num_layers * kv_groups * head_dim * max_len * torch.empty((), dtype=dtype).element_size()


def fit_slots(requested: int, per_slot: int, free: Optional[int], fraction: float, where: str,
              reserve: int = 0) -> int:
    """``requested`` if ``requested * per_slot + reserve`` fits in ``fraction`` of ``free`` bytes,
    else the most that fit (at least 1, else ValueError). ``fraction`` 0 or an unknown ``free``:
    no limit."""
    if fraction <= 0 or free is None:
        return requested
    budget = int(free * fraction) - reserve
    fits = budget // max(per_slot, 1)
    if fits >= requested:
        return requested
    gib = 2 ** 30
    if fits < 1:
        raise ValueError(f"generation KV cache: one slot needs {per_slot / gib:.2f} GiB but {where} has "
                         f"{budget / gib:.2f} GiB for it ({fraction:g} of {free / gib:.2f} GiB free); lower "
                         f"max_model_len (prompt + new tokens), raise gpu_memory_utilization or use tensor "
                         f"parallelism for generation")
    logger.warning("generation KV cache: %d slots (max_running_requests) need %.2f GiB, %s has %.2f GiB for it "
                   "(%g of %.2f GiB free): running %d sequences at a time instead", requested,
                   requested * per_slot / gib, where, budget / gib, fraction, free / gib, fits)
    return int(fits)


def kv_layout(spec, slots: int, max_len: int, block_size: int, dtype: torch.dtype, device: torch.device,
              fraction: float, contiguous: bool, kv_blocks: Optional[int] = None) -> tuple[int, int]:
    """``(rows, blocks)``: how many sequences decode together and how many KV blocks the pool has.

    Paged decode: ``slots`` rows, and as many blocks as ``fraction`` of the free memory holds (at
    most enough for every row at ``max_len``; sequences are shorter on average, so fewer blocks
    serve all rows and a full pool preempts the newest sequence). Contiguous decode (CPU) keeps a
    ``max_len`` copy per row beside the pool: rows are fitted as before paging, each with a full
    sequence's blocks. ``kv_blocks`` fixes the pool's size (tests, tuning). Either way at least
    one ``max_len`` sequence must fit, else the error names what to change.
    """
    full = blocks_for(max_len, block_size)
    per_block = block_bytes(spec, block_size, dtype)
    scratch = per_block // block_size  # the pool's scratch row (padding writes)
    where = f"device {device}"
    if contiguous:
        per_row = slot_bytes(spec.num_layers, spec.local_groups, spec.head_dim, max_len, dtype) + full * per_block
        rows = fit_slots(slots, per_row, free_bytes(device), fraction, where, scratch)
        return rows, (kv_blocks if kv_blocks is not None else rows * full)
    if kv_blocks is not None:
        blocks = kv_blocks
    else:
        free = free_bytes(device)
        blocks = slots * full if fraction <= 0 or free is None else \
            min(slots * full, (int(free * fraction) - scratch) // per_block)
        if blocks < full:
            gib = 2 ** 30
            raise ValueError(f"generation KV cache: one sequence of max_model_len={max_len} needs {full} blocks "
                             f"({full * per_block / gib:.2f} GiB) but {where} has {int((free or 0) * fraction) / gib:.2f}"
                             f" GiB for it ({fraction:g} of {(free or 0) / gib:.2f} GiB free); lower max_model_len "
                             f"(prompt + new tokens), raise gpu_memory_utilization or use tensor parallelism")
    if blocks < full:
        raise ValueError(f"kv_blocks={blocks}: one sequence of max_model_len={max_len} needs {full} blocks of "
                         f"{block_size} tokens")
    return slots, blocks
