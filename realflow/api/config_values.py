"""Typed values of config fields: read from command-line text or plain data, written back to plain data.

Why its own module: the conversion rules (one per field type) are shared by ``key=value``
overrides (:mod:`realflow.config.cli`), config files (:mod:`realflow.config.files`) and
configs rebuilt inside a worker from msgpack-able data (:func:`dict_to_config`), and must be
one set of rules so that a value means the same wherever it is written.  Values are
converted from the field's type annotation:

* ``int``, ``float``, ``str``, ``pathlib.Path``;
* ``bool``: true/false, 1/0, yes/no, on/off (any case);
* ``Optional[X]``: ``none`` / ``null`` gives None, anything else converts as X;
* ``list[X]`` / ``tuple[X, ...]``: a comma list (``1,2,3``; empty string = empty
  list) or JSON (``[1, 2, 3]``);
* ``dict[str, X]``: JSON, or one entry at a time (``interface_args.temp=0.7``);
* enums (by value or name), ``Literal[...]`` (one of the listed values);
* nested dataclasses: dotted keys, or a JSON object; ``Any``: JSON, else the string.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib
import types
import typing
from typing import Any, Literal, TypeVar, Union

from realflow.api.registry import closest

__all__ = ["ConfigError", "field_paths", "config_to_dict", "dict_to_config"]

T = TypeVar("T")
_UNSET: Any = object()
_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


class ConfigError(ValueError):
    """A bad command line or config dict; the message names the key (and what was expected)."""


# ---- type introspection -------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as e:  # unresolvable string annotation
        raise ConfigError(f"cannot resolve the type annotations of config class {cls.__qualname__}: {e}") from None


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); other types -> (tp, False). Other unions stay unions."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True
    return tp, False


def _dataclass_of(tp: Any) -> type | None:
    inner, _ = _split_optional(tp)
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


def _type_name(tp: Any) -> str:
    inner, opt = _split_optional(tp)
    if opt:
        return f"{_type_name(inner)} | None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any (JSON or str)"
    if origin is Literal:
        return "one of {" + ", ".join(str(a) for a in args) + "}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of {" + ", ".join(str(m.value) for m in tp) + "}"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inside = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inside}]"
    return getattr(tp, "__name__", str(tp))


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted key of config class ``cls`` (nested dataclasses included)."""
    out = []
    hints = _hints(cls)
    for name in _init_fields(cls):
        path = prefix + name
        out.append(path)
        sub = _dataclass_of(hints[name])
        if sub is not None:
            out.extend(field_paths(sub, path + "."))
    return out


# ---- value conversion ---------------------------------------------------------------------------


def _bad(path: str, tp: Any, raw: Any, why: str = "") -> ConfigError:
    e = ConfigError(f"bad value for {path}: expected {_type_name(tp)}, got {raw!r}" + (f" ({why})" if why else ""))
    e.bad_path, e.why = path, why  # type: ignore[attr-defined]
    return e


def _convert(raw: Any, tp: Any, path: str, cli: bool) -> Any:
    """Convert ``raw`` to ``tp``. ``cli``: raw is command-line text; otherwise a JSON-like value."""
    inner, optional = _split_optional(tp)
    if optional:
        if raw is None or (cli and isinstance(raw, str) and raw.strip().lower() in ("none", "null")):
            return None
        try:
            return _convert(raw, inner, path, cli)
        except ConfigError as e:  # say "int | None", not "int"
            if getattr(e, "bad_path", None) == path:
                raise _bad(path, tp, raw, e.why) from None  # type: ignore[attr-defined]
            raise
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        if cli and isinstance(raw, str):
            try:
                return json.loads(raw)
            except ValueError:
                return raw
        return raw
    if origin in (Union, types.UnionType):
        for a in args:
            try:
                return _convert(raw, a, path, cli)
            except ConfigError:
                continue
        raise _bad(path, tp, raw)
    if origin is Literal:
        for option in args:
            try:
                if _convert(raw, type(option), path, cli) == option:
                    return option
            except ConfigError:
                continue
        raise _bad(path, tp, raw)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(raw, tp):
            return raw
        for m in tp:
            if raw == m.value or (isinstance(raw, str) and (raw == str(m.value) or raw.lower() == m.name.lower())):
                return m
        raise _bad(path, tp, raw)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower() if isinstance(raw, (str, int)) else None
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise _bad(path, tp, raw, "use true/false, 1/0 or yes/no")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                pass
            try:  # "1e3"
                f = float(raw.strip())
                if f.is_integer():
                    return int(f)
            except (ValueError, OverflowError):
                pass
        raise _bad(path, tp, raw)
    if tp is float:
        value = None
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw.strip())
            except ValueError:
                pass
        if value is None:
            raise _bad(path, tp, raw)
        if not math.isfinite(value):  # a NaN or inf coefficient, rate or limit can only poison a run
            raise _bad(path, tp, raw, "must be a finite number")
        return value
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise _bad(path, tp, raw)
    if tp is pathlib.Path:
        if isinstance(raw, (str, pathlib.Path)):
            return pathlib.Path(raw)
        raise _bad(path, tp, raw)
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        return _convert_seq(raw, tp, origin or tp, args, path, cli)
    if origin is dict or tp is dict:
        if cli and isinstance(raw, str):
            raw = _json(raw, path, tp)
        if not isinstance(raw, dict):
            raise _bad(path, tp, raw, "give a JSON object")
        kt, vt = args or (str, Any)
        return {_convert(k, kt, f"{path}[{k!r}]", False): _convert(v, vt, f"{path}.{k}", False) for k, v in raw.items()}
    sub = _dataclass_of(tp)
    if sub is not None:
        if isinstance(raw, sub):
            return raw
        if cli and isinstance(raw, str):
            raw = _json(raw, path, tp)
        if not isinstance(raw, dict):
            raise _bad(path, tp, raw, "set its fields with dotted keys or give a JSON object")
        return dict_to_config(sub, raw, path + ".")
    if isinstance(tp, type) and isinstance(raw, tp):
        return raw
    raise ConfigError(f"config key {path}: unsupported field type {_type_name(tp)}")


def _json(raw: str, path: str, tp: Any) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise _bad(path, tp, raw, f"invalid JSON: {e}") from None


def _convert_seq(raw: Any, tp: Any, container: Any, args: tuple, path: str, cli: bool) -> Any:
    if cli and isinstance(raw, str):
        text = raw.strip()
        if text.startswith("["):
            items, cli_items = _json(text, path, tp), False
            if not isinstance(items, list):
                raise _bad(path, tp, raw)
        else:
            items, cli_items = ([s.strip() for s in text.split(",")] if text else []), True
    elif isinstance(raw, (list, tuple)):
        items, cli_items = list(raw), False
    else:
        raise _bad(path, tp, raw, "give a comma list or a JSON list")
    if container is tuple and args and args[-1] is not Ellipsis:
        if len(items) != len(args):
            raise _bad(path, tp, raw, f"needs exactly {len(args)} items")
        types_ = list(args)
    else:
        types_ = [args[0] if args else Any] * len(items)
    out = [_convert(v, t, f"{path}[{i}]", cli_items) for i, (v, t) in enumerate(zip(items, types_))]
    return tuple(out) if container is tuple else (set(out) if container in (set, frozenset) else out)


# ---- building a config from plain data ---------------------------------------------------------


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return _UNSET


def _invalid(cls: type, path: str, msg: str) -> str:
    """A config class's own error as the user wrote the key: ``OptimizerConfig.lr=...`` set at
    ``optimizer.`` reads ``optimizer.lr=...``; a message that already names the path stays."""
    if msg.startswith(cls.__name__ + "."):
        msg = path + msg[len(cls.__name__) + 1:]
    if not path or msg.startswith(path):
        return f"invalid config: {msg}"
    return f"invalid config {path.rstrip('.')}: {msg}"


def _construct(cls: type[T], kwargs: dict[str, Any], path: str, base: Any = _UNSET) -> T:
    try:
        if base is not _UNSET and isinstance(base, cls):
            return dataclasses.replace(base, **kwargs)
        missing = [n for n, f in _init_fields(cls).items() if n not in kwargs and _field_default(f) is _UNSET]
        if missing:
            raise ConfigError(f"missing required config key(s): {', '.join(path + m for m in missing)}")
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(_invalid(cls, path, str(e))) from None


def dict_to_config(cls: type[T], d: dict[str, Any], _path: str = "") -> T:
    """Rebuild a config from plain data (e.g. :func:`config_to_dict` output received over msgpack).

    Missing keys take the class defaults; unknown keys and bad values raise :class:`ConfigError`.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"config {_path.rstrip('.') or cls.__name__}: expected a dict, got {type(d).__name__}")
    fields, hints = _init_fields(cls), _hints(cls)
    kwargs = {}
    for k, v in d.items():
        if k not in fields:
            hint = closest(str(k), list(fields))
            raise ConfigError(
                f"unknown config key {_path + str(k)!r}"
                + (f"; did you mean {', '.join(_path + h for h in hint)}?" if hint else "")
            )
        kwargs[k] = _convert(v, hints[k], _path + k, cli=False)
    return _construct(cls, kwargs, _path)


def config_to_dict(obj: Any) -> Any:
    """A plain, JSON-able copy of a config (enums -> values, paths -> str, tuples -> lists)."""
    return _plain(obj, type(obj).__name__)


def _plain(v: Any, path: str) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name), f"{path}.{f.name}") for f in dataclasses.fields(v) if f.init}
    if isinstance(v, enum.Enum):
        return _plain(v.value, path)
    if isinstance(v, pathlib.PurePath):
        return str(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return [_plain(x, f"{path}[{i}]") for i, x in enumerate(items)]
    if isinstance(v, dict):
        return {str(k): _plain(x, f"{path}.{k}") for k, x in v.items()}
    raise ConfigError(f"config value {path} of type {type(v).__name__} is not plain data")
