"""realflow's built-in generation engine and its backends.

Importing this package registers the ``builtin`` and ``sglang`` entries of
:data:`realflow.api.generation.generation_backends`, so that
``python -m realflow.rollout.gen_server --backend builtin``
finds them.  The engine itself is :class:`parallel.generation.engine.GenerationEngine`.
"""
from parallel.generation import backend as _backend  # noqa: F401  (registers "builtin")
from parallel.generation import sglang_backend as _sglang  # noqa: F401  (registers "sglang")
from parallel.generation.engine import EngineConfig, GenerationEngine

__all__ = ["EngineConfig", "GenerationEngine"]
