"""Per-model process groups from an explicit list of global ranks.

A worker may hold several models in different layouts (actor d2t1p1 next to a
reference model d1t2p1 on overlapping workers), so we never use megatron's
process-wide ``parallel_state`` groups.  Each model gets its own
:class:`megatron.core.process_groups_config.ProcessGroupCollection`, passed
explicitly to GPTModel, DDP, the optimizer and the schedules.

Rank grid (megatron's default order ``tp-cp-ep-dp-pp``, cp = 1): tensor
parallel is fastest, then data parallel, then pipeline parallel::

    ranks[pp_rank * dp * tp + dp_rank * tp + tp_rank]

(:class:`realflow.api.layout.Layout`, shared with the plan and reallocation), so a
tensor-parallel group is a run of adjacent entries of ``ranks`` (adjacent GPUs of one
node when the caller lists ranks node by node).

Group creation is collective over the DEFAULT group: every rank of the default
group must call :func:`build_model_groups` for every model, in the same order,
with the same arguments (``torch.distributed.new_group`` semantics); ranks that
are not in ``ranks`` get ``ModelGroups(is_member=False)``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from realflow.api.allocation import ParallelStrategy
from realflow.api.layout import Layout

__all__ = ["ModelGroups", "ParallelStrategy", "build_model_groups", "agree_or_raise"]


@dataclass
class ModelGroups:
    """Process groups and coordinates of THIS rank for one model.

    ``pg_collection`` is what megatron-core consumes; the named groups below are
    shortcuts into it.  All fields except ``is_member``/``ranks``/``strategy``
    are None on non-members.
    """

    is_member: bool
    ranks: list[int]
    strategy: ParallelStrategy
    global_rank: int = -1
    dp_rank: int = -1
    tp_rank: int = -1
    pp_rank: int = -1
    pg_collection: Any = None  # megatron.core.process_groups_config.ProcessGroupCollection
    model_group: Optional[dist.ProcessGroup] = None  # all ranks of the model
    grid: list[list[list[int]]] = field(default_factory=list)  # [pp][dp][tp] -> global rank
    ep_rank: int = -1  # expert-parallel rank (0 without expert parallelism)

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.pg_collection.ep

    @property
    def expt_dp_group(self) -> dist.ProcessGroup:
        return self.pg_collection.expt_dp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.pg_collection.dp

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.pg_collection.tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pg_collection.pp

    @property
    def dp_size(self) -> int:
        return self.strategy.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.strategy.pp - 1

    @property
    def is_dp_head(self) -> bool:
        """True on the (dp=0, tp=0) rank of each pipeline stage."""
        return self.dp_rank == 0 and self.tp_rank == 0

    def rank_at(self, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        """Global rank at grid coordinates."""
        return self.grid[pp][dp][tp]


def _check(ranks: list[int], strategy: ParallelStrategy, world: int) -> None:
    for name in ("dp", "tp", "pp"):
        value = getattr(strategy, name, None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"build_model_groups: strategy.{name}={value!r} must be an int >= 1")
    need = strategy.dp * strategy.tp * strategy.pp
    if len(ranks) != need:
        raise ValueError(
            f"build_model_groups: strategy dp={strategy.dp} tp={strategy.tp} pp={strategy.pp} "
            f"needs {need} ranks, got {len(ranks)}: {ranks}"
        )
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"build_model_groups: duplicate ranks in {ranks}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"build_model_groups: ranks {bad} outside the default group (size {world})")


# torch < 2.13 has no sort_ranks: it orders every group's ranks, which is right only for
# member lists that are sorted already (the pinned torch is 2.13; GPU images may carry older)
_KEEPS_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters


def _new_group(members: list[int], timeout: Optional[timedelta], desc: str) -> dist.ProcessGroup:
    """``dist.new_group`` keeping ``members`` in the given order (group rank i = members[i])."""
    if _KEEPS_ORDER:
        return dist.new_group(members, timeout=timeout, sort_ranks=False, group_desc=desc)
    if list(members) != sorted(members):
        raise RuntimeError(f"process group {members} ({desc}) must keep its rank order, which needs "
                           f"torch >= 2.13 (new_group(sort_ranks=False)); this torch is {torch.__version__}")
    return dist.new_group(members, timeout=timeout, group_desc=desc)


def build_model_groups(
    ranks: list[int], strategy: ParallelStrategy, timeout: Optional[timedelta] = None
) -> ModelGroups:
    """Create the process groups of one model laid out as ``strategy`` on ``ranks``.

    Collective over the default group (see module docstring).  Group member order
    follows the grid, not sorted rank order, so ``group.rank()`` is the grid
    coordinate megatron expects (``sort_ranks=False``).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_model_groups: torch.distributed is not initialized")
    ranks = [int(r) for r in ranks]
    _check(ranks, strategy, dist.get_world_size())
    dp, tp, pp = strategy.dp, strategy.tp, strategy.pp
    grid = Layout(tuple(ranks), strategy).grid()
    me = dist.get_rank()

    created: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {}

    def make(kind: str, members_list: list[list[int]]) -> Optional[dist.ProcessGroup]:
        """new_group for each member list (all ranks call); return the one holding me."""
        mine: Optional[dist.ProcessGroup] = None
        for members in members_list:
            key = tuple(members)
            if key not in created:  # same ranks, same order -> share the group
                created[key] = _new_group(members, timeout, f"realflow_{kind}")
            if me in members:
                mine = created[key]
        return mine

    tp_lists = [grid[p][d] for p in range(pp) for d in range(dp)]
    dp_lists = [[grid[p][d][t] for d in range(dp)] for p in range(pp) for t in range(tp)]
    pp_lists = [[grid[p][d][t] for p in range(pp)] for d in range(dp) for t in range(tp)]
    mp_lists = [[grid[p][d][t] for p in range(pp) for t in range(tp)] for d in range(dp)]
    tp_dp_lists = [[grid[p][d][t] for d in range(dp) for t in range(tp)] for p in range(pp)]
    solo_lists = [[r] for r in ranks]
    # Tied word embeddings live on the first and last stage of each pipeline.
    embd_lists = [sorted({pl[0], pl[-1]}, key=pl.index) for pl in pp_lists]
    # Expert parallelism (see ParallelStrategy): runs of ep consecutive ranks of a stage's
    # (dp, tp) order hold the experts between them; every ep-th rank holds the same experts.
    ep = strategy.ep
    stages = [[grid[p][d][t] for d in range(dp) for t in range(tp)] for p in range(pp)]
    ep_lists = [st[k:k + ep] for st in stages for k in range(0, dp * tp, ep)]
    expt_dp_lists = [st[r::ep] for st in stages for r in range(ep)]
    tp_ep_pp_lists = [[r for st in stages for r in st[k:k + ep]] for k in range(0, dp * tp, ep)]

    # Fixed creation order: every rank makes the same new_group calls.
    g_tp = make("tp", tp_lists)
    g_dp = make("dp", dp_lists)
    g_pp = make("pp", pp_lists)
    g_mp = make("mp", mp_lists)
    g_tp_dp = make("tp_dp", tp_dp_lists)
    g_embd = make("embd", embd_lists)
    g_solo = make("solo", solo_lists)
    g_all = make("model", [list(ranks)])
    if ep > 1:
        g_ep = make("ep", ep_lists)
        g_expt_dp = make("expt_dp", expt_dp_lists)
        g_tp_ep_pp = make("tp_ep_pp", tp_ep_pp_lists)

    if me not in ranks:
        return ModelGroups(is_member=False, ranks=ranks, strategy=strategy, grid=grid)

    idx = ranks.index(me)
    pp_rank, rest = divmod(idx, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)

    from parallel.cpu_compat import import_megatron_core

    import_megatron_core()  # a worker's first megatron import: the fast one on CPU
    from megatron.core.process_groups_config import ProcessGroupCollection

    # Field meanings follow megatron's parallel_state with cp = 1 and a single
    # distributed-optimizer instance; with ep > 1 experts are whole (expert tp = 1).
    if ep > 1:
        experts = dict(ep=g_ep, expt_tp=g_solo, tp_ep=g_ep, tp_ep_pp=g_tp_ep_pp, expt_dp=g_expt_dp,
                       intra_expt_dp=g_expt_dp)
    else:
        experts = dict(ep=g_solo, expt_tp=g_tp, tp_ep=g_tp, tp_ep_pp=g_mp, expt_dp=g_dp, intra_expt_dp=g_dp)
    pgc = ProcessGroupCollection(
        tp=g_tp, pp=g_pp, mp=g_mp, cp=g_solo, tp_cp=g_tp, dp=g_dp, dp_cp=g_dp,
        intra_dp_cp=g_dp, tp_dp_cp=g_tp_dp, **experts,
        embd=g_embd,  # None on middle stages, as in megatron
        pos_embd=g_solo if pp_rank == 0 else None,
        intra_dist_opt=g_all,  # grad-norm reduction over every shard of the model
        inter_dist_opt=None,
    )
    return ModelGroups(
        is_member=True, ranks=ranks, strategy=strategy, global_rank=me,
        dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, pg_collection=pgc,
        model_group=g_all, grid=grid, ep_rank=(dp_rank * tp + tp_rank) % ep,
    )


def agree_or_raise(groups: "ModelGroups", problem: str, what: str, error: type = ValueError) -> None:
    """Every rank of the model learns whether any rank found ``problem`` before anything is
    changed: this rank raises its own message, the others one naming ``what`` (so a bad file
    fails on every rank instead of leaving some waiting in a later collective)."""
    bad = torch.tensor([float(bool(problem))])
    if len(groups.ranks) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=groups.model_group)
    if problem:
        raise error(problem)
    if bad.item():
        raise error(f"{what} failed validation on another rank of the model (ranks {groups.ranks}); "
                    f"nothing was loaded")
