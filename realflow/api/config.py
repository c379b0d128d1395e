"""Dataclass configs from the command line, without argparse boilerplate.

Every experiment is a (nested) dataclass.  The command line is a list of
``key=value`` overrides on top of its defaults, with dots for nesting::

    python -m realflow.apps.main_sync_ppo actor.path=/ckpt/qwen2 optimizer.lr=1e-4 seeds=1,2,3

Why this shape: configs must be complete, typed and documented in one place
(the dataclass), and the same object must be rebuildable inside a worker from
plain data (:func:`config_to_dict` / :func:`dict_to_config`, msgpack-able,
no pickle).  Values are converted from the field's type annotation:

* ``int``, ``float``, ``str``, ``pathlib.Path``;
* ``bool``: true/false, 1/0, yes/no, on/off (any case);
* ``Optional[X]``: ``none`` / ``null`` gives None, anything else converts as X;
* ``list[X]`` / ``tuple[X, ...]``: a comma list (``1,2,3``; empty string = empty
  list) or JSON (``[1, 2, 3]``);
* ``dict[str, X]``: JSON, or one entry at a time (``interface_args.temp=0.7``);
* enums (by value or name), ``Literal[...]`` (one of the listed values);
* nested dataclasses: dotted keys, or a JSON object; ``Any``: JSON, else the string.

Field docs come from ``field(metadata={"help": ...})`` and show in
:func:`format_help`.  Every error is a one-line :class:`ConfigError` naming the
key; unknown keys come with the closest valid keys.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import math
import pathlib
import sys
import types
import typing
from typing import Any, Literal, TypeVar, Union

from realflow.api.registry import closest

__all__ = [
    "ConfigError", "parse_overrides", "parse_cli", "format_help", "wants_help", "split_imports", "import_modules",
    "pop_override", "config_to_dict", "dict_to_config", "field_paths",
]

T = TypeVar("T")
_UNSET: Any = object()
_FRESH: Any = object()  # a sub-config the user cleared ("x=none") and then set again ("x.y=1")
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


# ---- building configs ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Node:
    """Pending overrides of one dataclass level; ``base`` replaces the default when set."""

    children: dict[str, Any] = dataclasses.field(default_factory=dict)
    base: Any = _UNSET


@dataclasses.dataclass
class _Leaf:
    value: Any


@dataclasses.dataclass
class _DictPatch:
    items: dict


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


def _materialize(cls: type[T], node: _Node, default: Any, path: str) -> T:
    base = node.base if node.base is not _UNSET else default
    base = base if isinstance(base, cls) else _UNSET  # _FRESH, None or no default: build from cls itself
    fields, hints = _init_fields(cls), _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, child in node.children.items():
        if isinstance(child, _Leaf):
            kwargs[name] = child.value
            continue
        current = getattr(base, name) if base is not _UNSET else _field_default(fields[name])
        if isinstance(child, _Node):
            kwargs[name] = _materialize(_dataclass_of(hints[name]), child, current, f"{path}{name}.")
        else:
            merged = dict(current) if isinstance(current, dict) else {}
            merged.update(child.items)
            kwargs[name] = merged
    return _construct(cls, kwargs, path, base)


def _unknown_key(cls: type, key: str) -> ConfigError:
    paths = field_paths(cls)
    leaf = key.rsplit(".", 1)[-1]
    hint = list(dict.fromkeys(closest(key, paths) + [p for p in paths if p.rsplit(".", 1)[-1] == leaf]))[:4]
    return ConfigError(
        f"unknown config key {key!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
        + " (--help lists every key)"
    )


def _assign(cls: type, root: _Node, key: str, raw: str) -> None:
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"malformed config key {key!r}")
    node, ccls = root, cls
    for depth, name in enumerate(parts):
        fields = _init_fields(ccls)
        if name not in fields:
            raise _unknown_key(cls, key)
        tp = _hints(ccls)[name]
        path = ".".join(parts[: depth + 1])
        rest = parts[depth + 1:]
        if not rest:
            node.children[name] = _Leaf(_convert(raw, tp, path, cli=True))
            return
        sub = _dataclass_of(tp)
        if sub is not None:
            child = node.children.get(name)
            if not isinstance(child, _Node):
                base = child.value if isinstance(child, _Leaf) else _UNSET
                child = _Node(base=_FRESH if base is None else base)  # "x=none x.y=1": x's class defaults
                node.children[name] = child
            node, ccls = child, sub
            continue
        inner, _ = _split_optional(tp)
        if typing.get_origin(inner) is dict or inner is dict:
            vt = (typing.get_args(inner) or (str, Any))[1]
            item = ".".join(rest)
            value = _convert(raw, vt, key, cli=True)
            child = node.children.get(name)
            if isinstance(child, _Leaf):
                child = _DictPatch(dict(child.value or {}))
                node.children[name] = child
            elif not isinstance(child, _DictPatch):
                child = node.children[name] = _DictPatch({})
            child.items[item] = value
            return
        raise ConfigError(f"config key {key!r}: {path} is of type {_type_name(tp)} and has no sub-keys")


def expand_presets(cls: type, argv: list[str]) -> list[str]:
    """``argv`` with each preset key's items (``cls.PRESETS[key][value]``, e.g. ``algorithm=dapo``)
    put first: a preset only sets defaults, every key it sets stays overridable by a later item."""
    presets: dict[str, dict[str, list[str]]] = getattr(cls, "PRESETS", None) or {}
    first: list[str] = []
    for key, table in presets.items():
        chosen = [a.split("=", 1)[1].strip() for a in argv if a.split("=", 1)[0].strip() == key and "=" in a]
        if not chosen or not chosen[-1]:
            continue
        name = chosen[-1]
        if name not in table:
            hint = closest(name, list(table))
            raise ConfigError(f"{key}={name!r} is not a preset; known: {', '.join(table)}"
                              + (f" (did you mean {', '.join(hint)}?)" if hint else ""))
        first += list(table[name])
    return first + list(argv)


def parse_overrides(cls: type[T], argv: list[str], base: T | None = None) -> T:
    """Build ``cls`` (or update ``base``) from ``key=value`` items; later items win. Preset keys
    (``cls.PRESETS``) expand first (see :func:`expand_presets`)."""
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls!r} is not a dataclass config class")
    root = _Node()
    for arg in expand_presets(cls, argv):
        if "=" not in arg:
            extra = " (options: --help, --import MODULE)" if arg.startswith("-") else ""
            raise ConfigError(f"expected key=value, got {arg!r}{extra}")
        key, raw = arg.split("=", 1)
        _assign(cls, root, key.strip(), raw)
    return _materialize(cls, root, base if base is not None else _UNSET, "")


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


# ---- command line -------------------------------------------------------------------------------


def _doc(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    if doc.startswith(cls.__name__ + "("):  # the signature dataclasses generates
        return ""
    return doc.split("\n\n")[0].strip()


def _help_lines(cls: type, prefix: str, default_obj: Any, lines: list[str]) -> None:
    hints = _hints(cls)
    for name, f in _init_fields(cls).items():
        tp = hints[name]
        default = getattr(default_obj, name) if default_obj is not _UNSET else _field_default(f)
        sub = _dataclass_of(tp)
        text = f.metadata.get("help", "")
        if sub is not None:
            lines.append(f"  {prefix}{name}: {_type_name(tp)}" + (" = None" if default is None else ""))
            if text:
                lines.append(f"      {text}")
            if default is None:
                lines.append(f"      (unset; setting any {prefix}{name}.* key enables it with these defaults)")
            _help_lines(sub, f"{prefix}{name}.", default if isinstance(default, sub) else _UNSET, lines)
            continue
        try:
            plain = None if default is _UNSET else _plain(default, prefix + name)
            shown = "(required)" if default is _UNSET else "= " + ("none" if plain is None else json.dumps(plain))
        except ConfigError:
            shown = f"= {default!r}"
        lines.append(f"  {prefix}{name}: {_type_name(tp)} {shown}")
        if text:
            lines.append(f"      {text}")


def format_help(cls: type, prog: str | None = None) -> str:
    """Usage text listing every key (dotted path), its type, default and ``metadata["help"]``."""
    lines = [f"usage: {prog or 'python -m ...'} [--import MODULE ...] [key=value ...]"]
    doc = _doc(cls)
    if doc:
        lines += ["", doc]
    lines += ["", f"{cls.__name__} keys (set with key=value; nested keys with dots):"]
    _help_lines(cls, "", _UNSET, lines)
    for key, table in (getattr(cls, "PRESETS", None) or {}).items():
        lines += ["", f"{key}=NAME presets (each sets these keys first; any of them can still be overridden):"]
        for name, items in table.items():
            lines.append(f"  {key}={name}: {' '.join(items) if items else '(the experiment defaults)'}")
    lines += [
        "",
        "values: bool = true/false/1/0/yes/no; lists = 1,2,3 or JSON; Optional = none; dicts = JSON",
        "--import MODULE  import a plugin module first (repeatable); -h/--help  show this text",
    ]
    return "\n".join(lines)


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def split_imports(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--import MOD`` / ``--import=MOD`` (repeatable) from the other arguments."""
    modules, rest, it = [], [], iter(argv)
    for a in it:
        if a == "--import":
            mod = next(it, None)
            if mod is None or mod.startswith("-") or "=" in mod:
                raise ConfigError("--import needs a module name (e.g. --import my_package.graphs)")
            modules.append(mod)
        elif a.startswith("--import="):
            modules.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return modules, rest


def import_modules(modules: list[str]) -> None:
    """Import plugin modules so that their registrations run; a failure names the module."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as e:
            raise ConfigError(f"--import {mod}: cannot import plugin module {mod!r}: {type(e).__name__}: {e}") from None


def pop_override(argv: list[str], key: str) -> tuple[str | None, list[str]]:
    """Take ``key=value`` out of ``argv`` (last one wins), e.g. ``experiment=`` before picking the class."""
    value, rest = None, []
    for a in argv:
        if a.split("=", 1)[0].strip() == key and "=" in a:
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return value, rest


def parse_cli(cls: type[T], argv: list[str] | None = None, prog: str | None = None, *, exit_on_error: bool = True) -> T:
    """The whole command line: ``--import`` modules, ``--help`` (prints and exits 0), then overrides.

    With ``exit_on_error`` a :class:`ConfigError` prints one line to stderr and exits 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        modules, rest = split_imports(argv)
        import_modules(modules)
        if wants_help(rest):
            print(format_help(cls, prog))
            raise SystemExit(0)
        return parse_overrides(cls, rest)
    except ConfigError as e:
        if not exit_on_error:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
