"""What the weight-update rounds need of the generation servers they update.

The rollout side's :class:`~realflow.rollout.server_pool.ServerPool` satisfies these
protocols; they are spelled out here so that the weight-sync package depends on no
runtime package (realflow/weights imports realflow/comm and realflow/base only), and so
that a test, or another router, can drive a round with its own pool.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

__all__ = ["Server", "ServerSet"]


@runtime_checkable
class Server(Protocol):
    """One generation server as the rounds see it (``ServerState``)."""

    name: str
    alive: bool
    version: int  # the weight version it runs
    can_stage: bool  # it can build new weights beside the live ones (``/commit_staged_weights`` swaps)
    hostname: str  # servers on the writer's host read shared memory
    joining: bool  # a replacement that still needs the current version
    delta_base: Optional[int]  # the version a delta update may be based on (None: it needs a full one)


class ServerSet(Protocol):
    """The servers of a run, and how to call them (``ServerPool``)."""

    servers: list[Any]
    #: set when the servers serve a LoRA adapter by name (SGLang): disk updates load it with
    #: ``/load_lora_adapter`` instead of replacing the model
    lora_name: Optional[str]

    def alive(self) -> list[Any]:
        """The live servers, in a fixed order."""
        ...

    async def call(self, server: Any, endpoint: str, body: Optional[dict] = None,
                   timeout: Optional[float] = None) -> Any:
        """POST ``body`` to one server; raises on failure."""
        ...

    async def broadcast(self, endpoint: str, body: Optional[dict] = None, timeout: Optional[float] = None,
                        only: Optional[Sequence[Any]] = None) -> dict[str, Any]:
        """POST to every live server (or ``only`` those); ``{name: reply or error}``."""
        ...
