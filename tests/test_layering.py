"""The layering holds: which package imports which, read from the AST (benchmarks/code_map.py).

Why a test: "dependencies point one way" (experiments -> graphs -> mfc -> parallel -> realflow.api
/ realflow.base; the runtime never names an algorithm or a model family) is easy to break with one
convenient import, and a broken rule is found months later as an import cycle or a runtime that
cannot run without one experiment. The rule table is ``code_map.ALLOWED``; docs/architecture.md
prints the same table.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def code_map():
    spec = importlib.util.spec_from_file_location("code_map", REPO / "benchmarks" / "code_map.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["code_map"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mods(code_map):
    return code_map.scan()


def test_every_package_imports_only_what_the_table_allows(code_map, mods):
    assert code_map.violations(mods) == []


def test_the_runtime_names_no_plugin_in_a_string(code_map, mods):
    """An import by name (``import_module("experiments")``) is an upward edge the AST cannot see
    as one; only realflow/plugins.py may name plugin modules."""
    assert code_map.upward_strings(mods) == []


def test_import_cycles_are_only_factory_registries(code_map, mods):
    """A registry package (the schedulers, the name-resolution backends) imports its backends
    lazily by name and they import its base: that circle is by design. Any other is a bug."""
    registries = {"realflow.scheduler", "realflow.base.name_resolve"}
    others = [c for c in code_map.cycles(mods) if not any(m in registries for m in c)]
    known = [["parallel.critic", "parallel.hf_io", "parallel.hf_layout"]]  # HF loading <-> layouts (lazy)
    assert [c for c in others if c not in known] == []


def test_every_package_is_in_the_table(code_map, mods):
    """A new package must say what it may import (add it to code_map.ALLOWED and the docs)."""
    pkgs = {code_map.package_of(m) for m in mods}
    assert pkgs - set(code_map.ALLOWED) == set()


def test_the_checker_sees_a_violation(code_map, tmp_path):
    """The scanner is not vacuous: a runtime module importing an experiment and naming mfc in an
    import_module call is reported, with file and names."""
    (tmp_path / "realflow" / "system").mkdir(parents=True)
    (tmp_path / "realflow" / "base").mkdir(parents=True)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "realflow" / "__init__.py").write_text("")
    (tmp_path / "realflow" / "system" / "__init__.py").write_text("")
    (tmp_path / "realflow" / "base" / "__init__.py").write_text("")
    (tmp_path / "experiments" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "realflow" / "system" / "bad.py").write_text(
        "import importlib\nfrom experiments import X\nimportlib.import_module('mfc.ppo_actor')\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from realflow.system import bad\n")
    old = code_map.REPO
    code_map.REPO = tmp_path
    try:
        mods = code_map.scan(tmp_path)
        assert code_map.violations(mods) == ["realflow/system/bad.py: realflow.system imports experiments (experiments)"]
        assert code_map.upward_strings(mods) == ["realflow/system/bad.py:3: 'mfc.ppo_actor'"]
    finally:
        code_map.REPO = old
