"""Config files (``--config FILE``): YAML and JSON, nested or dotted keys, several files and
key=value overrides on top, errors with file:line, presets, and the resolved config's round trip."""
from __future__ import annotations

import enum
import json
import pathlib
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from realflow.config.cli import ConfigError, config_to_dict, parse_overrides
from realflow.config.files import dump_config, experiment_of, load_config_file, split_config_files, write_config


class Backend(enum.Enum):
    MEGATRON = "megatron"
    TORCH = "torch"


@dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass
class Data:
    train_path: str = ""
    n_train: int = 100
    fields: dict[str, str] = field(default_factory=lambda: {"prompt": "question", "answer": "answer"})


@dataclass
class Exp:
    """A test experiment."""

    seed: int = 1
    batch_size: int = 8
    name: str = "exp"
    tags: list[str] = field(default_factory=list)
    out: pathlib.Path = pathlib.Path("outputs")
    backend: Backend = Backend.MEGATRON
    max_steps: Optional[int] = None
    dataset: Data = field(default_factory=Data)
    optimizer: Optional[Optim] = None
    extra: Any = None

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


def write(tmp_path: pathlib.Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(path)


def P(*argv: str) -> Exp:
    return parse_overrides(Exp, list(argv))


def error(*argv: str) -> str:
    with pytest.raises(ConfigError) as e:
        P(*argv)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---- reading ------------------------------------------------------------------------------------


def test_yaml_nested_and_dotted_keys_mean_the_same(tmp_path):
    nested = write(tmp_path, "nested.yaml", """
        seed: 3
        dataset:
          train_path: /data/train.jsonl
          n_train: 50
        optimizer:
          lr: 1.0e-4
    """)
    dotted = write(tmp_path, "dotted.yaml", """
        seed: 3
        dataset.train_path: /data/train.jsonl
        dataset.n_train: 50
        optimizer.lr: 1.0e-4
    """)
    expected = P("seed=3", "dataset.train_path=/data/train.jsonl", "dataset.n_train=50", "optimizer.lr=1e-4")
    assert P("--config", nested) == expected
    assert P(f"--config={dotted}") == expected
    assert expected.dataset.fields == Data().fields  # a nested mapping sets keys; the others keep defaults


def test_json_file(tmp_path):
    path = write(tmp_path, "conf.json", """
        {
          "seed": 4,
          "dataset": {"n_train": 7, "fields": {"prompt": "q"}},
          "optimizer.betas": [0.8, 0.9],
          "extra": {"k": [1, 2]}
        }
    """)
    c = P("--config", path)
    assert c.seed == 4 and c.dataset.n_train == 7 and c.optimizer == Optim(betas=(0.8, 0.9))
    assert c.dataset.fields == {"prompt": "q"}  # a mapping given to a dict field replaces the dict
    assert c.extra == {"k": [1, 2]}


def test_values_are_typed_file_values(tmp_path):
    path = write(tmp_path, "typed.yaml", """
        tags: ["a,b", c]          # a YAML list stays a list: no comma splitting
        name: 007                 # a plain scalar given to a str field is the text as written
        out: /tmp/run
        backend: torch
        max_steps: null
        dataset.fields.answer: solution   # one entry of a dict field
        optimizer: {}             # an unset sub-config, enabled with its defaults
    """)
    c = P("--config", path)
    assert c.tags == ["a,b", "c"] and c.name == "007" and c.out == pathlib.Path("/tmp/run")
    assert c.backend is Backend.TORCH and c.max_steps is None and c.optimizer == Optim()
    assert c.dataset.fields == {"prompt": "question", "answer": "solution"}
    assert P("--config", write(tmp_path, "empty.yaml", "")) == Exp()


def test_several_files_later_wins_and_overrides_win_over_files(tmp_path):
    base = write(tmp_path, "base.yaml", """
        seed: 1
        batch_size: 16
        dataset: {n_train: 10, train_path: base.jsonl}
    """)
    small = write(tmp_path, "small.json", '{"seed": 2, "dataset": {"n_train": 20}}')
    c = P("--config", base, "--config", small)
    assert (c.seed, c.batch_size, c.dataset.n_train, c.dataset.train_path) == (2, 16, 20, "base.jsonl")
    # key=value wins over every file, wherever it stands on the command line
    c = P("seed=9", "--config", base, "dataset.n_train=30", "--config", small)
    assert (c.seed, c.batch_size, c.dataset.n_train) == (9, 16, 30)


def test_experiment_key_selects_and_is_not_a_config_key(tmp_path):
    a = write(tmp_path, "a.yaml", "experiment: sft\nseed: 2\n")
    b = write(tmp_path, "b.yaml", "seed: 3\n")
    c = write(tmp_path, "c.yaml", "# a comment\nexperiment: grpo-math\n")
    assert experiment_of([a, b]) == ("sft", f"{a}:1")
    assert experiment_of([a, b, c]) == ("grpo-math", f"{c}:2")
    assert experiment_of([b]) is None
    assert P("--config", a).seed == 2
    with pytest.raises(ConfigError, match=r"bad.yaml:1: experiment: expected the name of a registered experiment"):
        load_config_file(write(tmp_path, "bad.yaml", "experiment: [sft]\n"))


def test_split_config_files():
    assert split_config_files(["--config", "a.yaml", "x=1", "--config=b.json"]) == (["a.yaml", "b.json"], ["x=1"])
    with pytest.raises(ConfigError, match="--config needs a file"):
        split_config_files(["--config"])


# ---- errors -------------------------------------------------------------------------------------


def test_unknown_key_names_file_line_and_closest_keys(tmp_path):
    path = write(tmp_path, "conf.yaml", """
        seed: 1
        # the data
        dataset:
          n_train: 5

          trian_path: /x
    """)
    msg = error("--config", path)
    assert msg.startswith(f"{path}:6: unknown config key 'dataset.trian_path'; did you mean ")
    assert "dataset.train_path" in msg
    dotted = write(tmp_path, "dotted.yaml", "seed: 1\nbatchsize: 3\n")
    assert error("--config", dotted).startswith(f"{dotted}:2: unknown config key 'batchsize'; did you mean batch_size")
    js = write(tmp_path, "conf.json", '{\n  "seed": 1,\n  "dataset": {\n    "n_train": 2,\n'
                                      '    "trian_path": "x"\n  }\n}\n')
    assert error("--config", js).startswith(f"{js}:5: unknown config key 'dataset.trian_path'; did you mean ")
    whole = write(tmp_path, "whole.yaml", "datset:\n  n_train: 3\n")
    assert error("--config", whole).startswith(f"{whole}:1: unknown config key 'datset'; did you mean dataset")


def test_bad_value_names_file_line_and_expected_type(tmp_path):
    path = write(tmp_path, "conf.yaml", """
        seed: 1
        dataset:
          n_train: many
    """)
    assert error("--config", path) == f"{path}:3: bad value for dataset.n_train: expected int, got 'many'"
    js = write(tmp_path, "conf.json", '{\n  "tags": "a",\n  "name": 3\n}')
    assert error("--config", js).startswith(f"{js}:2: bad value for tags: expected list[str], got 'a'")
    checked = write(tmp_path, "checked.yaml", "seed: 2\nbatch_size: 0\n")  # the class's own check
    assert error("--config", checked) == f"{checked}:2: invalid config: batch_size must be >= 1, got 0"
    assert error("--config", checked, "batch_size=-1") == "invalid config: batch_size must be >= 1, got -1"


@pytest.mark.parametrize("name, text, needle", [
    ("broken.yaml", "seed: 1\ndataset: [1, 2\n  n: 3\n", ":3: cannot parse YAML: expected ',' or ']', but got ':'"),
    ("tabs.yaml", "seed: 1\ndataset:\n\tn_train: 3\n", ":3: cannot parse YAML: found character '\\t'"),
    ("broken.json", '{\n  "seed": 1,\n  "batch_size" 4\n}\n', ":3: cannot parse JSON: Expecting ':' delimiter"),
    ("list.yaml", "- seed\n- 1\n", ":1: a config file must be a mapping of keys to values, got a list"),
    ("unsafe.yaml", "seed: !!python/object:os.system {}\n", ":1: cannot parse YAML: could not determine a constructor"),
])
def test_unparsable_file_is_one_line_with_file_and_line(tmp_path, name, text, needle):
    path = write(tmp_path, name, text)
    assert error("--config", path).startswith(path + needle)


def test_missing_file_is_one_line(tmp_path):
    assert error("--config", str(tmp_path / "nope.yaml")) == f"--config {tmp_path / 'nope.yaml'}: no such file"
    assert error("--config", str(tmp_path)).endswith("is a directory, not a config file")


# ---- presets and real experiments ---------------------------------------------------------------


@pytest.fixture(scope="module")
def registry():
    pytest.importorskip("torch")
    import experiments  # noqa: F401  (registers the built-in experiments)
    from realflow.api.experiment import experiment_registry

    return experiment_registry


def test_preset_from_a_file_like_on_the_command_line(tmp_path, registry):
    cls = registry.get("grpo-math")
    path = write(tmp_path, "dapo.yaml", """
        algorithm: dapo
        ppo:
          eps_clip_high: 0.3
    """)
    from_file = parse_overrides(cls, ["--config", path])
    assert from_file == parse_overrides(cls, ["algorithm=dapo", "ppo.eps_clip_high=0.3"])
    assert from_file.ppo.dynamic_sampling is True and from_file.ppo.eps_clip_high == 0.3
    # the command line's preset wins over the file's; the file's own keys still win over the preset's
    assert (parse_overrides(cls, ["--config", path, "algorithm=gspo"])
            == parse_overrides(cls, ["algorithm=gspo", "ppo.eps_clip_high=0.3"]))
    bad = write(tmp_path, "bad.yaml", "seed: 1\nalgorithm: dapoo\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:2: algorithm='dapoo' is not a preset; known: .*did you mean dapo"):
        parse_overrides(cls, ["--config", bad])


def test_written_config_loads_back_to_the_same_config(tmp_path, registry):
    """The run directory's config.yaml (and --print-config) of every built-in experiment and of a
    preset loads back with --config to the same config."""
    for name in registry.names():
        cls = registry.get(name)
        argv = ["seed=5", "trial_name=t-1", "allocation=d2"]
        if "algorithm" in (getattr(cls, "PRESETS", None) or {}):
            argv.append("algorithm=dapo" if name != "ppo-math" else "algorithm=ppo")
        cfg = parse_overrides(cls, argv)
        path = write_config(str(tmp_path / name / "config.yaml"), dump_config(cfg, name))
        assert load_config_file(path).experiment == name
        back = parse_overrides(cls, [f"--config={path}"])
        assert config_to_dict(back) == config_to_dict(cfg) and back == cfg, name


def test_round_trip_of_every_value_kind(tmp_path):
    cfg = P("name=yes", "tags=1.0,null", "out=/o", "backend=torch", "max_steps=3", "optimizer.betas=0.5,0.6",
            'dataset.fields={"a": "1e-4"}', 'extra={"x": [1, "2", null]}', "dataset.train_path=")
    text = dump_config(cfg)
    assert "experiment:" not in text
    path = write(tmp_path, "back.yaml", text)
    assert P("--config", path) == cfg
    js = write(tmp_path, "back.json", json.dumps(config_to_dict(cfg)))
    assert P("--config", js) == cfg
