"""StatsLogger's optional W&B sink, checked on the files an offline W&B run leaves on disk.

wandb >= 0.2x no longer ships a Python reader for its ``.wandb`` files (the Go core writes
them), so ``_wandb_records`` below reads the format itself: a 7-byte header, then
LevelDB-log records (32 KiB blocks; chunk header crc32, length, type) of protobuf ``Record``s.
"""
from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from realflow.config.cli import ConfigError, import_modules, parse_overrides
from realflow.api.experiment import experiment_registry
from realflow.base.stats import StatsLogger, read_jsonl
from realflow.base.wandb_sink import RUN_ID_FILE, WandbConfig, check_installed, import_wandb

pytestmark = pytest.mark.timeout(120)
wandb = pytest.importorskip("wandb")

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pos, partial = [], 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            partial = chunk
        elif kind == _MIDDLE:
            partial += chunk
        elif kind == _LAST:
            records.append(partial + chunk)
    out = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def _history(records) -> dict[int, dict[str, float]]:
    """step -> {key: value} of every history record (what ``run.log(..., step=)`` sent)."""
    rows = {}
    for rec in records:
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        rows.setdefault(int(row.pop("_step")), {}).update(
            {k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def _offline_run(run_dir: Path, run_id: str, nth: int = 0) -> Path:
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) > nth, list((run_dir / "wandb").iterdir())
    files = list(runs[nth].glob("*.wandb"))
    assert files == [runs[nth] / f"run-{run_id}.wandb"], files
    return files[0]


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_default"))  # unused: wandb.dir defaults to the run dir
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    return tmp_path


def _next_wall_second() -> None:
    time.sleep(1.0 - time.time() % 1.0 + 0.05)


def test_offline_run_logs_every_row_and_a_relaunch_resumes_the_same_run(offline_env):
    run_dir = offline_env / "exp" / "trial0"
    cfg = WandbConfig(mode="offline", tags=["unit"])
    config = {"seed": 7, "optimizer": {"lr": 0.003}}
    with StatsLogger(run_dir, tensorboard=False, wandb=cfg, run_name="exp/trial0", config=config) as sl:
        for step in range(1, 4):
            sl.log(step, {"loss": 1.0 / step, "reward": 0.25 * step}, prefix="actor_train")
        sl.log(3, {"accuracy": 0.5}, prefix="eval")
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    records = _wandb_records(_offline_run(run_dir, run_id))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == run_id and run.display_name == "exp/trial0" and list(run.tags) == ["unit"]
    conf = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert conf["seed"] == 7 and conf["optimizer"] == {"lr": 0.003}
    hist = _history(records)
    assert sorted(hist) == [1, 2, 3]
    assert hist[2] == {"actor_train/loss": 0.5, "actor_train/reward": 0.5}
    assert hist[3] == {"actor_train/loss": pytest.approx(1 / 3), "actor_train/reward": 0.75, "eval/accuracy": 0.5}
    assert [r["step"] for r in read_jsonl(run_dir / "stats.jsonl")] == [1, 2, 3, 3]  # the jsonl is unchanged

    # a relaunch from the recover point of step 2 continues the same W&B run id. W&B names an
    # offline attempt's directory offline-run-<YYYYmmdd_HHMMSS>-<id>: a relaunch within the same
    # second (only possible here, real relaunches take seconds) would share the first one's
    _next_wall_second()
    with StatsLogger(run_dir, tensorboard=False, wandb=cfg, run_name="exp/trial0", config=config,
                     resume_step=2) as sl:
        sl.log(3, {"loss": 0.125}, prefix="actor_train")
    assert (run_dir / RUN_ID_FILE).read_text().strip() == run_id
    # W&B's service process writes the file: under load its last record can land just after
    # finish() returns (seen once in a full suite: the file there, its history still empty)
    deadline = time.monotonic() + 20
    while True:
        resumed = _history(_wandb_records(_offline_run(run_dir, run_id, nth=1)))
        if resumed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert resumed == {3: {"actor_train/loss": 0.125}}
    assert [(r["step"], r.get("actor_train/loss")) for r in read_jsonl(run_dir / "stats.jsonl")] == [
        (1, 1.0), (2, 0.5), (3, 0.125)]

    # a fresh run of the same trial is a new W&B run
    StatsLogger(run_dir, tensorboard=False, wandb=cfg).close()
    assert (run_dir / RUN_ID_FILE).read_text().strip() != run_id


def test_disabled_by_default_writes_no_wandb_files(tmp_path):
    with StatsLogger(tmp_path, tensorboard=False) as sl:
        sl.log(0, {"x": 1.0})
    assert not (tmp_path / "wandb").exists() and not (tmp_path / RUN_ID_FILE).exists()


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"wandb.mode='onlin' is not a mode; choose one of disabled, online, offline"):
        WandbConfig(mode="onlin")
    import_modules(["experiments"])
    with pytest.raises(ConfigError, match=r"^invalid config: wandb.mode='bogus' is not a mode"):
        parse_overrides(experiment_registry.get("sft"), ["wandb.mode=bogus"])


@pytest.mark.parametrize("experiment", ["sft", "grpo-math", "async-grpo-math"])
def test_every_experiment_takes_wandb_overrides_into_its_setup(experiment, tmp_path):
    import_modules(["experiments"])
    cls = experiment_registry.get(experiment)
    setup = parse_overrides(cls, [f"fileroot={tmp_path}", "wandb.mode=offline", "wandb.project=p",
                                  "wandb.tags=a,b", "wandb.group=seeds"]).setup()
    assert setup.wandb == WandbConfig(mode="offline", project="p", tags=["a", "b"], group="seeds")
    assert setup.experiment_config["wandb"]["mode"] == "offline" and setup.experiment_config["fileroot"] == str(tmp_path)
    json.dumps(setup.experiment_config)  # plain data, as W&B stores it
    assert parse_overrides(cls, [f"fileroot={tmp_path}"]).setup().experiment_config == {}  # off: nothing copied


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        import_wandb()
    with pytest.raises(ImportError, match=r'wandb.mode=online needs the wandb package.*pip install -e "\.\[wandb\]"'):
        check_installed(WandbConfig(mode="online"))
    check_installed(WandbConfig())  # disabled: no package needed
