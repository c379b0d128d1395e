"""The bad-input corpus (``tests/bad_inputs/``, one file per case; see its README.md).

Every case must be refused with ONE line that names the culprit -- the field for a
config, file and line for data, the MFC and key for a graph, the file for a
checkpoint, the field for an HTTP request -- with no traceback and within seconds.
Command lines run through the real launcher entry point with ``--check`` (everything
is checked, no worker starts); HTTP requests go to a real gen server process and a
rollout controller serving on a real socket.
"""
from __future__ import annotations

import asyncio
import base64
import glob
import json
import os
import shutil
import threading
import time

import pytest
import requests

from realflow.apps.launch import main as launch_main

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bad_inputs")
APPS = {"sft": "main_sft", "ppo-math": "main_sync_ppo", "grpo-math": "main_sync_ppo",
        "async-grpo-math": "main_async_ppo"}
#: how long refusing one case may take (a hang, or a check that waits for training, fails it)
CASE_LIMIT_S = 10.0
#: RL experiments start from the shared SFT checkpoint on a small generated data set
RL_BASE = ["model.path={ckpt}", "dataset.n_train=64", "dataset.n_test=16"]


def _cases(kind: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, kind, pattern)))


def _id(path: str) -> str:
    return os.path.relpath(path, HERE)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, str]:
    """A prepared SFT fileroot (data, tokenizer, initial checkpoint) every case may point at."""
    from realflow.config.cli import import_modules, parse_overrides
    from realflow.api.experiment import experiment_registry

    root = str(tmp_path_factory.mktemp("corpus"))
    import_modules(["experiments"])
    parse_overrides(experiment_registry.get("sft"), [f"fileroot={root}"]).prepare()  # --check prepares nothing
    assert launch_main("sft", [f"fileroot={root}", "--check"], app="main_sft") == 0
    ckpt = os.path.dirname(glob.glob(os.path.join(root, "**", "realflow_init.json"), recursive=True)[0])
    return {"fileroot": root, "ckpt": ckpt, "tmp": str(tmp_path_factory.mktemp("case")), "corpus": HERE}


def _fill(arg: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        arg = arg.replace("{" + k + "}", v)
    return arg


def _refused(capsys, experiment: str, args: list[str], values: dict[str, str]) -> str:
    """Run the launcher with ``--check``; assert a one-line refusal in time; return the line."""
    argv = [f"fileroot={values['fileroot']}", *(_fill(a, values) for a in args), "--check"]
    if experiment in APPS and experiment != "sft" and not any(a.startswith("model.path=") for a in args):
        argv = [_fill(a, values) for a in RL_BASE] + argv
    t0 = time.monotonic()
    rc = launch_main(experiment, argv, app=APPS.get(experiment, "main"))
    took = time.monotonic() - t0
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2, f"accepted (rc={rc}): {argv}\nstdout: {out.out[-2000:]}\nstderr: {out.err[-2000:]}"
    assert "Traceback" not in out.err and "Traceback" not in out.out, out.err
    assert lines and lines[0].startswith("error: "), out.err
    assert len(lines) == 1 or lines[1].startswith("allocation grammar"), f"more than one line: {out.err}"
    assert took < CASE_LIMIT_S, f"refused only after {took:.1f}s"
    return lines[0]


# ---------------------------------------------------------------- command lines (config, allocation)

@pytest.mark.parametrize("case", _cases("cli", "*.json"), ids=_id)
def test_command_line(case, shared, capsys):
    spec = json.load(open(case))
    line = _refused(capsys, spec.get("experiment", "sft"), spec["args"], shared)
    for needle in [spec["error"]] if isinstance(spec["error"], str) else spec["error"]:
        assert _fill(needle, shared) in line, line


# ---------------------------------------------------------------- data files

@pytest.mark.parametrize("case", _cases("data", "*/*.jsonl") + _cases("data", "*/*.parquet"), ids=_id)
def test_data_file(case, shared, capsys):
    """``data/<sft|rl>/<name>@<line>.<jsonl|parquet>``: the error names the file and that line (a
    parquet file: that row; 0: the file)."""
    line_no = int(os.path.basename(case).rsplit("@", 1)[1].split(".")[0])
    experiment = "sft" if os.path.basename(os.path.dirname(case)) == "sft" else "grpo-math"
    line = _refused(capsys, experiment, [f"dataset.train_path={case}", f"dataset.test_path={case}"], shared)
    where = f"{case}: row {line_no}:" if case.endswith(".parquet") else f"{case}:{line_no}:"
    assert (where if line_no else case) in line, line


# ---------------------------------------------------------------- user graphs

@pytest.mark.parametrize("case", _cases("graphs", "*.json"), ids=_id)
def test_user_graph(case, shared, capsys):
    """A user experiment whose graph is the case's MFCs (as a plugin module would declare them)."""
    from experiments.sft import SFTConfig
    from realflow.api.experiment import experiment_registry, register_experiment
    from realflow.api.mfc import MFCDef, MFCDefError

    spec = json.load(open(case))
    name = "corpus-graph-" + os.path.basename(case)[:-5]
    try:
        mfcs = [MFCDef(**m) for m in spec["mfcs"]]
    except MFCDefError as e:  # refused as it is declared: the message must name the MFC and field
        line = str(e)
    else:
        if name not in experiment_registry.names():
            class UserGraph(SFTConfig):
                def setup(self):
                    s = super().setup()
                    s.mfcs = mfcs
                    return s
            register_experiment(name)(UserGraph)
        line = _refused(capsys, name, [], shared)
    assert "\n" not in line
    for needle in spec["error"]:
        assert needle in line, line


# ---------------------------------------------------------------- checkpoints

def _make_checkpoint(spec: dict, src: str, dst: str) -> str:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for name in spec.get("delete", []):
        os.remove(os.path.join(dst, name))
    for name, n in spec.get("truncate", {}).items():
        with open(os.path.join(dst, name), "r+b") as f:
            f.truncate(n)
    for name, text in spec.get("write", {}).items():
        with open(os.path.join(dst, name), "w") as f:
            f.write(text)
    if "edit_config" in spec:
        path = os.path.join(dst, "config.json")
        cfg = json.load(open(path))
        for k, v in spec["edit_config"].items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        json.dump(cfg, open(path, "w"))
    return dst


@pytest.mark.parametrize("case", _cases("checkpoints", "*.json"), ids=_id)
def test_checkpoint(case, shared, capsys):
    """Refused by the launcher before a worker starts (and, where given, by the gen server's weight update)."""
    spec = json.load(open(case))
    path = _make_checkpoint(spec, shared["ckpt"], os.path.join(shared["tmp"], os.path.basename(case)[:-5]))
    values = dict(shared, case=path)
    line = _refused(capsys, "sft", [f"model.path={path}", "model.tokenizer_path={ckpt}"], values)
    for needle in spec["error"]:
        assert _fill(needle, values) in line, line


# ---------------------------------------------------------------- HTTP requests

@pytest.fixture(scope="module")
def services(shared, start_gen_server):
    """URLs of a gen server process (on the shared checkpoint) and a rollout controller (no servers)."""
    from aiohttp import web

    from realflow.api.rollout import RolloutSpec
    from realflow.rollout.controller import RolloutController, build_controller_app

    gen_url, _ = start_gen_server(shared["ckpt"], "--max-running-requests", "8")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def serve() -> None:
        spec = RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d")
        runner = web.AppRunner(build_controller_app(RolloutController(spec, [], None), None), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        box["runner"] = runner
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield {"gen_server": gen_url, "rollout_controller": box["url"]}
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.parametrize("case", _cases("http", "*.json"), ids=_id)
def test_http_request(case, services, shared):
    spec = json.load(open(case))
    url = services[spec["service"]] + spec["path"]
    kw: dict = {"timeout": CASE_LIMIT_S, "headers": spec.get("headers", {})}
    if "json" in spec:
        kw["json"] = json.loads(_fill(json.dumps(spec["json"]), shared))
    elif "raw" in spec:
        kw["data"] = spec["raw"].encode() * spec.get("repeat", 1)
    elif "raw_base64" in spec:
        kw["data"] = base64.b64decode(spec["raw_base64"])
    resp = requests.request(spec.get("method", "POST"), url, **kw)
    assert resp.status_code == spec["status"], (resp.status_code, resp.text[:500])
    body = resp.json()
    err = body["error"]
    assert isinstance(err, str) and "\n" not in err and "Traceback" not in err, err
    for needle in spec["error"]:
        assert needle in err, err
    health = "/health" if spec["service"] == "gen_server" else "/state"
    assert requests.get(services[spec["service"]] + health, timeout=5).status_code == 200
