"""RayScheduler on a real local Ray head: real actors, real worker processes, real failures.

One head is started for the module (``ray start --head --block``: about 6 s) on free ports
and a short temporary directory, and stopped at teardown by SIGTERM to exactly that
command, which stops the processes it started. Ray missing or not starting is a test
FAILURE, not a skip: CI installs it with the ``test`` extra.

"No pid left" is checked independently of the code under test: os.kill(pid, 0) plus the
state in /proc (a zombie is dead, merely not yet reaped by its new parent).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from realflow.api.deploy import RayConfig
from realflow.base.network import find_free_ports
from realflow.scheduler.base import WorkerRequest
from realflow.scheduler.local import WorkerFailed

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
SMALL_SFT = ["dataset.n_train=3000", "dataset.n_test=64", "model.arch.hidden_size=64", "model.arch.num_hidden_layers=2",
             "model.arch.intermediate_size=128", "batch_size=32", "max_train_steps=3"]  # test_system_sft's SMALL

# Worker program: python -c WORKER MODE PIDDIR [ARG]
WORKER = r"""
import os, subprocess, sys, time
mode, piddir = sys.argv[1], sys.argv[2]
me = os.environ["REALFLOW_ROLE"].replace("/", "_")

def record(pids):
    tmp = os.path.join(piddir, me + ".tmp")
    with open(tmp, "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(tmp, os.path.join(piddir, me + ".pids"))

if mode == "ok":
    print("ok", me, os.environ["OMP_NUM_THREADS"], os.environ.get("EXTRA"), os.getcwd())
elif mode == "sleeper":   # a family: plain grandchild, one that ignores SIGTERM, one that left the group
    kids = [subprocess.Popen(["sleep", "600"]),
            subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 600"]),
            subprocess.Popen(["sleep", "600"], start_new_session=True)]
    record([os.getpid()] + [k.pid for k in kids])
    time.sleep(600)
elif mode == "flaky":   # dies at its first start, serves after its restart
    mark = os.path.join(piddir, "flaky.started")
    if not os.path.exists(mark):
        open(mark, "w").close()
        sys.exit(5)
    record([os.getpid()])
    time.sleep(600)
elif mode == "await":   # exits 0 once worker ARG recorded its pids
    while not os.path.exists(os.path.join(piddir, sys.argv[3] + ".pids")):
        time.sleep(0.1)
elif mode == "fail":
    for i in range(30):
        print(f"fail line {i}")
    print("about to fail", file=sys.stderr)
    sys.exit(3)
"""


def _ray_bin() -> str:
    path = Path(sys.executable).with_name("ray")
    return str(path) if path.exists() else (shutil.which("ray") or "ray")


@pytest.fixture(scope="module")
def ray_head():
    """A local Ray head with 8 logical CPUs: yields its address 'host:port'."""
    try:
        import ray
    except ImportError:
        pytest.fail("Ray is not installed: pip install -c constraints.txt -e '.[test]'", pytrace=False)
    assert ray.__version__
    temp = tempfile.mkdtemp(prefix="rf-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ports = find_free_ports(9)
    names = ("port", "ray-client-server-port", "dashboard-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
             "node-manager-port", "object-manager-port")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    cmd = [_ray_bin(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=8",
           "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
           *(f"--{n}={p}" for n, p in zip(names, ports))]
    log_path = Path(temp) / "ray-start.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while b"Ray runtime started" not in log_path.read_bytes():
            tail = log_path.read_text(errors="replace")[-3000:]
            if proc.poll() is not None:
                pytest.fail(f"`ray start --head` exited with {proc.returncode}:\n{tail}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"`ray start --head` did not report 'Ray runtime started' in 60 s:\n{tail}",
                            pytrace=False)
            time.sleep(0.2)
        yield f"127.0.0.1:{ports[0]}"
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of that head (its own session)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (ProcessLookupError, FileNotFoundError):
        return False


def _pids(piddir: Path, names: list[str], timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        missing = [n for n in names if not (piddir / f"{n}.pids").exists()]
        if not missing:
            return [int(p) for n in names for p in (piddir / f"{n}.pids").read_text().split()]
        assert time.monotonic() < deadline, f"workers {missing} wrote no pid file in {timeout}s"
        time.sleep(0.1)


def _assert_all_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:80] for p in pids if _alive(p)}
    for p in left:
        os.kill(p, signal.SIGKILL)  # do not leak them into the next test
    assert not left, f"still alive after {within}s: {left}"


def _req(name: str, mode: str, piddir: Path, *args: str, **kw) -> WorkerRequest:
    return WorkerRequest(name, [sys.executable, "-c", WORKER, mode, str(piddir), *args], **kw)


def _sched(tmp_path: Path, address: str, **cfg):
    from realflow.scheduler.ray import RayScheduler

    return RayScheduler(tmp_path / "logs", RayConfig(address=address, **{"connect_timeout_s": 60, **cfg}),
                        job_name="test", console=False, grace=1.0)


def _free_cpus(address: str) -> float:
    """The head's free CPUs, seen from a fresh driver (this process keeps no connection)."""
    code = (f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "print(ray.available_resources().get('CPU', 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


def test_workers_run_to_completion_with_their_env_and_logs(ray_head, tmp_path):
    with _sched(tmp_path, ray_head) as s:
        s.start([_req("a", "ok", tmp_path, env={"EXTRA": "x1"}, n_threads=2),
                 _req("group/b", "ok", tmp_path, kind="master")])
        assert sorted(s.names) == ["a", "group/b"] and s.pid("a") > 0
        deadline = time.monotonic() + 60
        while not s.wait(0.5):
            assert time.monotonic() < deadline, f"still running after 60s: {s.running()}"
        assert s.poll() == {"a": 0, "group/b": 0}
        assert (tmp_path / "logs" / "a.log").read_text().split() == ["ok", "a", "2", "x1", os.getcwd()]
        assert (tmp_path / "logs" / "group" / "b.log").read_text().startswith("ok group_b 1 None")
    assert _free_cpus(ray_head) == 8.0  # the placement group was removed


def test_failing_worker_stops_the_job_and_is_named(ray_head, tmp_path):
    with _sched(tmp_path, ray_head) as s:
        s.start([_req("sleeper", "sleeper", tmp_path), _req("bad", "fail", tmp_path)])
        family = _pids(tmp_path, ["sleeper"])
        with pytest.raises(WorkerFailed) as ei:
            s.wait(60)
        e = ei.value
        assert (e.name, e.returncode) == ("bad", 3) and e.returncodes == {"bad": 3}
        assert "worker 'bad'" in str(e) and "exited with code 3" in str(e)
        assert e.log_tail[-1] == "about to fail" and "fail line 29" in e.log_tail
        _assert_all_gone(family, within=1.0)  # wait() returned only after stopping everything
        assert s.poll()["sleeper"] == -signal.SIGTERM


def test_worker_killed_by_sigkill_is_reported_as_such(ray_head, tmp_path):
    with _sched(tmp_path, ray_head) as s:
        s.start([_req("victim", "sleeper", tmp_path), _req("other", "sleeper", tmp_path)])
        victim, *_ = family = _pids(tmp_path, ["victim", "other"])
        assert victim == s.pid("victim")
        assert not s.wait(2.5)  # polled meanwhile: its node scans /proc and links the setsid child
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerFailed) as ei:
            s.wait(60)
        assert (ei.value.name, ei.value.signal) == ("victim", signal.SIGKILL)
        assert "was killed by SIGKILL (9)" in str(ei.value)
        _assert_all_gone(family, within=1.0)


def test_stop_all_leaves_no_process_and_frees_resources(ray_head, tmp_path):
    with _sched(tmp_path, ray_head) as s:
        s.start([_req(f"w{i}", "sleeper", tmp_path, n_threads=2) for i in range(2)])
        family = _pids(tmp_path, ["w0", "w1"])
        assert not s.wait(0.5)  # still running: False, nothing stopped
        t0 = time.monotonic()
        s.stop_all(grace=1.0)
        assert time.monotonic() - t0 < 10
        _assert_all_gone(family, within=0.5)
        assert set(s.poll().values()) == {-signal.SIGTERM}
    assert _free_cpus(ray_head) == 8.0


LAUNCHER = """
import sys
from realflow.api.deploy import RayConfig
from realflow.scheduler.base import WorkerRequest
from realflow.scheduler.ray import RayScheduler
address, piddir, worker = sys.argv[1:4]
s = RayScheduler(piddir + "/logs", RayConfig(address=address), console=False, grace=1.0)
s.start([WorkerRequest(f"w{i}", [sys.executable, "-c", worker, "sleeper", piddir]) for i in range(2)])
print("started", flush=True)
while not s.wait(1.0):
    pass
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_leaves_no_worker_behind(ray_head, tmp_path, sig):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, ray_head, str(tmp_path), WORKER],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        family = _pids(tmp_path, ["w0", "w1"])
        time.sleep(2.5)  # one /proc scan of the watchdog: it remembers the child that left the group
        assert launcher.poll() is None, launcher.stdout.read().decode()[-3000:]
        launcher.send_signal(sig)  # SIGTERM: stops the workers itself (grace 5 s), then exits
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
    _assert_all_gone(family, within=20.0 if sig == signal.SIGKILL else 1.0)
    deadline = time.monotonic() + 20  # Ray removes a dead driver's placement group
    while _free_cpus(ray_head) != 8.0:
        assert time.monotonic() < deadline, "the dead launcher's resources were not released in 20s"


def test_expendable_worker_is_restarted_in_place(ray_head, tmp_path):
    with _sched(tmp_path, ray_head) as s:
        s.start([_req("svc", "flaky", tmp_path, expendable=True, restarts=1),
                 _req("main", "await", tmp_path, "svc.restart1")])
        assert s.wait(60)  # main saw the restarted svc (REALFLOW_ROLE svc.restart1) and exited 0
        assert s.poll() == {"svc": -signal.SIGTERM, "main": 0}  # the service was stopped at the end
        assert s.log_path("svc") == tmp_path / "logs" / "svc.restart1.log"
        assert (tmp_path / "logs" / "svc.log").exists()


def test_worker_that_cannot_start_is_named(ray_head, tmp_path):
    from realflow.scheduler.ray import RayError

    with _sched(tmp_path, ray_head) as s:
        with pytest.raises(RayError, match=r"could not start worker\(s\) 'ghost': cannot start worker 'ghost': "
                                           r"'/nonexistent/prog': No such file or directory"):
            s.start([_req("fine", "ok", tmp_path), WorkerRequest("ghost", ["/nonexistent/prog"])])


def test_unplaceable_worker_is_named_at_once(ray_head, tmp_path):
    from realflow.scheduler.ray import RayError

    with _sched(tmp_path, ray_head) as s:
        t0 = time.monotonic()
        with pytest.raises(RayError, match=r"worker 'huge' needs 100 CPU but no node .* has that much"):
            s.start([_req("huge", "ok", tmp_path, n_threads=100)])
        assert time.monotonic() - t0 < 10


def test_resources_held_by_another_job_time_out_with_what_is_free(ray_head, tmp_path):
    from realflow.scheduler.ray import RayError

    with _sched(tmp_path / "one", ray_head) as holder:
        holder.start([_req("holder", "sleeper", tmp_path, n_threads=6)])
        with _sched(tmp_path / "two", ray_head, connect_timeout_s=3) as s:  # shares the connection
            with pytest.raises(RayError) as ei:
                s.start([_req("late", "ok", tmp_path, n_threads=4)])
        assert "could not place 1 workers (4 CPU in all: late 4 CPU) within 3.00s" in str(ei.value)
        assert "the cluster has 2 CPU free" in str(ei.value)
        assert holder.running() == ["holder"]


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_unreachable_address_fails_in_one_line_within_the_timeout(tmp_path, server):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    if server == "silent":
        sock.listen(8)  # connects, never answers: ray.init alone would retry for minutes
    port = sock.getsockname()[1]
    code = ("import sys\nfrom realflow.api.deploy import RayConfig\nfrom realflow.scheduler.base import WorkerRequest\n"
            "from realflow.scheduler.ray import RayScheduler, RayError\n"
            f"s = RayScheduler({str(tmp_path)!r}, RayConfig(address='127.0.0.1:{port}', connect_timeout_s=3))\n"
            "try:\n    s.start([WorkerRequest('a', ['true'])])\n"
            "except RayError as e:\n    print('RayError:', e)\n    sys.exit(2)\n")
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        sock.close()
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    line = out.stdout.strip()
    assert "\n" not in line and f"ray.address=127.0.0.1:{port}" in line, line
    if server == "silent":
        assert "within 3.00s (ray.connect_timeout_s)" in line
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(240)
def test_sft_runs_end_to_end_on_ray(ray_head, tmp_path):
    cmd = [sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={tmp_path}", *SMALL_SFT,
           "launcher=ray", f"ray.address={ray_head}", "recover_mode=off"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    logs = tmp_path / "sft" / "trial0" / "logs"
    assert {"master.log", "model_worker"} <= set(os.listdir(logs)), os.listdir(logs)
    assert sorted(os.listdir(logs / "model_worker")) == ["0.log", "1.log"]
    assert "training time:" in res.stdout
    assert "started worker model_worker/1 on" in res.stderr  # by the Ray scheduler, in its bundle
    assert _free_cpus(ray_head) == 8.0
