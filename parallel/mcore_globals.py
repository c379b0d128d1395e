"""The only process-wide megatron-core state realflow sets up.

We never call ``parallel_state.initialize_model_parallel``: every megatron
object gets its groups explicitly through a ``ProcessGroupCollection``
(:mod:`parallel.groups`).  megatron-core 0.16.1 still reads a few process-wide
singletons that do not depend on any group; they are created here, once, and
are safe to share between several models in one process:

* ``parallel_state`` global memory buffer: scratch space the local
  ``DotProductAttention`` takes its ``baddbmm`` output buffer from (keyed by
  name/dtype, reused across layers and models; never held across calls).
* the CUDA-RNG tracker (``tensor_parallel.random``): one per process; seeded by
  the engine with the model's tp rank (re-seeded when another engine is built).

One megatron call is collective over the WORLD group regardless of the groups it
is given: ``get_megatron_optimizer`` -> ``_get_param_groups`` runs
``torch.distributed.all_gather_object`` on the default group to align param
groups across ranks.  For a model on a subset of the ranks that would hang, so
:func:`world_collectives_on` redirects that call to the model's own group while
the optimizer is built (see :mod:`parallel.optim`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["ensure_megatron_globals", "seed_megatron_rng", "world_collectives_on"]


def ensure_megatron_globals() -> None:
    """Create megatron's group-independent singletons if missing (idempotent)."""
    from parallel.cpu_compat import import_megatron_core

    import_megatron_core()
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def seed_megatron_rng(seed: int, tp_rank: int) -> None:
    """Seed torch and megatron's RNG tracker the way megatron-LM does at startup.

    The default generator gets ``seed`` on every rank (so replicated params and
    dropout outside tp regions agree across tp ranks of a replica); the tracker's
    model-parallel stream gets ``seed + 2718 + tp_rank`` (distinct per tp shard).
    Needed before any training-mode forward (attention dropout forks the tracker).
    """
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from parallel.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=tp_rank,
                                    force_reset_rng=True)


@contextlib.contextmanager
def world_collectives_on(group: Any) -> Iterator[None]:
    """While active, ``all_gather_object`` on the default group runs on ``group``.

    The caller's list has world-size slots; the first ``group.size()`` get the
    group's objects (in group-rank order) and the rest repeat this rank's own
    object, which keeps "union over all entries" consumers (megatron's param-group
    alignment) correct.  Process-wide while active: use around construction only.
    """
    import torch.distributed as dist

    original = dist.all_gather_object

    def gather(object_list: list, obj: Any, group_: Any = None, **kw: Any) -> None:
        if "group" in kw:
            group_ = kw.pop("group")
        if group_ is not None:
            return original(object_list, obj, group=group_, **kw)
        part: list = [None] * dist.get_world_size(group)
        original(part, obj, group=group, **kw)
        object_list[:] = part + [obj] * (len(object_list) - len(part))
        return None

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = original
