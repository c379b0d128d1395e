"""The generation server's HTTP routes for weight broadcasts (SGLang's endpoints and bodies);
the logic (joining, receiving, parsing) is :mod:`realflow.weights.receiver`.

* ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset,
  world_size, group_name, backend: "gloo", generation?, timeout_s?}``: join the
  writer's weight group as rank ``rank_offset`` (returns once every member joined;
  a group this server was in before is left first).
* ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name,
  weight_version?, stage?, flush_cache?}``: receive the tensors the writer broadcasts,
  in order, and load them (``stage: true``: build them beside the weights in use while
  generation goes on, as ``/update_weights_from_tensor`` does; ``/commit_staged_weights``
  swaps them in). ``delta``: a manifest (:mod:`realflow.weights.delta`); a receiver whose
  version is not its base answers ``{success: false, behind: true}`` and keeps its weights.
* ``POST /destroy_weights_update_group`` ``{group_name}``.

Why receive outside the backend lock: the bytes travel for as long as the network
needs; generation must not stop for that, only for the swap.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from realflow.rollout.gen_server_state import BadRequest, GenServer
from realflow.weights.broadcast import TensorMeta, WeightBroadcastError
from realflow.weights.delta import DeltaBaseMismatch
from realflow.weights.receiver import GroupSlot, parse_init

__all__ = ["weight_group_routes"]

logger = logging.getLogger("realflow.gen_server")


def weight_group_routes(server: GenServer, json_body: Any, version_of: Any, bind_host: str
                        ) -> tuple[list, Any]:
    """``(routes, on_cleanup)`` for ``build_app``; ``json_body``/``version_of`` are its body parsers."""
    slot = GroupSlot(lambda name: setattr(server, "weight_group", name))

    async def init_group(request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            spec, rank = parse_init(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        try:
            await asyncio.to_thread(slot.join, spec, rank, bind_host)
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
        try:
            group = slot.check(name)
        except ValueError as e:
            raise BadRequest(str(e)) from None

        def work() -> int:
            return server.load_weights(slot.receive(group, meta), "hf", version, stage, body.get("delta"))

        try:
            v = await asyncio.to_thread(work)
        except WeightBroadcastError as e:
            slot.replace(None)  # a failed collective leaves the group unusable: the writer regroups
            return web.json_response({"success": False, "error": str(e)}, status=503)
        except DeltaBaseMismatch as e:  # received (the collective completed), not applied: not a failure
            logger.warning("%s", e)
            return web.json_response({"success": False, "behind": True, "error": str(e),
                                      "weight_version": server.backend.weight_version})
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
