"""launcher=slurm on a real Slurm: a local two-node cluster (../shared/tools/start_local_slurm.sh).

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
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from realflow.api.deploy import SlurmConfig
from realflow.scheduler import WorkerFailed, WorkerRequest
from realflow.scheduler import slurm_cli
from realflow.scheduler.slurm_cli import NodeInfo, SlurmError
from realflow.scheduler.slurm_plan import PlanError, plan_job

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO.parent / "shared" / "tools"
SLURM_ENV = {"SLURM_LOCAL_NODES": "2", "SLURM_LOCAL_CPUS": "8"}  # more CPUs than cores: several workers fit
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
    (SlurmConfig(cpus_per_worker=64), [], "slurm.cpus_per_worker=64"),
    (SlurmConfig(mem_per_worker_mb=99999), [], "slurm.mem_per_worker_mb=99999"),
    (SlurmConfig(partition="nosuch"), [], "slurm.partition=nosuch: no such partition (partitions: debug)"),
    (SlurmConfig(nodelist="n1", cpus_per_worker=9), ["n1"], "n1 would run master, model_worker/0, model_worker/1"),
])
def test_plan_errors_name_the_config_field(cfg, names, culprit):
    reqs = [_req("master", "master"), _req("model_worker/0"), _req("model_worker/1")]
    with pytest.raises(PlanError, match=None) as e:
        plan_job(reqs, cfg, NODES, names)
    assert culprit in str(e.value)


# ---- a real Slurm --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def slurm():
    """Starts (idempotently) the local 2-node Slurm cluster; stops it at the end if it started it."""
    script = TOOLS / "start_local_slurm.sh"
    if not script.is_file():
        pytest.fail(f"{script} not found: the Slurm tests need ../shared/tools beside the clone", pytrace=False)
    was_up = bool(shutil.which("scontrol")) and subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True, timeout=30).returncode == 0
    res = subprocess.run([str(script)], env={**os.environ, **SLURM_ENV}, capture_output=True, text=True,
                         timeout=900)
    if res.returncode != 0:
        pytest.fail(f"the local Slurm cluster did not start ({script}, exit {res.returncode}):\n"
                    f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}", pytrace=False)
    yield
    if not was_up:
        subprocess.run([str(TOOLS / "stop_local_slurm.sh")], capture_output=True, timeout=120)


def _step_code(out_dir: Path, behaviour: str = "wait") -> list[str]:
    """argv of a step that records where it runs, then waits for out_dir/go (or fails)."""
    code = textwrap.dedent(f"""
        import json, os, signal, sys, time
        role = os.environ["REALFLOW_ROLE"]
        keys = ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMP_NUM_THREADS")
        path = os.path.join({str(out_dir)!r}, role.replace("/", "_") + ".json")
        with open(path, "w") as f:
            json.dump({{"role": role, **{{k: os.environ.get(k) for k in keys}}}}, f)
        behaviour = {behaviour!r}
        if behaviour == "fail" and role == "model_worker/1":
            print("boom: model_worker/1 gives up", flush=True); sys.exit(3)
        if behaviour == "kill" and role == "model_worker/1":
            os.kill(os.getpid(), signal.SIGKILL)
        end = time.time() + 120
        while not os.path.exists({str(out_dir / "go")!r}) and time.time() < end:
            time.sleep(0.1)
    """)
    return [sys.executable, "-c", code]


def _requests(out_dir: Path, behaviour: str = "wait") -> list[WorkerRequest]:
    argv = _step_code(out_dir, behaviour)
    return [_req("master", "master", argv=argv), _req("model_worker/0", argv=argv), _req("model_worker/1", argv=argv)]


def _gone(job: str, timeout: float) -> float:
    """Seconds until the job has left squeue (fails after ``timeout``)."""
    t0 = time.monotonic()
    while slurm_cli.job_alive(job):
        assert time.monotonic() - t0 < timeout, f"Slurm job {job} still queued: {slurm_cli.job_state(job)}"
        time.sleep(0.1)
    return time.monotonic() - t0


def _wait_files(out_dir: Path, n: int, timeout: float = 60) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(out_dir.glob("*.json"))
        if len(files) == n:
            time.sleep(0.1)
            rows = [json.loads(f.read_text()) for f in files]
            return {r["role"]: r for r in rows}
        time.sleep(0.1)
    raise AssertionError(f"only {len(list(out_dir.glob('*.json')))} of {n} steps reported within {timeout}s")


@pytest.mark.timeout(900)
def test_het_job_runs_named_steps_on_both_nodes_and_close_cancels_it(slurm, tmp_path):
    from realflow.scheduler.slurm import SlurmScheduler

    out = tmp_path / "out"
    out.mkdir()
    sched = SlurmScheduler(tmp_path / "logs", SlurmConfig(nodelist="n[1-2]", time_limit="10"), job_name="rf-test",
                           console=False)
    try:
        sched.start(_requests(out))
        job = sched.job_id
        seen = _wait_files(out, 3)
        assert {n: r["SLURMD_NODENAME"] for n, r in seen.items()} == \
            {"master": "n1", "model_worker/0": "n1", "model_worker/1": "n2"}
        assert {n: sched.node(n) for n in seen} == {n: r["SLURMD_NODENAME"] for n, r in seen.items()}
        assert {r["OMP_NUM_THREADS"] for r in seen.values()} == {"1"}
        comps = slurm_cli.job_state(job)
        assert [c.state for c in comps] == ["RUNNING", "RUNNING"]  # heterogeneous: two components
        names = subprocess.run(["squeue", "-h", "-j", job, "-o", "%j"], capture_output=True, text=True).stdout
        assert set(names.split()) == {"rf-test"}
        assert sorted((name, node) for _, name, node in slurm_cli.steps(job)) == \
            [("master", "n1"), ("model_worker/0", "n1"), ("model_worker/1", "n2")]
        (out / "go").touch()
        assert sched.wait(60)
    finally:
        t0 = time.monotonic()
        sched.close()
        closed = time.monotonic() - t0
    assert _gone(job, 5) < 5 and closed < 30


@pytest.mark.timeout(900)
@pytest.mark.parametrize("behaviour, code, said", [("fail", 3, "exited with code 3"),
                                                   ("kill", -9, "was killed by SIGKILL")])
def test_a_failing_step_raises_worker_failed_naming_it_and_the_job_goes(slurm, tmp_path, behaviour, code, said):
    from realflow.scheduler.slurm import SlurmScheduler

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
import sys
from realflow.api.deploy import SlurmConfig
from realflow.scheduler.slurm import SlurmScheduler
sys.path.insert(0, {tests!r})
from test_scheduler_slurm import _requests
from pathlib import Path
s = SlurmScheduler({logs!r}, SlurmConfig(nodelist="n[1-2]"), job_name="rf-killed", console=False)
s.start(_requests(Path({out!r})))
print("JOB", s.job_id, flush=True)
s.wait(600)
"""


@pytest.mark.timeout(900)
def test_a_killed_launcher_leaves_no_step_and_no_job(slurm, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = _LAUNCHER.format(tests=str(REPO / "tests"), logs=str(tmp_path / "logs"), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("JOB "), f"the launcher did not start its job: {line!r}"
        job = line.split()[1]
        _wait_files(out, 3)
        assert len(slurm_cli.steps(job)) == 3
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while slurm_cli.steps(job):
            assert time.monotonic() - t0 < 10, f"steps still running: {slurm_cli.steps(job)}"
            time.sleep(0.1)
        gone = _gone(job, 10)
    finally:
        proc.kill()
        proc.wait()
    assert gone < 10
    assert "cancelled Slurm job" in (tmp_path / "logs" / "slurm_watchdog.log").read_text()


@pytest.mark.timeout(900)
def test_bad_slurm_settings_fail_before_anything_runs_naming_the_field(slurm, tmp_path, monkeypatch):
    from realflow.scheduler.slurm import SlurmScheduler

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
    from realflow.scheduler.slurm import SlurmScheduler

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
