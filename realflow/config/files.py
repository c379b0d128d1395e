"""Config files: ``--config FILE`` (YAML or JSON), the base that ``key=value`` overrides adjust.

    python -m realflow.apps.main_sft --config base.yaml --config small.json optimizer.lr=1e-4

A file is a mapping of config keys, nested (``dataset: {train_path: x}``) or dotted
(``dataset.train_path: x``), or both; a top-level ``experiment: NAME`` selects the
experiment (a command-line ``experiment=`` wins).  Several files apply in order, later ones
winning, and ``key=value`` items win over every file.  Values are typed YAML/JSON values,
converted by the rules for plain data (:mod:`realflow.api.config_values`): a list stays a
list, ``algorithm: dapo`` expands its preset as on the command line.  A mapping given to a
field that is itself a config (a dataclass) sets its keys one by one, like dotted keys; a
mapping given to a ``dict`` field replaces the whole dict.

Why line numbers: config files grow long and are shared, and an error that names only the
key leaves the user to search several files, so every error about a key a file set names
the file and the line (``conf.yaml:7: unknown config key 'dataset.trian_path'; did you mean
dataset.train_path?``).  PyYAML's composed nodes carry the marks; for JSON a small scan of
the (already valid) text finds each key's line.

The resolved config goes back out as YAML (:func:`dump_config`): the run directory's
``config.yaml`` and ``--print-config``; ``--config`` loads it back to the same config.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Optional

import yaml

from realflow.api.config_values import ConfigError, _dataclass_of, _hints, _init_fields, config_to_dict

__all__ = ["Setting", "ConfigFile", "split_config_files", "load_config_file", "experiment_of", "file_settings",
           "dump_config", "write_config", "EXPERIMENT_KEY"]

#: the top-level key of a file that names the experiment rather than setting a config field
EXPERIMENT_KEY = "experiment"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One key set by a config file or the command line, before conversion.

    ``value`` is command-line text when ``cli``, else a typed file value; ``where`` is the
    file and line that set it (``conf.yaml:7``; "" on the command line); ``text`` is a plain
    (unquoted) YAML scalar as written, so that ``trial_name: 007`` can stay "007".
    """

    key: str
    value: Any
    where: str = ""
    text: Optional[str] = None
    cli: bool = False


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A key of a file as written: its line and value, and its own entries when it is a mapping."""

    key: str
    value: Any
    line: int
    text: Optional[str] = None
    children: Optional[tuple["_Entry", ...]] = None


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    path: str
    experiment: Optional[str]  # its top-level `experiment: NAME`
    entries: tuple[_Entry, ...]  # every other key
    experiment_at: str = ""  # file:line of `experiment:`


def split_option(argv: list[str], flag: str, example: str) -> tuple[list[str], list[str]]:
    """Separate a repeatable ``FLAG VALUE`` / ``FLAG=VALUE`` option (values in order) from the other
    arguments; a flag without a value is an error showing ``example``."""
    values, rest, it = [], [], iter(argv)
    for a in it:
        if a == flag:
            value = next(it, None)
            if value is None or value.startswith("-") or "=" in value:
                raise ConfigError(f"{flag} needs {example}")
            values.append(value)
        elif a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return values, rest


def split_config_files(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--config FILE`` / ``--config=FILE`` (repeatable, in order) from the other arguments."""
    return split_option(argv, "--config", "a file (e.g. --config run.yaml)")


def load_config_file(path: str) -> ConfigFile:
    """Parse one file (JSON by a ``.json`` name or a leading ``{``, else YAML); every error is one line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json" or (ext not in (".yaml", ".yml") and text.lstrip().startswith("{")):
        try:
            entries = _json_entries(path, text)
        except ConfigError:
            if ext == ".json":
                raise
            entries = _yaml_entries(path, text)  # a YAML flow mapping also starts with "{"
    else:
        entries = _yaml_entries(path, text)
    experiment, at = None, ""
    for e in entries:
        if e.key == EXPERIMENT_KEY:
            if not isinstance(e.value, str) or not e.value.strip():
                raise ConfigError(f"{path}:{e.line}: {EXPERIMENT_KEY}: expected the name of a registered experiment, "
                                  f"got {e.value!r}")
            experiment, at = e.value.strip(), f"{path}:{e.line}"
    return ConfigFile(path, experiment, tuple(e for e in entries if e.key != EXPERIMENT_KEY), at)


def experiment_of(paths: list[str]) -> Optional[tuple[str, str]]:
    """The experiment the files name (``experiment: NAME``; the last file naming one wins) and the
    file:line that names it, or None."""
    named = [(f.experiment, f.experiment_at) for f in map(load_config_file, paths) if f.experiment]
    return named[-1] if named else None


def file_settings(cls: type, paths: list[str]) -> list[Setting]:
    """Every key the files set for config class ``cls``, in order, as dotted keys with file:line.

    A mapping under a key that names a nested config is walked into; any other value (a
    ``dict`` field's mapping, an unknown key's) stays one setting, so that converting it
    reports the key as written.
    """
    out: list[Setting] = []
    for path in paths:
        out += _leaves(cls, load_config_file(path).entries, "", path)
    return out


def _leaves(cls: type, entries: tuple[_Entry, ...], prefix: str, path: str) -> list[Setting]:
    out: list[Setting] = []
    for e in entries:
        key = prefix + e.key
        if e.children and _config_class_at(cls, key) is not None:
            out += _leaves(cls, e.children, key + ".", path)
        else:
            out.append(Setting(key, e.value, f"{path}:{e.line}", e.text))
    return out


def _config_class_at(cls: type, key: str) -> Optional[type]:
    """The dataclass type of dotted ``key`` in ``cls``, or None (not a nested config, or unknown)."""
    current: Optional[type] = cls
    for part in key.split("."):
        if current is None or part not in _init_fields(current):
            return None
        current = _dataclass_of(_hints(current)[part])
    return current


# ---- YAML ---------------------------------------------------------------------------------------


def _yaml_entries(path: str, text: str) -> tuple[_Entry, ...]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:  # an empty file sets nothing
            return ()
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: a config file must be a mapping of keys to values, "
                              f"got {_yaml_kind(node)}")
        return _yaml_mapping(loader, node, path)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        why = " ".join(str(e.problem or e.context or "invalid YAML").split())
        raise ConfigError(f"{path}:{mark.line + 1 if mark else 1}: cannot parse YAML: {why}") from None
    except yaml.YAMLError as e:  # e.g. a control character the reader refuses
        raise ConfigError(f"{path}: cannot parse YAML: {' '.join(str(e).split())}") from None
    finally:
        loader.dispose()


def _yaml_kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"the value {node.value!r}" if isinstance(node, yaml.ScalarNode) else type(node).__name__


def _yaml_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, path: str) -> tuple[_Entry, ...]:
    loader.flatten_mapping(node)  # "<<: *base" merge keys
    out = []
    for knode, vnode in node.value:
        if not isinstance(knode, yaml.ScalarNode):
            raise ConfigError(f"{path}:{knode.start_mark.line + 1}: a config key must be a name, "
                              f"got {_yaml_kind(knode)}")
        value = loader.construct_object(vnode, deep=True)
        plain = isinstance(vnode, yaml.ScalarNode) and vnode.style is None
        children = _yaml_mapping(loader, vnode, path) if isinstance(vnode, yaml.MappingNode) else None
        out.append(_Entry(str(knode.value), value, knode.start_mark.line + 1, vnode.value if plain else None, children))
    return tuple(out)


# ---- JSON ---------------------------------------------------------------------------------------


def _json_entries(path: str, text: str) -> tuple[_Entry, ...]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: cannot parse JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a config file must be a mapping of keys to values, got {type(data).__name__}")
    lines = _json_key_lines(text)

    def entries(obj: dict, at: tuple) -> tuple[_Entry, ...]:
        return tuple(_Entry(k, v, lines.get(at + (k,), 1), None, entries(v, at + (k,)) if isinstance(v, dict) else None)
                     for k, v in obj.items())

    return entries(data, ())


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]')


def _json_key_lines(text: str) -> dict[tuple, int]:
    """The line of each object key of valid JSON ``text``, by its path of keys (inside lists: skipped)."""
    lines: dict[tuple, int] = {}
    stack: list[list] = []  # [is_object, path, last key, expecting a key]
    line, pos = 1, 0
    for m in _JSON_TOKEN.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        tok = m.group()
        top = stack[-1] if stack else None
        if tok in "{[":
            if top is None:
                path: Optional[tuple] = ()
            elif top[0] and top[1] is not None:
                path = top[1] + (top[2],)
            else:
                path = None  # inside a list: its objects are values, not config keys
            stack.append([tok == "{", path, None, tok == "{"])
        elif tok in "}]":
            stack.pop()
        elif tok == ",":
            if top is not None and top[0]:
                top[3] = True
        elif tok == ":":
            top[3] = False
        elif top is not None and top[0] and top[3]:  # a key
            top[2] = json.loads(tok)
            if top[1] is not None:
                lines[top[1] + (top[2],)] = line
    return lines


# ---- writing ------------------------------------------------------------------------------------


def dump_config(cfg: Any, experiment: Optional[str] = None) -> str:
    """``cfg`` as YAML (``experiment: NAME`` first) that ``--config`` loads back to the same config."""
    data: dict[str, Any] = {EXPERIMENT_KEY: experiment} if experiment else {}
    data.update(config_to_dict(cfg))
    header = ("# the resolved realflow config (defaults, --config files, key=value overrides);\n"
              "# run it again with: python -m realflow.apps.main --config FILE [key=value ...]\n")
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)


def write_config(path: str, resolved: str) -> str:
    """Write a :func:`dump_config` text to ``path``, atomically (a crash leaves the old file or the new
    one, never half of one: the processes of a run, and its relaunches, read it); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(resolved)
    os.replace(tmp, path)
    return path
