"""launcher=slurm on a real Slurm: a local two-node cluster (tests/slurm/start_local_slurm.sh).

Both virtual nodes are slurmd daemons on this host, so steps "on n2" really go through
slurmctld, slurmd and slurmstepd of node n2. A cluster that cannot start is a FAILURE,
not a skip: CI must run these tests. The plan tests at the top need no Slurm.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from realflow.api.deploy import SlurmConfig
from realflow.base.network import host_address
from realflow.scheduler import WorkerFailed, WorkerRequest
from realflow.scheduler import slurm_cli
from realflow.scheduler.slurm import SlurmScheduler
from realflow.scheduler.slurm_cli import NodeInfo, SlurmError
from realflow.scheduler.slurm_plan import PlanError, plan_job

REPO = Path(__file__).resolve().parent.parent
SLURM_SCRIPTS = Path(__file__).resolve().parent / "slurm"  # start/stop_local_slurm.sh
SLURM_ENV = {"SLURM_LOCAL_NODES": "2", "SLURM_LOCAL_CPUS": "8"}  # more CPUs than cores: several workers fit
ON_N1_N2 = {"master": "n1", "model_worker/0": "n1", "model_worker/1": "n2"}
NODES = [NodeInfo(f"n{i}", 16, 32000, ("debug",), True, "idle") for i in (1, 2, 3, 4)]


def _req(name: str, kind: str = "model_worker", gpus: int = 0, argv: list[str] | None = None) -> WorkerRequest:
    return WorkerRequest(name, argv or ["true"], kind=kind, gpus=gpus)


# ---- planning (no Slurm) ---------------------------------------------------------------------
def test_plan_spreads_workers_over_the_named_nodes_heterogeneous_when_loads_differ():
    reqs = [_req("master", "master"), _req("model_worker/0"), _req("model_worker/1")]
    plan = plan_job(reqs, SlurmConfig(nodelist="n[1-2]"), NODES, ["n1", "n2"])
    assert plan.slot_of == {"master": 0, "model_worker/0": 0, "model_worker/1": 1}
    assert plan.het and [c.nodelist for c in plan.components] == [["n1"], ["n2"]]
    args = plan.sbatch_args(SlurmConfig(time_limit="10"), "job")
    assert args.count(":") == 1 and "--cpus-per-task=2" in args and "--cpus-per-task=1" in args
    assert "--het-group=1" in plan.srun_args("model_worker/1", "7", "n2")


def test_plan_packs_gpu_workers_by_gpus_per_node_and_keeps_ranks_together():
    reqs = [_req("master", "master")] + [_req(f"model_worker/{i}", gpus=1) for i in range(3)]
    plan = plan_job(reqs, SlurmConfig(gpus_per_node=2), NODES)
    assert plan.slot_of == {"master": 0, "model_worker/0": 0, "model_worker/1": 0, "model_worker/2": 1}
    assert sorted(c.shape.gpus for c in plan.components) == [1, 2]
    assert "--gpus=1" in plan.srun_args("model_worker/2", "7", "n2")


@pytest.mark.parametrize("cfg, names, culprit", [
    (SlurmConfig(nodelist="n9"), ["n9"], "slurm.nodelist=n9: no node named n9"),
    (SlurmConfig(nodelist="n1,n1"), ["n1", "n1"], "slurm.nodelist=n1,n1: names n1 more than once"),
    (SlurmConfig(cpus_per_worker=64), [], "slurm.cpus_per_worker=64"),
    (SlurmConfig(mem_per_worker_mb=99999), [], "slurm.mem_per_worker_mb=99999"),
    (SlurmConfig(partition="nosuch"), [], "slurm.partition=nosuch: no such partition (partitions: debug)"),
    (SlurmConfig(nodelist="n1", cpus_per_worker=9), ["n1"], "n1 would run master, model_worker/0, model_worker/1"),
])
def test_plan_errors_name_the_config_field(cfg, names, culprit):
    reqs = [_req("master", "master"), _req("model_worker/0"), _req("model_worker/1")]
    with pytest.raises(PlanError) as e:
        plan_job(reqs, cfg, NODES, names)
    assert culprit in str(e.value)


# ---- a real Slurm --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def slurm():
    """Starts (idempotently) the local 2-node Slurm cluster; stops it at the end if it started it."""
    script = SLURM_SCRIPTS / "start_local_slurm.sh"
    was_up = bool(shutil.which("scontrol")) and subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True, timeout=30).returncode == 0
    res = subprocess.run([str(script)], env={**os.environ, **SLURM_ENV}, capture_output=True, text=True,
                         timeout=900)
    if res.returncode != 0:
        pytest.fail(f"the local Slurm cluster did not start ({script}, exit {res.returncode}):\n"
                    f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}", pytrace=False)
    yield
    if not was_up:
        subprocess.run([str(SLURM_SCRIPTS / "stop_local_slurm.sh")], capture_output=True, timeout=120)


def _step_code(out_dir: Path, behaviour: str = "wait") -> list[str]:
    """argv of a step that records where it runs, then sleeps (or fails, or is killed)."""
    code = textwrap.dedent(f"""
        import json, os, signal, sys, time
        role = os.environ["REALFLOW_ROLE"]
        keys = ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMP_NUM_THREADS")
        path = os.path.join({str(out_dir)!r}, role.replace("/", "_") + ".json")
        with open(path + ".tmp", "w") as f:
            json.dump({{"role": role, **{{k: os.environ.get(k) for k in keys}}}}, f)
        os.replace(path + ".tmp", path)
        behaviour = {behaviour!r}
        if behaviour == "fail" and role == "model_worker/1":
            print("boom: model_worker/1 gives up", flush=True); sys.exit(3)
        if behaviour == "kill" and role == "model_worker/1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """)
    return [sys.executable, "-c", code]


def _requests(out_dir: Path, behaviour: str = "wait") -> list[WorkerRequest]:
    argv = _step_code(out_dir, behaviour)
    return [_req(n, "master" if n == "master" else "model_worker", argv=argv)
            for n in ("master", "model_worker/0", "model_worker/1")]


def _gone(job: str, timeout: float) -> float:  # seconds until the job has left squeue
    t0 = time.monotonic()
    while slurm_cli.job_alive(job):
        assert time.monotonic() - t0 < timeout, f"Slurm job {job} still queued: {slurm_cli.job_state(job)}"
        time.sleep(0.1)
    return time.monotonic() - t0


def _wait_files(out_dir: Path, n: int, timeout: float = 60) -> dict[str, dict]:
    """role -> what its step recorded, once all ``n`` steps have."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(out_dir.glob("*.json"))
        if len(files) == n:
            return {r["role"]: r for r in (json.loads(f.read_text()) for f in files)}
        time.sleep(0.1)
    raise AssertionError(f"only {len(list(out_dir.glob('*.json')))} of {n} steps reported within {timeout}s")


@pytest.mark.timeout(900)
def test_het_job_runs_named_steps_on_both_nodes_and_close_cancels_it(slurm, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    sched = SlurmScheduler(tmp_path / "logs", SlurmConfig(nodelist="n[1-2]", time_limit="10"), job_name="rf-test",
                           console=False)
    try:
        sched.start(_requests(out))
        job = sched.job_id
        seen = _wait_files(out, 3)
        where = {n: r["SLURMD_NODENAME"] for n, r in seen.items()}
        assert where == {n: sched.node(n) for n in seen} == ON_N1_N2
        assert {r["OMP_NUM_THREADS"] for r in seen.values()} == {"1"}
        assert [c.state for c in slurm_cli.job_state(job)] == ["RUNNING", "RUNNING"]  # het: two components
        squeue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%j"], capture_output=True, text=True, timeout=30)
        assert squeue.stdout.split() == ["rf-test", "rf-test"]  # the job's name, on each component
        assert sorted((name, node) for _, name, node in slurm_cli.steps(job)) == \
            [("master", "n1"), ("model_worker/0", "n1"), ("model_worker/1", "n2")]
        assert not sched.wait(0.5)  # still running
    finally:
        t0 = time.monotonic()
        sched.close()  # while the steps run
    assert time.monotonic() - t0 < 30 and _gone(job, 5) < 5 and not slurm_cli.steps(job)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("behaviour, code, said", [("fail", 3, "exited with code 3"),
                                                   ("kill", -9, "was killed by SIGKILL")])
def test_a_failing_step_raises_worker_failed_naming_it_and_the_job_goes(slurm, tmp_path, behaviour, code, said):
    out = tmp_path / "out"
    out.mkdir()
    sched = SlurmScheduler(tmp_path / "logs", SlurmConfig(nodelist="n[1-2]"), job_name="rf-fail", console=False)
    try:
        sched.start(_requests(out, behaviour))
        job = sched.job_id
        with pytest.raises(WorkerFailed) as e:
            sched.wait(60)
    finally:
        sched.close()
    assert e.value.name == "model_worker/1" and e.value.returncode == code
    assert f"worker 'model_worker/1' (pid {e.value.pid}) {said}" in str(e.value)
    if behaviour == "fail":
        assert any("boom: model_worker/1 gives up" in ln for ln in e.value.log_tail)
    assert _gone(job, 5) < 5


_LAUNCHER = """
import signal
import sys
from pathlib import Path
# a launcher in a terminal gets Ctrl-C; one started from a background job inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from realflow.api.deploy import SlurmConfig
from realflow.scheduler.slurm import SlurmScheduler
sys.path.insert(0, {tests!r})
from test_scheduler_slurm import _requests
s = SlurmScheduler({logs!r}, SlurmConfig(nodelist="n[1-2]"), job_name="rf-killed", console=False)
s.start(_requests(Path({out!r})))
print("JOB", s.job_id, flush=True)
s.wait(600)
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_killed_or_interrupted_launcher_leaves_no_step_and_no_job(slurm, tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    code = _LAUNCHER.format(tests=str(REPO / "tests"), logs=str(tmp_path / "logs"), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("JOB "), f"the launcher did not start its job: {line!r}"
        job = line.split()[1]
        _wait_files(out, 3)
        ids = {c.job_id for c in slurm_cli.job_state(job)}
        assert len(slurm_cli.steps(job)) == 3 and len(_job_processes(ids)) == 3
        proc.send_signal(sig)
        t0 = time.monotonic()
        while slurm_cli.steps(job) or _job_processes(ids):
            assert time.monotonic() - t0 < 10, f"still running: {slurm_cli.steps(job)} {_job_processes(ids)}"
            time.sleep(0.1)
        gone = _gone(job, 10)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert gone < 10
    watchdog = (tmp_path / "logs" / "slurm_watchdog.log").read_text()
    # killed: the watchdog cancels the job; interrupted: the launcher cancels it itself
    assert ("cancelled Slurm job" in watchdog) == (sig == signal.SIGKILL), watchdog


@pytest.mark.timeout(900)
def test_bad_slurm_settings_fail_before_anything_runs_naming_the_field(slurm, tmp_path, monkeypatch):
    def start(cfg, reqs=None):
        sched = SlurmScheduler(tmp_path / "logs", cfg, job_name="rf-bad", console=False)
        try:
            sched.start(reqs or [_req("master", "master"), _req("model_worker/0")])
        finally:
            sched.close()

    with pytest.raises(SlurmError, match=r"slurm.nodelist=n9: no node named n9 in the default partition"):
        start(SlurmConfig(nodelist="n9"))
    with pytest.raises(SlurmError, match=r"slurm.cpus_per_worker=64.*largest node.*has 8"):
        start(SlurmConfig(cpus_per_worker=64))
    with pytest.raises(SlurmError, match=r"slurm.partition=gpu: no such partition \(partitions: debug\)"):
        start(SlurmConfig(partition="gpu"))
    # refused by Slurm itself at submit: this cluster has no GPUs (no gres)
    with pytest.raises(SlurmError, match=r"Slurm refused the job \(slurm.gpus_per_node=1\).*gres"):
        start(SlurmConfig(gpus_per_node=1), [_req("master", "master"), _req("model_worker/0", gpus=1)])
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match=r"launcher=slurm needs the Slurm client tools \(salloc/sbatch\) on PATH"):
        start(SlurmConfig())


@pytest.mark.timeout(900)
def test_a_job_that_cannot_start_times_out_naming_it_and_is_cancelled(slurm, tmp_path):
    blocker = slurm_cli.submit(["--job-name=rf-blocker", "--output=/dev/null", "--nodes=2", "--exclusive"],
                               "#!/bin/sh\nsleep 300\n")
    try:
        t0 = time.monotonic()
        while slurm_cli.job_state(blocker)[0].state != "RUNNING":
            assert time.monotonic() - t0 < 30, slurm_cli.job_state(blocker)
            time.sleep(0.2)
        sched = SlurmScheduler(tmp_path / "logs", SlurmConfig(submit_timeout_s=3), job_name="rf-pending",
                               console=False)
        with pytest.raises(TimeoutError) as e:
            sched.start([_req("master", "master"), _req("model_worker/0")])
        job = sched.job_id
        sched.close()
        assert re.search(rf"Slurm job {job} \(rf-pending\) did not start within 3.00s \(slurm.submit_timeout_s\): "
                         r"pending \((Resources|Priority)\); cancelled it", str(e.value)), str(e.value)
        assert _gone(job, 5) < 5
    finally:
        slurm_cli.cancel(blocker)


# ---- cluster addresses ----------------------------------------------------------------------
def test_cluster_processes_bind_the_node_address_and_local_ones_loopback(monkeypatch):
    from realflow.comm.auth import new_secret
    from realflow.comm.heartbeat import HeartbeatMonitor
    from realflow.comm.rpc import MasterEndpoint
    from realflow.system.trajectory_inbox import TrajectoryInbox

    def addresses() -> list[str]:
        secret = new_secret()
        ep, mon, inbox = MasterEndpoint(secret), HeartbeatMonitor(secret), TrajectoryInbox("model_worker/0", secret)
        try:
            return [a.rsplit(":", 1)[0] for a in (ep.address, mon.address, inbox.address)]
        finally:
            ep.close(), mon.close(), inbox.close()

    monkeypatch.delenv("REALFLOW_CLUSTER", raising=False)
    assert addresses() == ["tcp://127.0.0.1"] * 3
    monkeypatch.setenv("REALFLOW_CLUSTER", "1")
    node = host_address(cluster=True)
    assert not node.startswith("127.") and addresses() == [f"tcp://{node}"] * 3


# ---- end to end: python -m realflow.apps.main_* launcher=slurm --------------------------------
SMALL = ["dataset.n_train=3000", "dataset.n_test=64", "model.arch.hidden_size=64", "model.arch.num_hidden_layers=2",
         "model.arch.intermediate_size=128", "batch_size=32"]
ON_BOTH_NODES = ["launcher=slurm", "slurm.nodelist=n[1-2]", "slurm.time_limit=10", "recover_mode=off"]


def _role_listeners(job_ids: set[str]) -> dict[str, set[str]]:
    """REALFLOW_ROLE -> addresses the tasks of these jobs listen on (from /proc)."""
    listening = {}
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # LISTEN
                h = cols[1].split(":")[0]
                listening[f"socket:[{cols[9]}]"] = socket.inet_ntoa(bytes.fromhex(h)[::-1]) if len(h) == 8 else h
    out: dict[str, set[str]] = {}
    for pid, role in _job_processes(job_ids).items():
        try:
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # exited, or an fd closed while listing: the next round sees it
            continue
        out.setdefault(role, set()).update(listening[t] for t in fds if t in listening)
    return out


def _job_processes(job_ids: set[str]) -> dict[int, str]:
    """pid -> REALFLOW_ROLE of the processes that run as tasks of these jobs."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{d}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") in job_ids and "REALFLOW_ROLE" in env:
            out[int(d)] = env["REALFLOW_ROLE"]
    return out


def _run_watched(module: str, fileroot: Path, job_name: str, *overrides: str, timeout: float = 300):
    """Run an app; meanwhile record each step's node (squeue) and each role's listening addresses."""
    log, nodes, listens = fileroot / f"{module.rsplit('.', 1)[1]}.out", {}, {}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, f"fileroot={fileroot}", *overrides], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"{module} did not finish within {timeout}s"
            ids = set(slurm_cli.run(["squeue", "-h", "-n", job_name, "-o", "%A"]).stdout.split())
            if ids:
                steps = slurm_cli.run(["squeue", "-h", "-s", "-j", ",".join(sorted(ids)), "-o", "%j|%N"]).stdout.split()
                nodes.update(s.split("|") for s in steps if not s.startswith("batch|"))
                for role, addrs in _role_listeners(ids).items():
                    listens.setdefault(role, set()).update(addrs)
            time.sleep(0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text(), nodes, listens


def _assert_cluster_addresses(listens: dict[str, set[str]]) -> None:
    """The master (RPC, heartbeats) and the trainer's rendezvous store listen on the node's address.

    (The model workers' gloo sockets bind the address the host name resolves to: loopback on
    this machine, whose /etc/hosts maps its name to 127.0.0.1, the node's address on a cluster.)
    """
    node = host_address(cluster=True)
    assert listens.get("master") == {node}, listens
    assert node in listens.get("model_worker/0", set()), listens
    assert not set().union(*listens.values()) & {"0.0.0.0", "0" * 32}, listens  # no wildcard, v4 or v6


@pytest.fixture(scope="module")
def sft_on_slurm(slurm, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm_e2e")
    return root, _run_watched("realflow.apps.main_sft", root, "realflow:sft:trial0", *SMALL, "max_train_steps=3",
                              "n_workers=2", *ON_BOTH_NODES)


@pytest.mark.timeout(900)
def test_sft_on_slurm_runs_model_workers_on_both_nodes(sft_on_slurm):
    root, (rc, out, nodes, listens) = sft_on_slurm
    assert rc == 0, out[-3000:]
    assert nodes == ON_N1_N2, out[-3000:]
    _assert_cluster_addresses(listens)
    assert (root / "sft" / "trial0" / "checkpoints" / "default" / "final" / "config.json").is_file()
    assert not subprocess.run(["squeue", "-h", "-n", "realflow:sft:trial0"], capture_output=True,
                              text=True).stdout.strip()


@pytest.mark.timeout(900)
def test_sync_ppo_on_slurm_runs_model_workers_on_both_nodes(sft_on_slurm):
    root, _ = sft_on_slurm  # its SFT checkpoint is where the PPO experiment looks for its actor
    rc, out, nodes, listens = _run_watched("realflow.apps.main_sync_ppo", root, "realflow:grpo-math:trial0",
                                           "max_train_steps=2", "batch_size=8", "dataset.n_test=16", *ON_BOTH_NODES)
    assert rc == 0, out[-3000:]
    assert nodes == ON_N1_N2, out[-3000:]
    _assert_cluster_addresses(listens)
    assert "saved actor HF checkpoint" in out
