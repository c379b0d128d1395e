"""The generation server's side of weight broadcasts (SGLang's endpoints and bodies).

* ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset,
  world_size, group_name, backend: "gloo", generation?, timeout_s?}``: join the
  writer's weight group as rank ``rank_offset`` (returns once every member joined;
  a group this server was in before is left first).
* ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name,
  weight_version?, stage?, flush_cache?}``: receive the tensors the writer broadcasts,
  in order, and load them (``stage: true``: build them beside the weights in use while
  generation goes on, as ``/update_weights_from_tensor`` does; ``/commit_staged_weights``
  swaps them in).
* ``POST /destroy_weights_update_group`` ``{group_name}``.

Why receive outside the backend lock: the bytes travel for as long as the network
needs; generation must not stop for that, only for the swap.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Optional

from aiohttp import web

from realflow.comm.weight_broadcast import GroupSpec, TensorMeta, WeightBroadcastError, WeightGroup
from realflow.rollout.gen_server_state import BadRequest, GenServer

__all__ = ["weight_group_routes"]

logger = logging.getLogger("realflow.gen_server")


class _GroupSlot:
    """The one weight group a server is in (a new init replaces it)."""

    def __init__(self, server: GenServer) -> None:
        self.server = server
        self.group: Optional[WeightGroup] = None
        self.lock = threading.Lock()  # one join or one receive at a time

    def replace(self, new: Optional[WeightGroup]) -> None:
        old, self.group = self.group, new
        self.server.weight_group = None if new is None else new.spec.name
        if old is not None:
            old.close()


def weight_group_routes(server: GenServer, json_body: Any, version_of: Any, bind_host: str
                        ) -> tuple[list, Any]:
    """``(routes, on_cleanup)`` for ``build_app``; ``json_body``/``version_of`` are its body parsers."""
    slot = _GroupSlot(server)

    async def init_group(request: web.Request) -> web.Response:
        body = await json_body(request)
        spec, rank = _parse_init(body)

        def work() -> None:
            with slot.lock:
                slot.replace(None)
                slot.replace(WeightGroup(spec, rank, bind_host))

        try:
            await asyncio.to_thread(work)
        except WeightBroadcastError as e:
            raise BadRequest(str(e)) from None
        logger.info("joined %s as rank %d", spec.describe(), rank)
        return web.json_response({"success": True, "message": f"joined {spec.name} as rank {rank}"})

    async def update_from_distributed(request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            meta = TensorMeta.from_body(body)
        except ValueError as e:
            raise BadRequest(f"update_weights_from_distributed: {e}") from None
        name = body.get("group_name")
        version = version_of(body)
        stage = server.stage_flag(body)
        group = slot.group
        if group is None or name != group.spec.name:
            raise BadRequest(f"group_name {name!r}: this server is in "
                             f"{'no weight group' if group is None else repr(group.spec.name)} "
                             f"(POST /init_weights_update_group first)")

        def work() -> int:
            with slot.lock:
                tensors = group.receive(meta)
            return server.load_weights(tensors, "hf", version, stage)

        try:
            v = await asyncio.to_thread(work)
        except WeightBroadcastError as e:
            slot.replace(None)  # a failed collective leaves the group unusable: the writer regroups
            return web.json_response({"success": False, "error": str(e)}, status=503)
        except (ValueError, KeyError) as e:
            raise BadRequest(f"update_weights_from_distributed: {e}") from None
        return web.json_response(server.weights_reply(v, stage))

    async def destroy_group(request: web.Request) -> web.Response:
        body = await json_body(request)
        name = body.get("group_name")
        if slot.group is None or slot.group.spec.name != name:
            raise BadRequest(f"group_name {name!r}: no such weight group here")
        await asyncio.to_thread(slot.replace, None)
        return web.json_response({"success": True})

    async def on_cleanup(app: web.Application) -> None:
        slot.replace(None)

    return [web.post("/init_weights_update_group", init_group),
            web.post("/update_weights_from_distributed", update_from_distributed),
            web.post("/destroy_weights_update_group", destroy_group)], on_cleanup


def _parse_init(body: dict[str, Any]) -> tuple[GroupSpec, int]:
    def need(key: str, kind: type) -> Any:
        v = body.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise BadRequest(f"init_weights_update_group: {key} ({kind.__name__}) is required, got {v!r}")
        return v

    address, port = need("master_address", str), need("master_port", int)
    rank, world = need("rank_offset", int), need("world_size", int)
    name = need("group_name", str)
    if body.get("backend", "gloo") != "gloo":
        raise BadRequest(f"backend {body.get('backend')!r}: this server's weight groups use gloo")
    if not 1 <= rank < world:
        raise BadRequest(f"rank_offset {rank}: must be in [1, world_size={world}) (rank 0 is the writer)")
    if not 0 < port < 65536:
        raise BadRequest(f"master_port {port}: not a TCP port")
    timeout = body.get("timeout_s", 120.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
        raise BadRequest(f"timeout_s {timeout!r}: must be a number of seconds in (0, 3600]")
    generation = body.get("generation", 0)
    members = body.get("members")
    if not (isinstance(members, list) and len(members) == world - 1 and all(isinstance(m, str) for m in members)):
        members = [f"rank{i}" for i in range(1, world)]
    return GroupSpec(name, int(generation) if isinstance(generation, int) else 0, members, address, port,
                     float(timeout)), rank
