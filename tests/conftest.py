"""Shared pytest fixtures. Keep this file small: fixtures used by several test files only."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import requests
import torch

from realflow.base.network import find_free_ports

# Without a GPU, Triton kernels (parallel.generation.paged_attention) run through Triton's
# interpreter, so CI checks the same kernel programs a GPU compiles. Triton reads the flag
# when it is imported: it must be set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ETCD_INSTALL_HINT = "apt-get update && apt-get install -y etcd-server"


def _etcd_binary() -> str | None:
    return shutil.which(os.environ.get("REALFLOW_ETCD_BIN") or "etcd")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """A real etcd v3 on 127.0.0.1 with free ports and a temporary data dir: yields (host, port).

    Missing etcd is a test FAILURE (CI must install it: see ETCD_INSTALL_HINT);
    set REALFLOW_SKIP_ETCD=1 to skip the etcd tests on a machine without it.
    """
    if os.environ.get("REALFLOW_SKIP_ETCD") == "1":
        pytest.skip("REALFLOW_SKIP_ETCD=1")
    binary = _etcd_binary()
    if binary is None:
        pytest.fail(f"etcd not found on PATH; install it ({ETCD_INSTALL_HINT}) "
                    "or set REALFLOW_SKIP_ETCD=1 to skip etcd tests", pytrace=False)
    data_dir = tmp_path_factory.mktemp("etcd")
    client_port, peer_port = find_free_ports(2)
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(data_dir / "etcd.log", "wb")
    proc = subprocess.Popen(
        [binary, "--name", "rf", "--data-dir", str(data_dir / "data"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"rf={peer}", "--log-level", "error"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"etcd exited with {proc.returncode}; see {data_dir / 'etcd.log'}", pytrace=False)
            try:
                if requests.get(f"{client}/health", timeout=1).json().get("health") == "true":
                    break
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"etcd on {client} not healthy after 30s; see {data_dir / 'etcd.log'}",
                            pytrace=False)
            time.sleep(0.1)
        yield "127.0.0.1", client_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def start_gen_server(tmp_path_factory):
    """``start(model_path, *extra_args, env=None) -> (url, process)``: a real gen server process
    (builtin engine, one thread, any free port); every one started is killed with the module."""
    from realflow.rollout.local_server import start_local_gen_server

    procs: list[subprocess.Popen] = []

    def start(model_path: str, *extra: str, env: dict | None = None) -> tuple[str, subprocess.Popen]:
        log_path = tmp_path_factory.mktemp("gen_server") / "server.log"
        try:
            url, proc = start_local_gen_server(model_path, *extra, log_path=str(log_path), env=env, timeout_s=90)
        except RuntimeError as e:
            pytest.fail(str(e))
        procs.append(proc)
        return url, proc

    yield start
    from realflow.scheduler.proc import terminate_all

    terminate_all(procs, grace=15)


@pytest.fixture(scope="module")
def two_tiny_qwen2(tmp_path_factory):
    """{"a": (path, model), "b": (path, model)}: two different random tiny Qwen2 HF checkpoints."""
    from parallel.testing import make_tiny_hf

    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, make_tiny_hf(path, seed=seed, family="qwen2")[1])
    return out


#: A weak arithmetic SFT start (lots of room for RL): the RL end-to-end tests all begin from it.
SMALL_SFT_START = ["dataset.n_train=3000", "dataset.n_test=64", "model.arch.hidden_size=64",
                   "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=128", "batch_size=32",
                   "max_train_steps=400", "optimizer.lr=3e-3"]


@pytest.fixture(scope="session")
def small_sft_start(tmp_path_factory, worker_id):
    """A file root holding ``SMALL_SFT_START``'s run (``sft/trial0``) and its data: trained once
    per session (~40 s), also when pytest-xdist runs the tests in several processes (the first
    to ask trains it under a file lock, the others wait for it); a test module copies it with
    :func:`copy_sft_start` into its own root."""
    import sys

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # xdist: the workers' temp dirs share this parent
        shared = shared.parent
    root, done = shared / "sft_start", shared / "sft_start.done"
    with FileLock(str(shared / "sft_start.lock"), timeout=600):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            cmd = [sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={root}", *SMALL_SFT_START]
            res = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 capture_output=True, text=True, timeout=400)
            assert res.returncode == 0, res.stderr[-3000:]
            done.touch()
    return root


def copy_sft_start(start, root):
    """``root`` with the shared SFT start's checkpoint and data where the RL experiments look."""
    for sub in ("sft", "data"):
        shutil.copytree(start / sub, root / sub, dirs_exist_ok=True)
    return root


def left_behind(fileroot) -> list[str]:
    """Processes still running that belong to this file root's runs (workers, gen servers): what a
    finished run must not leave."""
    import psutil

    me, out = os.getpid(), []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and str(fileroot) in " ".join(p.info["cmdline"] or []):
                out.append(" ".join(p.info["cmdline"])[:200])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


# --------------------------------------------------------------------------- parallel runs
# The README's test command runs the tests in two pytest-xdist processes, one test file per
# unit of work (its module fixtures, such as a trained start, are made once). Two exceptions:

#: Files that watch something machine-wide, run in one process one after the other: the
#: sandbox tests count every live process of the sandbox's uids (another file's sandboxed code
#: would look like a survivor).
SHARED_SCOPES = {name: "sandbox" for name in (
    "test_sandbox.py", "test_code_reward.py", "test_code_rl.py", "test_data_code_expr.py",
    "test_experiment_tasks.py")}

#: The files that take minutes (measured in CI), started first so that both processes finish
#: together instead of one running the VL start alone at the end.
SLOW_FILES_FIRST = (
    "test_system_vl.py", "test_system_recovery.py", "test_agent_examples.py", "test_code_rl.py",
    "test_algorithm_presets.py", "test_system_async_ppo.py", "test_nonfinite_run.py",
    "test_example_rft.py", "test_parallel_realloc.py", "test_parallel_layouts.py", "test_system_moe.py",
    "test_system_ppo.py", "test_system_lora.py", "test_scheduler_slurm.py", "test_example_dpo.py")


def _file_of(nodeid: str) -> str:
    return os.path.basename(nodeid.split("::", 1)[0])


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(_file_of(item.nodeid), len(first)))  # stable: file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        """One test file per unit of work (SHARED_SCOPES: several), in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return SHARED_SCOPES.get(_file_of(nodeid), nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False  # keep SLOW_FILES_FIRST's order
    return FileScheduling(config, log)
