"""Dataclass configs: key=value overrides, typed conversion, errors, --help, --import, dict round trip."""
from __future__ import annotations

import enum
import json
import pathlib
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest

from realflow.config.cli import (
    ConfigError, config_to_dict, dict_to_config, field_paths, format_help, parse_cli, parse_overrides, pop_override,
    split_imports,
)
from realflow.api.experiment import OptimizerConfig


class Backend(enum.Enum):
    MEGATRON = "megatron"
    TORCH = "torch"


@dataclass
class Optim:
    """Optimizer settings."""

    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"


@dataclass
class Model:
    path: str = ""
    optimizer: Optional[Optim] = None
    backend: Backend = Backend.MEGATRON


@dataclass
class Experiment:
    """A test experiment.

    Second paragraph is not shown in --help.
    """

    seed: int = field(default=1, metadata={"help": "global seed"})
    batch_size: int = 8
    ratio: float = 0.5
    trace: bool = True
    name: str = "exp"
    max_steps: Optional[int] = None
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    tags: list[str] = field(default_factory=list)
    dims: tuple[int, ...] = ()
    out: pathlib.Path = pathlib.Path("outputs")
    args: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0})
    budgets: dict[str, int] = field(default_factory=dict)
    actor: Model = field(default_factory=lambda: Model(path="/ckpt/actor", optimizer=Optim(lr=5e-4)),
                         metadata={"help": "the trained policy"})
    ref: Model = field(default_factory=Model)
    extra: Any = None

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


@dataclass
class Required:
    path: str
    n: int = 1


def P(*argv: str) -> Experiment:
    return parse_overrides(Experiment, list(argv))


# ---- overrides -------------------------------------------------------------------------------


def test_defaults_and_scalars():
    assert P() == Experiment()
    c = P("seed=7", "ratio=1e-2", "name=a=b", "out=/tmp/o", "batch_size=1e3", "seed=9")
    assert c.seed == 9 and c.ratio == 0.01 and c.name == "a=b" and c.out == pathlib.Path("/tmp/o")
    assert c.batch_size == 1000


@pytest.mark.parametrize("text, value", [
    ("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("NO", False), ("on", True), ("off", False),
])
def test_bools(text, value):
    assert P(f"trace={text}").trace is value


def test_nested_keeps_parent_defaults():
    c = P("actor.optimizer.lr=1e-4", "actor.backend=torch", "ref.path=/ckpt/ref")
    assert c.actor.path == "/ckpt/actor"  # from the parent's default_factory, not Model()'s ""
    assert c.actor.optimizer == Optim(lr=1e-4) and c.actor.backend is Backend.TORCH
    assert c.ref.path == "/ckpt/ref" and c.ref.optimizer is None


def test_optional_dataclass_enabled_by_sub_key_and_disabled_by_none():
    assert P("ref.optimizer.schedule=linear").ref.optimizer == Optim(schedule="linear")
    assert P("actor.optimizer=none").actor.optimizer is None
    assert P("actor.optimizer=none", "actor.optimizer.lr=2").actor.optimizer == Optim(lr=2.0)
    assert P("actor.optimizer.schedule=linear").actor.optimizer == Optim(lr=5e-4, schedule="linear")
    assert P("actor.optimizer=none", "actor.optimizer.schedule=linear").actor.optimizer == Optim(schedule="linear")
    assert P('actor.optimizer={"lr": 3, "betas": [0.1, 0.2]}').actor.optimizer == Optim(lr=3.0, betas=(0.1, 0.2))
    assert P('actor.optimizer={"lr": 3}', "actor.optimizer.schedule=constant").actor.optimizer == Optim(3.0, schedule="constant")


def test_optional_and_lists():
    assert P("max_steps=10").max_steps == 10 and P("max_steps=None").max_steps is None
    assert P("seeds=3,4, 5").seeds == [3, 4, 5] and P("seeds=[6, 7]").seeds == [6, 7] and P("seeds=").seeds == []
    assert P("tags=a,b").tags == ["a", "b"] and P('tags=["x,y", "z"]').tags == ["x,y", "z"]
    assert P("dims=1,2,3").dims == (1, 2, 3)
    assert P("actor.optimizer.betas=0.8,0.9").actor.optimizer.betas == (0.8, 0.9)


def test_enums_literals_dicts_any():
    assert P("actor.backend=MEGATRON").actor.backend is Backend.MEGATRON
    assert P("actor.optimizer.schedule=linear").actor.optimizer.schedule == "linear"
    assert P('args={"top_p": 0.9}').args == {"top_p": 0.9}
    assert P("args.top_k=50", "args.stop=</s>").args == {"temperature": 1.0, "top_k": 50, "stop": "</s>"}
    assert P("budgets.gen=3").budgets == {"gen": 3}
    assert P("extra=[1, 2]").extra == [1, 2] and P("extra=hello").extra == "hello"


@pytest.mark.parametrize("arg, needle", [
    ("seed=abc", "bad value for seed: expected int, got 'abc'"),
    ("batch_size=1.5", "bad value for batch_size: expected int, got '1.5'"),
    ("ratio=fast", "bad value for ratio: expected float, got 'fast'"),
    ("trace=maybe", "bad value for trace: expected bool, got 'maybe' (use true/false, 1/0 or yes/no)"),
    ("max_steps=ten", "bad value for max_steps: expected int | None, got 'ten'"),
    ("seeds=1,x", "bad value for seeds[1]: expected int, got 'x'"),
    ("seeds=[1,", "bad value for seeds: expected list[int], got '[1,' (invalid JSON"),
    ("dims={}", "bad value for dims"),
    ("actor.backend=jax", "bad value for actor.backend: expected one of {megatron, torch}, got 'jax'"),
    ("actor.optimizer.schedule=step", "expected one of {cosine, linear, constant}, got 'step'"),
    ("actor.optimizer.betas=1,2,3", "needs exactly 2 items"),
    ("budgets.gen=many", "bad value for budgets.gen: expected int"),
    ("args=[1]", "bad value for args: expected dict[str, any (JSON or str)], got [1] (give a JSON object)"),
    ("actor=3", "bad value for actor: expected Model"),
    ("seed.x=1", "config key 'seed.x': seed is of type int and has no sub-keys"),
    ("seed", "expected key=value, got 'seed'"),
    ("--verbose", "expected key=value, got '--verbose' (options: --help, --import MODULE)"),
    ("actor..path=x", "malformed config key 'actor..path'"),
    ("batch_size=0", "invalid config: batch_size must be >= 1, got 0"),
])
def test_bad_values_name_key_type_and_value(arg, needle):
    with pytest.raises(ConfigError) as e:
        P(arg)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("arg, suggestion", [
    ("sed=1", "seed"),
    ("actor.optimizer.lrr=1", "actor.optimizer.lr"),
    ("lr=1", "actor.optimizer.lr, ref.optimizer.lr"),
    ("actor.pth=x", "actor.path"),
    ("batchsize=3", "batch_size"),
])
def test_unknown_keys_suggest_closest(arg, suggestion):
    with pytest.raises(ConfigError) as e:
        P(arg)
    key = arg.split("=")[0]
    assert f"unknown config key {key!r}; did you mean " in str(e.value) and suggestion in str(e.value)


def test_required_fields_and_base():
    with pytest.raises(ConfigError, match="missing required config key\\(s\\): path"):
        parse_overrides(Required, ["n=2"])
    assert parse_overrides(Required, ["path=/x"]) == Required("/x")
    base = P("seed=5")
    assert parse_overrides(Experiment, ["ratio=2"], base=base) == P("seed=5", "ratio=2")
    with pytest.raises(ConfigError, match="not a dataclass"):
        parse_overrides(dict, [])


# ---- dict round trip ---------------------------------------------------------------------------


def test_config_dict_round_trip_via_json():
    c = P("actor.backend=torch", "dims=1,2", "max_steps=3", "args.k=1", "ref.optimizer.lr=0.5", "extra=[1]")
    d = config_to_dict(c)
    assert d["actor"]["backend"] == "torch" and d["dims"] == [1, 2] and d["out"] == "outputs"
    assert d["actor"]["optimizer"]["betas"] == [0.9, 0.95]
    back = dict_to_config(Experiment, json.loads(json.dumps(d)))
    assert back == c
    assert dict_to_config(Experiment, {"seed": 3}) == P("seed=3")
    with pytest.raises(ConfigError, match="unknown config key 'actor.pathh'; did you mean actor.path"):
        dict_to_config(Experiment, {"actor": {"pathh": "x"}})
    with pytest.raises(ConfigError, match="bad value for actor.optimizer.lr: expected float, got 'x'"):
        dict_to_config(Experiment, {"actor": {"optimizer": {"lr": "x"}}})
    with pytest.raises(ConfigError, match="bad value for name: expected str, got 3"):
        dict_to_config(Experiment, {"name": 3})
    with pytest.raises(ConfigError, match="extra of type object is not plain data"):
        config_to_dict(Experiment(extra=object()))


# ---- help and command line ---------------------------------------------------------------------


def test_format_help_lists_every_field():
    text = format_help(Experiment, prog="realflow-test")
    assert text.startswith("usage: realflow-test [--import MODULE ...] [key=value ...]")
    assert "A test experiment." in text and "Second paragraph" not in text
    for path in field_paths(Experiment):
        assert f"  {path}:" in text, path
    assert "  seed: int = 1\n      global seed" in text
    assert "  actor.optimizer.lr: float = 0.0005\n      peak learning rate" in text
    assert "  ref.optimizer.lr: float = 0.001" in text
    assert "  ref.optimizer: Optim | None = None" in text and "setting any ref.optimizer.* key enables it" in text
    assert "  actor: Model\n      the trained policy" in text
    assert "  max_steps: int | None = none" in text
    assert "  seeds: list[int] = [1, 2]" in text and "  dims: tuple[int, ...] = []" in text
    assert "  actor.backend: one of {megatron, torch} = \"megatron\"" in text
    assert "actor.optimizer.schedule: one of {cosine, linear, constant}" in text
    assert "path: str (required)" in format_help(Required)


def test_parse_cli_help_errors_and_imports(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(Experiment, ["seed=2", "--help"], prog="p")
    assert e.value.code == 0 and "actor.optimizer.lr" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        parse_cli(Experiment, ["sed=2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: unknown config key 'sed'") and err.count("\n") == 1
    with pytest.raises(ConfigError, match="--import no_such_mod_xyz: cannot import plugin module 'no_such_mod_xyz'"):
        parse_cli(Experiment, ["--import", "no_such_mod_xyz"], exit_on_error=False)

    (tmp_path / "rf_test_plugin.py").write_text(textwrap.dedent("""
        from realflow.api.registry import Registry
        LOADED = Registry("thing")
        LOADED.register("hello", 42)
    """))
    (tmp_path / "rf_test_broken.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = parse_cli(Experiment, ["--import=rf_test_plugin", "seed=4"])
    import rf_test_plugin

    assert c.seed == 4 and rf_test_plugin.LOADED.get("hello") == 42
    with pytest.raises(ConfigError, match="rf_test_broken.*RuntimeError: boom"):
        parse_cli(Experiment, ["--import", "rf_test_broken"], exit_on_error=False)


def test_split_imports_and_pop_override():
    assert split_imports(["--import", "a", "x=1", "--import=b.c"]) == (["a", "b.c"], ["x=1"])
    with pytest.raises(ConfigError, match="--import needs a module name"):
        split_imports(["--import"])
    with pytest.raises(ConfigError, match="--import needs a module name"):
        split_imports(["--import", "x=1"])
    assert pop_override(["experiment=a", "seed=1", "experiment=b"], "experiment") == ("b", ["seed=1"])
    assert pop_override(["seed=1"], "experiment") == (None, ["seed=1"])


def test_real_experiment_base_config_help():
    exp = pytest.importorskip("realflow.api.experiment")
    text = format_help(exp.BaseExperimentConfig)
    assert "name_resolve.port: int" in text
    c = parse_overrides(exp.BaseExperimentConfig, ["n_workers=4", "name_resolve.type=etcd"])
    assert c.n_workers == 4 and c.name_resolve.type == "etcd"
    assert dict_to_config(exp.BaseExperimentConfig, config_to_dict(c)) == c


@dataclass
class _WithOptimizer:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@pytest.mark.parametrize("arg, needle", [
    ("optimizer.lr_scheduler_type=exp", "lr_scheduler_type='exp': expected cosine | constant | linear"),
    ("optimizer.warmup_steps_proportion=1.5", "warmup_steps_proportion must be in [0, 1)"),
    ("optimizer.min_lr_ratio=-0.1", "min_lr_ratio=-0.1 not in [0, 1]"),
])
def test_optimizer_values_checked_when_parsed(arg, needle):
    """One OptimizerConfig (realflow.api.experiment) carries the checks: a bad value fails at parse time,
    naming the field, not later inside a worker building the optimizer."""
    with pytest.raises(ConfigError) as ei:
        parse_overrides(_WithOptimizer, [arg])
    assert "invalid config: optimizer." + needle in str(ei.value)
    assert parse_overrides(_WithOptimizer, ["optimizer.lr_scheduler_type=linear"]).optimizer.lr_scheduler_type == "linear"
