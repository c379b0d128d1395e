"""The shape of the code, from the AST: ``python benchmarks/code_map.py [--chain]``.

Why a tool and not a picture: the layering (which package may import which) is a rule that a
test holds (tests/test_layering.py, over the same :data:`ALLOWED` table), and the numbers here
-- import cycles, upward dependencies hidden in strings, files over 400 lines, how many files a
newcomer reads from the sync PPO command to the loss -- are what docs/architecture.md and the
issue notes quote. Everything is read from source with :mod:`ast`; nothing is imported.

Packages are the repository's top-level code directories, with ``realflow`` split by its
sub-packages (``realflow.system``, ``realflow.api``, ...): the unit the rules speak of.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP = ("realflow", "parallel", "mfc", "graphs", "experiments", "examples")

#: package -> the packages it may import (besides itself). The rule of docs/architecture.md:
#: experiments -> graphs -> mfc -> parallel -> realflow.api / realflow.base; the runtime
#: (system, rollout, comm, weights, data, scheduler) never imports an algorithm or a model family.
RUNTIME_BASE = {"realflow.api", "realflow.base"}
SERVICES = RUNTIME_BASE | {"realflow.comm", "realflow.config", "realflow.data", "realflow.weights", "realflow.plugins"}
ALLOWED: dict[str, set[str]] = {
    "realflow.base": set(),
    "realflow.api": {"realflow.base"},
    "realflow.comm": RUNTIME_BASE,
    "realflow.config": RUNTIME_BASE,
    "realflow.data": RUNTIME_BASE,
    "realflow.plugins": RUNTIME_BASE,  # names the plugins, imports them at run time
    "realflow.weights": RUNTIME_BASE | {"realflow.comm"},
    "realflow.scheduler": RUNTIME_BASE | {"realflow.comm"},
    "realflow.system": SERVICES | {"realflow.scheduler"},
    "realflow.rollout": SERVICES | {"realflow.system"},  # recover points, the sample log
    "realflow.planner": RUNTIME_BASE | {"realflow.system", "realflow.comm"},  # the plan compiler
    "realflow.apps": {"*realflow"},  # entry points: anything in realflow (plugins come by registration)
    "realflow": {"*realflow"},  # realflow/__init__.py, realflow/plugins.py
    "parallel": RUNTIME_BASE | {"realflow.comm", "realflow.weights"},
    "mfc": RUNTIME_BASE | {"realflow.data"},
    "graphs": RUNTIME_BASE,
    "experiments": {"*realflow", "graphs", "mfc", "parallel"},
    "examples": {"*"},
}
#: the names a lower package must not mention in a string (an import by name hides an upward edge)
UPWARD_NAMES = ("experiments", "graphs", "mfc", "parallel", "examples")
STRING_IMPORT = re.compile(r"^(experiments|graphs|mfc|parallel|examples)(\.[A-Za-z_][\w.]*)?(:[\w.]+)?$")


@dataclass
class Module:
    name: str
    path: Path
    lines: int
    imports: set[str] = field(default_factory=set)  # dotted module names (resolved, within the repo)
    strings: list[tuple[int, str]] = field(default_factory=list)  # (line, text) of module-like strings


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "realflow" and len(parts) > 1:
        sub = parts[1]
        return f"realflow.{sub}" if sub == "plugins" or (REPO / "realflow" / sub).is_dir() else "realflow"
    return parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def scan(repo: Path = REPO) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for top in TOP:
        for path in sorted((repo / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            text = path.read_text()
            name = _module_name(path)
            m = Module(name, path, text.count("\n") + 1)
            tree = ast.parse(text, str(path))
            pkg_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            listed = set()  # bare names count only as list items or import_module()'s argument ("mfc" is
            for node in ast.walk(tree):  # also a payload key)
                if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                    listed.update(id(e) for e in node.elts)
                elif isinstance(node, ast.Call) and "import" in ast.unparse(node.func) and node.args:
                    listed.add(id(node.args[0]))
            typing_only = {id(n) for node in ast.walk(tree)  # `if TYPE_CHECKING:` imports never run
                           if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                           for stmt in node.body for n in ast.walk(stmt)}
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                if isinstance(node, ast.Import):
                    m.imports.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = pkg_parts[:len(pkg_parts) - node.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    m.imports.add(base)
                    m.imports.update(f"{base}.{a.name}" for a in node.names)  # a submodule or a name
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and STRING_IMPORT.match(node.value):
                    if any(c in node.value for c in ".:") or id(node) in listed:
                        m.strings.append((node.lineno, node.value))
            mods[name] = m
    for m in mods.values():  # keep the repository's modules only, the longest known prefix of each
        resolved = set()
        for imp in m.imports:
            parts = imp.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if parts:
                resolved.add(".".join(parts))
        resolved.discard(m.name)
        m.imports = resolved
    return mods


def _allowed(src_pkg: str, dst_pkg: str) -> bool:
    if src_pkg == dst_pkg:
        return True
    rules = ALLOWED.get(src_pkg)
    if rules is None:
        return False
    return ("*" in rules or dst_pkg in rules or ("*realflow" in rules and dst_pkg.startswith("realflow")))


def violations(mods: dict[str, Module]) -> list[str]:
    """Every import that breaks :data:`ALLOWED`, as ``file:  a -> b``."""
    out = []
    for m in mods.values():
        src = package_of(m.name)
        for imp in sorted(m.imports):
            dst = package_of(imp)
            if not _allowed(src, dst):
                out.append(f"{m.path.relative_to(REPO)}: {src} imports {imp} ({dst})")
    return out


def upward_strings(mods: dict[str, Module]) -> list[str]:
    """Strings in lower packages that name a higher one as a module (an import by name)."""
    out = []
    for m in mods.values():
        src = package_of(m.name)
        if src in ("realflow.plugins", "experiments", "examples"):  # plugins.py: the one list of plugins
            continue
        for line, text in m.strings:
            dst = package_of(text.split(":")[0])
            if not _allowed(src, dst):
                out.append(f"{m.path.relative_to(REPO)}:{line}: {text!r}")
    return out


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected groups of modules (import cycles), largest first."""
    import networkx as nx

    g = nx.DiGraph()
    for m in mods.values():
        g.add_node(m.name)
        g.add_edges_from((m.name, i) for i in m.imports)
    return sorted((sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1), key=len, reverse=True)


def chain(mods: dict[str, Module], src: str, dst: str, extra_edges: list[tuple[str, str]] = ()) -> list[str]:
    """The shortest import path ``src`` -> ``dst`` (``extra_edges``: registrations the entry point loads)."""
    import networkx as nx

    g = nx.DiGraph()
    for m in mods.values():
        g.add_edges_from((m.name, i) for i in m.imports)
    g.add_edges_from(extra_edges)
    try:
        return nx.shortest_path(g, src, dst)
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=400, help="report files longer than this many lines")
    args = ap.parse_args(argv)
    mods = scan()
    bad, strs, cyc = violations(mods), upward_strings(mods), cycles(mods)
    long_files = sorted((m for m in mods.values() if m.lines > args.limit), key=lambda m: -m.lines)
    print(f"modules: {len(mods)}, lines: {sum(m.lines for m in mods.values())}")
    print(f"layering violations: {len(bad)}")
    for v in bad:
        print("  " + v)
    print(f"upward string dependencies: {len(strs)}")
    for v in strs:
        print("  " + v)
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print(f"  {len(c)} modules: {', '.join(c[:8])}{' ...' if len(c) > 8 else ''}")
    print(f"files over {args.limit} lines: {len(long_files)}")
    for m in long_files:
        print(f"  {m.lines:5d} {m.path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
