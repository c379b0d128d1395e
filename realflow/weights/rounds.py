"""One weight-update round on the servers' side: stage -> pause -> swap/update -> continue.

The rollout controller queues versions and keeps the bookkeeping (the version the servers
run, the round times it reports); :func:`update_servers` is what a round does to the
servers, and how each kind of server gets the new weights:

* servers that can stage (``can_stage``) build them beside the live ones while
  generation goes on -- from the broadcast (when every receiver can stage) and from
  shared memory -- and only swap them in (``/commit_staged_weights``) while paused;
* broadcast receivers that cannot stage receive while paused;
* the rest load from shared memory or from the checkpoint while paused.

Broadcast receivers that did not get the version keep theirs until the next round.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from realflow.weights.broadcast_groups import WeightGroups
from realflow.weights.servers import Server, ServerSet
from realflow.weights.version import WeightUpdate

__all__ = ["RoundOutcome", "update_servers"]

logger = logging.getLogger("realflow.rollout.controller")  # reported as the controller's


@dataclass
class RoundOutcome:
    """What a round did: who staged, who received by broadcast, and when generation paused."""

    staged: list[Any] = field(default_factory=list)
    receivers: list[Any] = field(default_factory=list)
    t_pause: float = 0.0  # time.perf_counter() at /pause_generation

    def how(self, r: WeightUpdate) -> str:
        """``shared memory+broadcast to 2``: the ways this round's weights travelled, for the log."""
        return "+".join(w for w, on in (("shared memory", r.handle is not None), ("disk", r.path is not None),
                                        (f"broadcast to {len(self.receivers)}", bool(self.receivers))) if on)


async def _load_lora_adapter(pool: ServerSet, r: WeightUpdate, servers: list[Server]) -> dict[str, Any]:
    """SGLang's LoRA update: unload the adapter of the last version, load this version's directory
    under the same name (requests name it in ``lora_path``). SGLang's replies carry no weight
    version, so a success means ``r.version``."""
    name = pool.lora_name
    await pool.broadcast("/unload_lora_adapter", {"lora_name": name}, timeout=120.0, only=servers)
    res = await pool.broadcast("/load_lora_adapter", {"lora_name": name, "lora_path": r.path},
                               timeout=600.0, only=servers)
    if any(isinstance(v, dict) and v.get("success", True) for v in res.values()):
        pool.lora_loaded = True  # type: ignore[attr-defined]  (requests now name the adapter)
    return {k: (dict(v, weight_version=r.version) if isinstance(v, dict) else v) for k, v in res.items()}


async def update_servers(pool: ServerSet, groups: WeightGroups, r: WeightUpdate, pause_mode: str) -> RoundOutcome:
    """Bring every live server of ``pool`` to version ``r.version`` (``pause_mode``: abort or retract
    the running requests); sets each updated server's ``version`` and resumes generation."""
    out = RoundOutcome()
    staged: list[Server] = out.staged
    receivers = groups.receivers(r.broadcast) if r.broadcast else []
    out.receivers = receivers
    early = bool(receivers) and all(s.can_stage for s in receivers)
    if early:  # all receivers can stage: the bytes travel while generation goes on
        assert r.broadcast is not None
        staged += await groups.deliver(r.broadcast, r.version, stage=True)
    # a delta in shared memory only fits servers at its base; the others keep their weights (and
    # get a full update next: the plan sees them behind)
    shm_base = None if r.shm_delta is None else r.shm_delta.get("base")
    shm_skip = [s for s in pool.alive() if shm_base is not None and s.version != shm_base
                and all(s is not t for t in receivers)]
    for s in shm_skip:
        s.delta_base = None
        logger.warning("%s runs v%d, not v%s (the base of delta v%d): it keeps its weights until a full update",
                       s.name, s.version, shm_base, r.version)
    if r.handle is not None:
        body = {"shm_handle": r.handle, "format": "hf", "weight_version": r.version, "unlink": False}
        if r.shm_delta is not None:
            body["delta"] = r.shm_delta
        stagers = [s for s in pool.alive() if s.can_stage and all(s is not t for t in shm_skip)]
        if stagers:
            res = await pool.broadcast("/update_weights_from_tensor", dict(body, stage=True),
                                       timeout=600.0, only=stagers)
            staged += [s for s in stagers if isinstance(res.get(s.name), dict)]
    out.t_pause = time.perf_counter()
    await pool.broadcast("/pause_generation", {"mode": pause_mode})
    res = {}
    if staged:
        res.update(await pool.broadcast("/commit_staged_weights", {"weight_version": r.version},
                                        timeout=60.0, only=staged))
    if receivers and not early:  # some receiver cannot stage: broadcast while paused
        assert r.broadcast is not None
        for s in await groups.deliver(r.broadcast, r.version, stage=False):
            s.version = r.version
    # broadcast receivers that did not get this version keep theirs until the next round
    rest = [s for s in pool.alive() if all(s is not t for t in staged + receivers + shm_skip)]
    if rest and r.handle is not None:
        res.update(await pool.broadcast("/update_weights_from_tensor", body, timeout=600.0, only=rest))
    elif rest and r.path is not None and getattr(pool, "lora_name", None):
        res.update(await _load_lora_adapter(pool, r, rest))
    elif rest and r.path is not None:
        body = {"model_path": r.path, "weight_version": r.version}
        res.update(await pool.broadcast("/update_weights_from_disk", body, timeout=600.0, only=rest))
    delta_ok = {"shm": r.shm_delta is not None,
                "group": r.broadcast is not None and r.broadcast.get("delta") is not None}
    for name, v in res.items():
        if isinstance(v, dict) and v.get("success", True):
            s = next(s for s in pool.servers if s.name == name)
            s.version = int(v["weight_version"])
            if all(s is not t for t in receivers):
                s.delta_base = r.version if delta_ok["shm"] else None
    for s in receivers:
        if s.version == r.version:
            s.delta_base = r.version if delta_ok["group"] else None
    await pool.broadcast("/continue_generation", {})
    return out
