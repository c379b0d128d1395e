"""A small named registry, the single mechanism behind realflow's extension points.

Interfaces, graph builders, experiments and data set formats are all found by
*name* at run time (from a config string such as ``interface_impl="ppo_actor"``),
so that ``realflow/system`` never imports user code directly: the entry point
imports the modules (``--import my_package``) and their decorators fill the
registries.  Each registry instance lives in the module that owns the concept
(e.g. the interface registry in :mod:`realflow.api.interface`); this module only
provides the generic container.

A failed lookup is the most common user mistake (a typo in a config), so the
error names the unknown name *and* the closest registered ones.
"""
from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, TypeVar, overload

T = TypeVar("T")

__all__ = ["Registry", "RegistryError", "closest", "did_you_mean"]


class RegistryError(KeyError):
    """Unknown or conflicting registry name.

    Subclasses ``KeyError`` so ``except KeyError`` keeps working, but prints its
    message without the quoting that ``KeyError.__str__`` adds.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def closest(name: str, candidates: list[str] | tuple[str, ...] | set[str], n: int = 3) -> list[str]:
    """The (up to ``n``) candidates most similar to ``name``, best first.

    Similarity is difflib's ratio; candidates that extend ``name`` (or that
    ``name`` extends) come first, even when not otherwise similar
    (``ref`` -> ``ref_inf`` before ``rew_inf``; ``lr`` -> ``lr_scale``).
    """
    def extends(c: str) -> bool:
        return len(name) >= 2 and len(c) >= 2 and (c.startswith(name) or name.startswith(c))

    pool = sorted(set(candidates))
    found = difflib.get_close_matches(name, pool, n=max(n, 8), cutoff=0.5)
    found += [c for c in pool if c not in found and extends(c)]
    found.sort(key=lambda c: not extends(c))
    return found[:n]


def did_you_mean(name: str, candidates: Iterable[str], sep: str = "; ") -> str:
    """``"; did you mean 'a', 'b'?"`` for the close candidates, or ``""`` when none is close."""
    hint = closest(name, list(candidates))
    return f"{sep}did you mean {', '.join(repr(h) for h in hint)}?" if hint else ""


def _describe(obj: object) -> str:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{mod}.{qual}" if mod else str(qual)


class Registry(Generic[T]):
    """Name -> object mapping with decorator registration and helpful lookups.

    ``kind`` is a human word used in errors ("interface", "graph builder", ...).

    Registering the same name twice is an error (two plugins fighting over one
    name is a bug worth hearing about), except when the object is the same one
    or has the same module and qualified name (a module imported twice, e.g.
    as ``__main__`` and by name).  Pass ``overwrite=True`` to replace on purpose.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T, *, overwrite: bool = False) -> T: ...

    def register(self, name: str, obj: T | None = None, *, overwrite: bool = False):  # type: ignore[no-untyped-def]
        """Register ``obj`` under ``name``; without ``obj``, return a decorator.

        >>> REG = Registry[type]("thing")
        >>> @REG.register("a")
        ... class A: ...
        >>> REG.register("b", int)   # call form
        <class 'int'>
        """
        if not isinstance(name, str) or not name.strip():
            raise RegistryError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if obj is None:
            def decorator(o: T) -> T:
                self._add(name, o, overwrite)
                return o
            return decorator
        self._add(name, obj, overwrite)
        return obj

    def _add(self, name: str, obj: T, overwrite: bool) -> None:
        old = self._items.get(name)
        if old is not None and not overwrite and old is not obj and _describe(old) != _describe(obj):
            raise RegistryError(
                f"{self.kind} {name!r} is already registered to {_describe(old)}; "
                f"cannot register {_describe(obj)} under the same name (pass overwrite=True to replace it)"
            )
        self._items[name] = obj

    def unregister(self, name: str) -> None:
        """Remove ``name`` (unknown names raise like :meth:`get`). Mostly for tests."""
        self.get(name)
        del self._items[name]

    def get(self, name: str) -> T:
        """Look up ``name``; an unknown name raises :class:`RegistryError` naming near misses."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            pass
        known = ", ".join(sorted(self._items)) or "none registered"
        msg = f"unknown {self.kind} {name!r}" + did_you_mean(str(name), self._items)
        msg += f" (known: {known}; plugins are loaded with --import MODULE)"
        raise RegistryError(msg)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
