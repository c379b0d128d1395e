"""Dataclass configs from the command line and config files, without argparse boilerplate.

Every experiment is a (nested) dataclass.  The command line is a list of
``key=value`` overrides on top of its defaults, with dots for nesting, and optionally
``--config FILE`` items (YAML or JSON, :mod:`realflow.config.files`) under them::

    python -m realflow.apps.main_sync_ppo --config run.yaml actor.path=/ckpt/qwen2 optimizer.lr=1e-4 seeds=1,2,3

Why this shape: configs must be complete, typed and documented in one place
(the dataclass), and the same object must be rebuildable inside a worker from
plain data (:func:`config_to_dict` / :func:`dict_to_config`, msgpack-able,
no pickle).  Values are converted from the field's type annotation by the rules of
:mod:`realflow.api.config_values` (bool = true/false/yes/no/1/0, lists = ``1,2,3`` or
JSON, Optional = ``none``, dicts = JSON or one entry at a time, nested dataclasses =
dotted keys or a JSON object).

Field docs come from ``field(metadata={"help": ...})`` and show in
:func:`format_help`.  Every error is a one-line :class:`ConfigError` naming the
key (and, for a key a config file set, the file and line); unknown keys come with the
closest valid keys.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import re
import sys
import typing
from typing import Any, Sequence, TypeVar

from realflow.config.files import Setting, file_settings, split_config_files, split_option
from realflow.api.config_values import (
    _UNSET, ConfigError, _construct, _convert, _dataclass_of, _field_default, _hints, _init_fields, _plain,
    _split_optional, _type_name, config_to_dict, dict_to_config, field_paths,
)
from realflow.api.registry import closest

__all__ = [
    "ConfigError", "parse_overrides", "parse_cli", "format_help", "wants_help", "split_imports", "import_modules",
    "pop_override", "config_to_dict", "dict_to_config", "field_paths", "split_config_files", "expand_presets",
]

T = TypeVar("T")
_FRESH: Any = object()  # a sub-config the user cleared ("x=none") and then set again ("x.y=1")
#: top-level fields that --help lists first: what a user sets before anything else
HELP_FIRST = ("model", "dataset")


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


def _assign(cls: type, root: _Node, key: str, raw: Any, cli: bool = True, text: str | None = None) -> None:
    """Record one setting; ``cli``: ``raw`` is command-line text, else a typed file value (``text``: as written)."""
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
            node.children[name] = _Leaf(_convert(_as_written(raw, tp, text), tp, path, cli))
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
            value = _convert(raw, vt, key, cli)
            child = node.children.get(name)
            if isinstance(child, _Leaf):
                child = _DictPatch(dict(child.value or {}))
                node.children[name] = child
            elif not isinstance(child, _DictPatch):
                child = node.children[name] = _DictPatch({})
            child.items[item] = value
            return
        raise ConfigError(f"config key {key!r}: {path} is of type {_type_name(tp)} and has no sub-keys")


def _as_written(raw: Any, tp: Any, text: str | None) -> Any:
    """A plain YAML scalar given to a str or path field is the text as written: ``trial_name: 007``
    is "007", not the integer 7 (and ``name: yes`` not True)."""
    if text is not None and raw is not None and not isinstance(raw, str):
        if _split_optional(tp)[0] in (str, pathlib.Path):
            return text
    return raw


def _at(where: str, e: ConfigError) -> ConfigError:
    """``e`` with the file and line of the setting that caused it (``conf.yaml:7: ...``)."""
    if not where:
        return e
    out = ConfigError(f"{where}: {e}")
    out.__dict__.update(e.__dict__)
    return out


def _where_named(msg: str, origin: dict[str, str]) -> str:
    """The file:line of the key a config class's own check names (``invalid config: batch_size
    must be >= 1``), when a file set it last; "" when the command line did or no key is named."""
    best = ""
    for key, where in origin.items():
        if where and len(key) > len(best) and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w|\.\w)", msg):
            best = key
    return origin.get(best, "") if best else ""


def _cli_setting(arg: str) -> Setting:
    if "=" not in arg:
        extra = " (options: --help, --import MODULE)" if arg.startswith("-") else ""
        raise ConfigError(f"expected key=value, got {arg!r}{extra}")
    key, raw = arg.split("=", 1)
    return Setting(key.strip(), raw, cli=True)


def _preset_settings(cls: type, settings: list[Setting]) -> list[Setting]:
    """The items of each preset the settings choose (``cls.PRESETS[key][value]``, the last choice wins)."""
    presets: dict[str, dict[str, list[str]]] = getattr(cls, "PRESETS", None) or {}
    first: list[Setting] = []
    for key, table in presets.items():
        chosen = [s for s in settings if s.key == key]
        if not chosen:
            continue
        name = chosen[-1].value.strip() if isinstance(chosen[-1].value, str) else chosen[-1].value
        if name is None or name == "":
            continue
        if not isinstance(name, str) or name not in table:
            hint = closest(str(name), list(table))
            raise _at(chosen[-1].where, ConfigError(
                f"{key}={name!r} is not a preset; known: {', '.join(table)}"
                + (f" (did you mean {', '.join(hint)}?)" if hint else "")))
        first += [_cli_setting(item) for item in table[name]]
    return first


def expand_presets(cls: type, argv: list[str]) -> list[str]:
    """``argv`` with each preset key's items (``cls.PRESETS[key][value]``, e.g. ``algorithm=dapo``)
    put first: a preset only sets defaults, every key it sets stays overridable by a later item."""
    chosen = _preset_settings(cls, [_cli_setting(a) for a in argv if "=" in a])
    return [f"{s.key}={s.value}" for s in chosen] + list(argv)


def parse_overrides(cls: type[T], argv: list[str], base: T | None = None) -> T:
    """Build ``cls`` (or update ``base``) from ``key=value`` items; later items win.

    ``--config FILE`` / ``--config=FILE`` items load YAML or JSON files
    (:mod:`realflow.config.files`) *under* every ``key=value`` item, whatever their
    position: files are the base a command line adjusts, and later files win over earlier
    ones.  Preset keys (``cls.PRESETS``, e.g. ``algorithm=dapo``, from a file or the command
    line) expand before everything (see :func:`expand_presets`).  An error about a key a file
    set names the file and line.
    """
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls!r} is not a dataclass config class")
    files, pairs = split_config_files(argv)
    settings = file_settings(cls, files) + [_cli_setting(a) for a in pairs]
    root = _Node()
    origin: dict[str, str] = {}  # key -> the file:line that set it last ("" = the command line)
    for s in _preset_settings(cls, settings) + settings:
        try:
            _assign(cls, root, s.key, s.value, s.cli, s.text)
        except ConfigError as e:
            raise _at(s.where, e) from None
        origin[s.key] = s.where
    try:
        return _materialize(cls, root, base if base is not None else _UNSET, "")
    except ConfigError as e:
        raise _at(_where_named(str(e), origin), e) from None


# ---- command line -------------------------------------------------------------------------------


def _doc(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    if doc.startswith(cls.__name__ + "("):  # the signature dataclasses generates
        return ""
    return doc.split("\n\n")[0].strip()


def _help_order(fields: dict[str, dataclasses.Field], top: bool) -> list[tuple[str, dataclasses.Field]]:
    """Declaration order, except that at the top :data:`HELP_FIRST` (the model, the data) lead."""
    items = list(fields.items())
    if not top:
        return items
    return sorted(items, key=lambda kv: HELP_FIRST.index(kv[0]) if kv[0] in HELP_FIRST else len(HELP_FIRST))


def _help_lines(cls: type, prefix: str, default_obj: Any, lines: list[str]) -> None:
    hints = _hints(cls)
    for name, f in _help_order(_init_fields(cls), top=not prefix):
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


#: the options of :func:`parse_cli`, as (flag, what it does) rows of the --help options block
DEFAULT_OPTIONS: tuple[tuple[str, str], ...] = (
    ("--config FILE", "a YAML or JSON config file (repeatable: later files win; key=value items win over files)"),
    ("--import MODULE", "import a plugin module first (repeatable)"),
    ("-h, --help", "show this text"),
)


def format_help(cls: type, prog: str | None = None, *, usage: str | None = None,
                options: Sequence[tuple[str, str]] = DEFAULT_OPTIONS) -> str:
    """Usage text listing every key (dotted path), its type, default and ``metadata["help"]``.

    ``usage`` replaces the first line and ``options`` the options block, for an entry point
    with options of its own (the launcher's --check, --dry-run, ...); keys of the fields in
    :data:`HELP_FIRST` come first, the rest in declaration order.
    """
    lines = [usage or f"usage: {prog or 'python -m ...'} [--import MODULE ...] [key=value ...] [--config FILE ...]"]
    doc = _doc(cls)
    if doc:
        lines += ["", doc]
    if options:
        width = max(len(flag) for flag, _ in options)
        lines += ["", "options:"]
        for flag, what in options:  # a description's further lines line up under its first
            first, *more = what.split("\n")
            lines += [f"  {flag.ljust(width)}  {first}"] + [" " * (width + 4) + m.strip() for m in more]
    lines += ["", f"{cls.__name__} keys (set with key=value; nested keys with dots; in a --config file as nested "
                  "mappings or dotted keys):"]
    _help_lines(cls, "", _UNSET, lines)
    for key, table in (getattr(cls, "PRESETS", None) or {}).items():
        lines += ["", f"{key}=NAME presets (each sets these keys first; any of them can still be overridden):"]
        for name, items in table.items():
            lines.append(f"  {key}={name}: {' '.join(items) if items else '(the experiment defaults)'}")
    lines += ["", "values: bool = true/false/1/0/yes/no; lists = 1,2,3 or JSON; Optional = none; dicts = JSON"]
    return "\n".join(lines)


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def split_imports(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--import MOD`` / ``--import=MOD`` (repeatable) from the other arguments."""
    return split_option(argv, "--import", "a module name (e.g. --import my_package.graphs)")


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
    """The whole command line: ``--import`` modules, ``--help`` (prints and exits 0), then
    ``--config`` files and ``key=value`` overrides (:func:`parse_overrides`).

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
