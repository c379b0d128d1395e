"""Which servers get new weights by broadcast, and the rounds' broadcast part.

Servers on the writer's host read the weights from shared memory; the others (every
server with ``weight_sync=broadcast``) are the receivers of a weight group whose rank 0
is the trainer's writer (:mod:`realflow.weights.broadcast`). The controller owns
the membership: a plan names the receivers under a *generation* that changes when the
set of live receivers changes or a broadcast failed, and the writer forms a new group
for a new generation. A server lost mid-broadcast fails that round's broadcast for
everyone in it (the collective cannot finish); its live peers keep their weights and
catch up at the next round, in the next generation, without the dead one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from realflow.weights.broadcast import GroupSpec
from realflow.weights.servers import Server, ServerSet

__all__ = ["WeightGroups", "GROUP_NAME"]

logger = logging.getLogger("realflow.rollout.controller")  # reported as the controller's

GROUP_NAME = "realflow-weights"


class WeightGroups:
    """Membership of the weight group and the servers' side of each broadcast."""

    def __init__(self, pool: ServerSet, mode: str, timeout_s: float) -> None:
        self.pool, self.mode, self.timeout_s = pool, mode, timeout_s
        self.generation = 0
        self.members: list[str] = []
        self.broken = False  # the last broadcast failed: the next plan regroups
        self.joined: Optional[tuple[str, int]] = None  # (name, generation) the members joined
        self.failures = 0

    def plan(self, writer_host: str, delta: Optional[tuple[str, int, Optional[int]]] = None) -> dict[str, Any]:
        """For the next publish: ``shm`` (any server on the writer's host) and ``group``
        (the receivers' GroupSpec, or None when every live server reads shared memory).

        ``delta`` (delta sync on): ``(mode, the servers' version, the version they will hold when
        this round starts, or None when a round is queued)``; the plan then says, per way, the
        base its receivers hold (``delta: {"mode", "shm", "group"}``; a base is None, a full update,
        unless every receiver of that way holds the current version as its delta base)."""
        alive = self.pool.alive()
        remote = [s for s in alive if self.mode == "broadcast" or (s.hostname and s.hostname != writer_host)]
        local = [s for s in alive if s not in remote]
        out: dict[str, Any] = {}
        if delta is not None:
            mode, current, target = delta
            out["delta"] = {"mode": mode, "shm": _common_base(local, current, target),
                            "group": _common_base(remote, current, target)}
        if not remote:
            return {"shm": bool(local), "group": None, **out}
        names = [s.name for s in remote]
        if names != self.members or self.broken or self.generation == 0:
            self.generation += 1
            self.members, self.broken = names, False
        spec = GroupSpec(GROUP_NAME, self.generation, names, timeout_s=self.timeout_s)
        return {"shm": bool(local), "group": spec.to_wire(), **out}

    def receivers(self, bc: dict[str, Any]) -> list[Server]:
        spec = GroupSpec.from_wire(bc["group"])
        return [s for s in self.pool.alive() if s.name in spec.members]

    async def deliver(self, bc: dict[str, Any], version: int, stage: bool) -> list[Server]:
        """Have the group's receivers join (a new generation) and receive version ``version``;
        return those that got it (staged when ``stage``). All or none: a collective."""
        spec = GroupSpec.from_wire(bc["group"])
        by_name = {s.name: s for s in self.pool.alive()}
        missing = [m for m in spec.members if m not in by_name]
        if missing:
            return self._failed(spec, f"receiver(s) {missing} were lost before the round")
        members = [by_name[m] for m in spec.members]
        if self.joined != (spec.name, spec.generation):
            body = {"master_address": spec.address, "master_port": spec.port, "world_size": spec.world_size,
                    "group_name": spec.name, "backend": "gloo", "generation": spec.generation,
                    "timeout_s": spec.timeout_s, "members": spec.members}
            res = await self._each(members, "/init_weights_update_group",
                                   [dict(body, rank_offset=i + 1) for i in range(len(members))], spec.timeout_s + 10)
            bad = {n: r for n, r in res.items() if not isinstance(r, dict)}
            if bad:
                return self._failed(spec, f"could not join: {bad}")
            self.joined = (spec.name, spec.generation)
        body = dict(bc["meta"], group_name=spec.name, weight_version=version, stage=stage, flush_cache=False)
        if bc.get("delta") is not None:
            body["delta"] = bc["delta"]
        res = await self._each(members, "/update_weights_from_distributed", [body] * len(members),
                               spec.timeout_s + 10)
        bad = {n: r for n, r in res.items() if not isinstance(r, dict)}
        if bad:
            return self._failed(spec, f"receiving v{version} failed: {bad}")
        # a receiver not at the delta's base took part in the collective but kept its weights
        behind = [s for s in members if res[s.name].get("success") is not True]
        for s in behind:
            s.delta_base = None
            logger.warning("%s keeps v%d: %s", s.name, s.version, res[s.name].get("error"))
        return [s for s in members if res[s.name].get("success") is True]

    def _failed(self, spec: GroupSpec, why: str) -> list[Server]:
        self.broken, self.joined = True, None
        self.failures += 1
        logger.error("%s: %s; those servers keep their weights until the next round (a new group)",
                     spec.describe(), why)
        return []

    async def _each(self, servers: list[Server], endpoint: str, bodies: list[dict], timeout: float
                    ) -> dict[str, Any]:
        """One call per server with its own body, concurrently; errors come back as values
        (a server that refuses is not marked lost: its peers' failure may be the cause)."""
        async def one(s: Server, body: dict) -> Any:
            try:
                return await self.pool.call(s, endpoint, body, timeout)
            except Exception as e:  # noqa: BLE001 - reported by the caller with the server's name
                return f"{type(e).__name__}: {e}"
        results = await asyncio.gather(*(one(s, b) for s, b in zip(servers, bodies)))
        return {s.name: r for s, r in zip(servers, results)}


def _common_base(servers: list[Any], current: int, target: Optional[int]) -> Optional[int]:
    """``target`` when every one of ``servers`` runs ``current`` and holds it as its delta base."""
    if target is None or not servers:
        return None
    ok = all(not s.joining and s.version == current and s.delta_base == current for s in servers)
    return target if ok else None
