"""Model interfaces: what an algorithm does with a model, independent of where it runs.

An interface implements some of ``generate`` / ``inference`` / ``train_step``
(plus ``evaluate`` / ``save``) for one role.  Model workers call the method an
MFC names on the model shard they hold; the interface never sees devices,
process groups or other workers, which is what lets one algorithm run on any
allocation.  Interfaces are found by registry name (``MFCDef.interface_impl``)
and built from plain keyword arguments (``MFCDef.interface_args``), so a
worker can construct them from a config it received as msgpack.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.engine import TrainEngine
from realflow.api.mfc import ModelInterfaceType
from realflow.api.registry import Registry, RegistryError, did_you_mean

__all__ = [
    "InterfaceError", "Model", "ModelInterface", "interface_registry", "register_interface", "make_interface",
]


class InterfaceError(ValueError):
    """An interface could not be built (unknown argument, missing argument, bad value)."""


@dataclass
class Model:
    """What an interface operates on: one role's shard on this worker.

    ``module`` is the role's engine in this layout: everything an interface may call on it
    is declared by :class:`realflow.api.engine.TrainEngine` (the worker checks it when the
    engine is built). A role without a model (backend ``"none"``, e.g. a rule-based reward)
    gets ``None``. ``version`` counts the train steps applied so far (the weight version
    used for staleness control, and what the engine's generator is told when it changes).
    """

    name: str
    module: TrainEngine
    tokenizer: Any = None
    version: int = 0

    def inc_version(self) -> int:
        self.version += 1
        return self.version


class ModelInterface:
    """Base class of interfaces; override the methods your role needs.

    ``generate`` / ``inference`` return a :class:`SequenceBatch` with the MFC's
    (interface-side) output keys for the same sample ids; ``train_step`` returns
    statistics (a dict of floats, or one dict per micro-batch / minibatch).
    """

    def generate(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> SequenceBatch:
        raise self._missing("generate")

    def inference(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> SequenceBatch:
        raise self._missing("inference")

    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float] | list[dict[str, float]]:
        raise self._missing("train_step")

    def evaluate(self, model: Model, eval_batches: Any) -> dict[str, float]:
        raise self._missing("evaluate")

    def save(self, model: Model, save_dir: str) -> None:
        raise self._missing("save")

    def state_dict(self) -> dict[str, Any]:
        """What this interface keeps between calls, for recover points (a resumed run must
        continue e.g. a step counter that seeds mini-batch shuffling).

        Default: every instance attribute that holds a plain number, string or bool and is
        not a constructor argument (those come from the config again), such as ``_step``.
        Override both methods if an interface keeps richer state.
        """
        init = set(_accepted_args(type(self))[0])
        return {k: v for k, v in vars(self).items()
                if k not in init and isinstance(v, (int, float, str, bool)) and not isinstance(v, type)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for k, v in state.items():
            setattr(self, k, v)

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"interface {type(self).__name__} does not implement {method}(); "
            f"an MFC called {method} on it (override {type(self).__name__}.{method} or fix the MFC's interface_type)"
        )

    def method_for(self, interface_type: ModelInterfaceType | str) -> Callable[..., Any]:
        """The bound method an MFC of ``interface_type`` calls (generate / inference / train_step)."""
        return getattr(self, ModelInterfaceType(interface_type).value)


interface_registry: Registry[type[ModelInterface]] = Registry("interface")

I = TypeVar("I", bound=type[ModelInterface])


def register_interface(name: str) -> Callable[[I], I]:
    """Class decorator: make a :class:`ModelInterface` subclass available as ``name``."""

    def decorator(cls: I) -> I:
        if not (isinstance(cls, type) and issubclass(cls, ModelInterface)):
            raise InterfaceError(f"@register_interface({name!r}) must decorate a ModelInterface subclass, got {cls!r}")
        return interface_registry.register(name, cls)

    return decorator


def _accepted_args(cls: type) -> tuple[list[str], bool]:
    """(named constructor arguments, accepts **kwargs)."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init], False
    params = list(inspect.signature(cls).parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, var_kw


def make_interface(name: str, **args: Any) -> ModelInterface:
    """Build the interface registered as ``name`` with keyword ``args``.

    Arguments are checked against the constructor first so that a typo in a
    config reads ``interface 'ppo_actor' has no argument 'kl_ctl'; did you mean
    'kl_coef'?`` instead of a TypeError from deep inside a worker.
    """
    try:
        cls = interface_registry.get(name)
    except RegistryError as e:
        raise InterfaceError(str(e)) from None
    accepted, var_kw = _accepted_args(cls)
    if not var_kw:
        for a in args:
            if a not in accepted:
                raise InterfaceError(
                    f"interface {name!r} ({cls.__name__}) has no argument {a!r}"
                    + did_you_mean(a, accepted) + f" (arguments: {accepted})"
                )
    try:
        return cls(**args)
    except TypeError as e:
        raise InterfaceError(f"cannot build interface {name!r} ({cls.__name__}) from {sorted(args)}: {e}") from None
