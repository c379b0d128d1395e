"""What a weight version is, and how one is asked for and announced.

A *version* is the number of train steps the policy has taken (0: the initial
weights). The trainer's master publishes each new version; the rollout controller
runs one *weight-update round* per version it receives, and a version carries its
weights in up to three ways at once (:class:`WeightUpdate`):

* ``handle``: one shared-memory segment of HF-named tensors, for servers on the
  writer's host (``weight_sync=memory``);
* ``broadcast``: a weight group and the tensor list, for servers on other hosts
  (``weight_sync=broadcast``, or memory with servers elsewhere);
* ``path``: an HF checkpoint at ``<run dir>/weights/v<N>`` (``weight_sync=disk``).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["WeightUpdate", "PublishError", "checkpoint_dir", "publish_request", "writer_reply",
           "remove_older_checkpoints"]


@dataclass
class WeightUpdate:
    """One version on its way to the servers (the body of the controller's ``update_weights``)."""

    version: int
    handle: Optional[dict] = None  # shared-memory weights (weight_sync=memory)
    path: Optional[str] = None  # checkpoint directory (weight_sync=disk)
    broadcast: Optional[dict] = None  # group + tensor list for servers on other hosts (+ "delta": manifest)
    shm_delta: Optional[dict] = None  # the shared-memory segment's manifest (realflow.weights.delta)
    weight_bytes: Optional[dict] = None  # the writer's {"sent", "full"} bytes of this version


class PublishError(RuntimeError):
    """The writer's workers did not answer a publish as one writer should."""


def checkpoint_dir(run_dir: str, version: int) -> str:
    """Where disk sync writes version ``version``."""
    return os.path.join(run_dir, "weights", f"v{version}")


def publish_request(role: str, version: int, weight_sync: str, run_dir: str) -> dict[str, Any]:
    """The ``publish_weights`` payload the policy's home workers get (before the controller's plan
    for memory sync is added: ``shm`` and ``group``)."""
    payload: dict[str, Any] = {"role": role, "version": version,
                               "mode": "disk" if weight_sync == "disk" else "memory"}
    if weight_sync == "disk":
        payload["path"] = checkpoint_dir(run_dir, version)
    return payload


def writer_reply(replies: dict[str, dict], role: str, version: int) -> WeightUpdate:
    """The one writer's answer among the home workers' replies to ``publish_weights``."""
    got = [r for r in replies.values() if r.get("handle") or r.get("path") or r.get("broadcast")]
    if len(got) != 1:
        raise PublishError(f"publish_weights of {role} v{version}: expected one writer, got {got}")
    w = got[0]
    return WeightUpdate(version, w.get("handle"), w.get("path"), w.get("broadcast"), w.get("shm_delta"),
                        w.get("weight_bytes"))


def remove_older_checkpoints(path: str) -> None:
    """Disk sync writes ``.../weights/v<N>``; versions before the one just loaded are done with."""
    parent, name = os.path.split(path.rstrip("/"))
    if not name.startswith("v") or not name[1:].isdigit():
        return
    for other in os.listdir(parent):
        if other.startswith("v") and other[1:].isdigit() and int(other[1:]) < int(name[1:]):
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)
