"""Parameter reallocation between layouts, EMA blending, offload.

Typical use on every rank of the world::

    hosts = gather_hosts()                                        # once, collective over the world
    plan = plan_reallocation(hf_config, src=Layout(ranks_a, strat_a),
                             dst=Layout(ranks_b, strat_b), dtype=torch.float32, hosts=hosts)
    res = prepare_reallocation(plan)                              # collective over the world, same order
    reallocate(plan, res, actor_stage_or_None, gen_stage_or_None, eta=1.0)   # collective over S u T
    offload(ref_model); ...; reload(ref_model)

Layouts are :class:`realflow.api.layout.Layout`; modules are megatron GPTModel stages or dicts
of local name -> tensor.
"""
from parallel.realloc.executor import Module, ReallocResources, prepare_reallocation, reallocate
from parallel.realloc.offload import OffloadState, is_offloaded, offload, reload
from parallel.realloc.plan import Copy, ReallocError, ReallocPlan, plan_reallocation
from parallel.realloc.spec import (LocalShard, Piece, ShardSpecError, allocate_shards,
                                   reference_shard, shard_spec)
from parallel.realloc.sync import SyncTimeout, gather_hosts, store_barrier

__all__ = ["LocalShard", "Piece", "ShardSpecError", "shard_spec", "reference_shard",
           "allocate_shards", "Copy", "ReallocPlan", "ReallocError", "plan_reallocation",
           "ReallocResources", "prepare_reallocation", "reallocate", "Module", "SyncTimeout",
           "store_barrier", "gather_hosts", "OffloadState", "offload", "reload", "is_offloaded"]
