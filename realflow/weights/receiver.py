"""A generation server's side of weight broadcasts: join the writer's group, receive a version.

The HTTP routes (SGLang's ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``) are in
:mod:`realflow.rollout.gen_server_weight_group`; they parse with :func:`parse_init` and
:meth:`TensorMeta.from_body <realflow.weights.broadcast.TensorMeta.from_body>`, and hold
the server's one group in a :class:`GroupSlot`. Loading the received tensors -- or
staging them beside the live weights, swapped in by ``/commit_staged_weights`` -- is the
server's (``GenServer.load_weights``, the backend's ``stage_weights_from_tensors``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from realflow.weights.broadcast import GroupSpec, TensorMeta, WeightGroup

__all__ = ["GroupSlot", "parse_init"]


class GroupSlot:
    """The one weight group a server is in (a new join replaces it).

    ``on_change(name or None)`` is told the group's name whenever it changes (the server
    reports it in ``/health``).
    """

    def __init__(self, on_change: Callable[[Optional[str]], None]) -> None:
        self.on_change = on_change
        self.group: Optional[WeightGroup] = None
        self.lock = threading.Lock()  # one join or one receive at a time

    def replace(self, new: Optional[WeightGroup]) -> None:
        old, self.group = self.group, new
        self.on_change(None if new is None else new.spec.name)
        if old is not None:
            old.close()

    def join(self, spec: GroupSpec, rank: int, bind: str) -> None:
        """Leave the group this server was in, then join ``spec`` as ``rank`` (blocks until every
        member joined; raises ``WeightBroadcastError``)."""
        with self.lock:
            self.replace(None)
            self.replace(WeightGroup(spec, rank, bind))

    def check(self, name: Any) -> WeightGroup:
        """The group named ``name``; ``ValueError`` says which group this server is in instead."""
        group = self.group
        if group is None or name != group.spec.name:
            raise ValueError(f"group_name {name!r}: this server is in "
                             f"{'no weight group' if group is None else repr(group.spec.name)} "
                             f"(POST /init_weights_update_group first)")
        return group

    def receive(self, group: WeightGroup, meta: TensorMeta) -> dict[str, torch.Tensor]:
        """The tensors ``meta`` announces, from the writer's broadcast (raises ``WeightBroadcastError``:
        the caller drops the group, which a failed collective leaves unusable)."""
        with self.lock:
            return group.receive(meta)


def parse_init(body: dict[str, Any]) -> tuple[GroupSpec, int]:
    """``/init_weights_update_group``'s body -> (the group, this server's rank); ``ValueError`` names
    what is wrong."""
    def need(key: str, kind: type) -> Any:
        v = body.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ValueError(f"init_weights_update_group: {key} ({kind.__name__}) is required, got {v!r}")
        return v

    address, port = need("master_address", str), need("master_port", int)
    rank, world = need("rank_offset", int), need("world_size", int)
    name = need("group_name", str)
    if body.get("backend", "gloo") != "gloo":
        raise ValueError(f"backend {body.get('backend')!r}: this server's weight groups use gloo")
    if not 1 <= rank < world:
        raise ValueError(f"rank_offset {rank}: must be in [1, world_size={world}) (rank 0 is the writer)")
    if not 0 < port < 65536:
        raise ValueError(f"master_port {port}: not a TCP port")
    timeout = body.get("timeout_s", 120.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
        raise ValueError(f"timeout_s {timeout!r}: must be a number of seconds in (0, 3600]")
    generation = body.get("generation", 0)
    members = body.get("members")
    if not (isinstance(members, list) and len(members) == world - 1 and all(isinstance(m, str) for m in members)):
        members = [f"rank{i}" for i in range(1, world)]
    return GroupSpec(name, int(generation) if isinstance(generation, int) else 0, members, address, port,
                     float(timeout)), rank
