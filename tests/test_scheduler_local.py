"""LocalScheduler with real processes: failures stop the job, nothing is left behind.

"No pid left" is checked independently of the code under test: os.kill(pid, 0) plus
the state in /proc (a zombie is dead, merely not yet reaped by its new parent).
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from realflow.scheduler.local import LocalScheduler, WorkerFailed

pytestmark = pytest.mark.timeout(60)

# Worker program: python -c WORKER MODE PIDDIR [ARG]
WORKER = r"""
import os, signal, subprocess, sys, time
mode, piddir = sys.argv[1], sys.argv[2]
me = os.environ["REALFLOW_ROLE"]

def record(pids):
    tmp = os.path.join(piddir, me + ".tmp")
    with open(tmp, "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(tmp, os.path.join(piddir, me + ".pids"))

def family(new_session=True):
    kids = [subprocess.Popen(["sleep", "600"]),                                   # plain grandchild
            subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 600"])]       # ignores SIGTERM
    if new_session:
        kids.append(subprocess.Popen(["sleep", "600"], start_new_session=True))   # left the group
    return [os.getpid()] + [k.pid for k in kids]

if mode == "sleeper":
    record(family(new_session=sys.argv[3:] != ["same-session"]))
    time.sleep(600)
elif mode == "fail":
    other = os.path.join(piddir, sys.argv[3] + ".pids")
    while not os.path.exists(other):        # fail only once the other worker has its family
        time.sleep(0.05)
    record(family(new_session=False))   # a setsid child orphaned at once would escape: see local.py
    for i in range(30):
        print(f"fail line {i}")
    print("about to fail", file=sys.stderr)
    sys.exit(3)
elif mode == "selfkill":
    print("going down", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "ok":
    print(" ".join(os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "REALFLOW_NUM_THREADS",
                                           "REALFLOW_ROLE", "EXTRA")))
"""

# Launcher program for signal tests: python -c LAUNCHER LOGDIR PIDDIR [same-session]
# A launcher started from a terminal gets Ctrl-C. Processes started in the background by a
# non-interactive shell inherit SIGINT as *ignored* (POSIX), and Python then installs no
# handler: restore the terminal's default so the test exercises our handling, not the
# inherited disposition of whoever ran pytest.
LAUNCHER = r"""
import json, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from realflow.scheduler.local import LocalScheduler
log_dir, piddir, worker = sys.argv[1], sys.argv[2], sys.argv[3]
extra = sys.argv[4:]
s = LocalScheduler(log_dir, console=True, grace=2.0)
for i in range(2):
    s.submit(f"w{i}", [sys.executable, "-c", worker, "sleeper", piddir, *extra])
print(json.dumps({"reaper": s.reaper_pid, "launcher_workers": [s.pid(n) for n in s.names]}), flush=True)
s.wait()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in (b"Z", b"X")


def wait_for_pids(piddir: Path, names: list[str], timeout: float = 20) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = [piddir / f"{n}.pids" for n in names]
        if all(f.exists() for f in files):
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.05)
    pytest.fail(f"workers {names} did not record their pids within {timeout}s")


def assert_all_gone(pids: list[int], within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if not any(alive(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    pytest.fail(f"pids still alive after {within}s: {left}")


def worker(mode: str, piddir: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", WORKER, mode, str(piddir), *args]


def test_workers_finish_ok_with_thread_env_and_logs(tmp_path):
    out = io.StringIO()
    with LocalScheduler(tmp_path / "logs", console_stream=out) as s:
        s.submit("a", worker("ok", tmp_path), env={"EXTRA": "x1"}, n_threads=3)
        s.submit("b", worker("ok", tmp_path), env={"EXTRA": "x2"})
        assert s.wait(timeout=30) is True
        assert s.poll() == {"a": 0, "b": 0}
    assert (tmp_path / "logs" / "a.log").read_text() == "3 3 3 a x1\n"
    assert (tmp_path / "logs" / "b.log").read_text() == "1 1 1 b x2\n"
    console = out.getvalue().splitlines()
    assert "[a] 3 3 3 a x1" in console and "[b] 1 1 1 b x2" in console


def test_one_failure_stops_all_and_leaves_no_pid(tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    s = LocalScheduler(tmp_path / "logs", console=False, grace=1.0)
    try:
        s.submit("sleeper", worker("sleeper", piddir))
        s.submit("trainer1", worker("fail", piddir, "sleeper"))
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed) as ei:
            s.wait(timeout=40)
        took = time.monotonic() - t0
        pids = wait_for_pids(piddir, ["sleeper", "trainer1"])
        assert len(pids) == 7  # 2 workers + 3 + 2 grandchildren
        assert not [p for p in pids if alive(p)], "stop_all returned with processes alive"
        assert took < 15
    finally:
        s.close()
    e = ei.value
    msg = str(e)
    assert e.name == "trainer1" and e.returncode == 3 and e.signal is None
    assert msg.startswith("worker 'trainer1' (pid ")
    assert "exited with code 3" in msg and "trainer1.log" in msg
    tail = msg.split("\n")[1:]
    assert len(tail) == 20 and tail[-1] == "    | about to fail" and tail[0] == "    | fail line 11"
    assert "fail line 10" not in msg
    assert s.poll()["sleeper"] == -signal.SIGTERM


def test_killed_worker_is_named_with_its_signal(tmp_path):
    with LocalScheduler(tmp_path, console=False) as s:
        s.submit("victim", worker("selfkill", tmp_path))
        s.submit("bystander", ["sleep", "600"])
        with pytest.raises(WorkerFailed, match=r"worker 'victim' \(pid \d+\) was killed by SIGKILL \(9\)") as ei:
            s.wait(timeout=30)
        assert ei.value.signal == 9 and ei.value.log_tail == ["going down"]
        assert not alive(s.pid("bystander"))


def test_stop_all_escalates_to_sigkill_within_grace(tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    with LocalScheduler(tmp_path / "logs", console=False) as s:
        s.submit("w0", worker("sleeper", piddir))
        ready = piddir / "stubborn.ready"  # written once the trap is set (a TERM before it would kill it)
        s.submit("stubborn", ["sh", "-c", f"trap '' TERM; touch {ready}; sleep 600 & wait"])
        pids = wait_for_pids(piddir, ["w0"]) + [s.pid("stubborn")]
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the TERM-ignoring shell did not start within 30 s"
            time.sleep(0.05)
        t0 = time.monotonic()
        s.stop_all(grace=1.0)
        took = time.monotonic() - t0
        assert 0.9 < took < 10  # waited the grace for the TERM-ignoring ones, then SIGKILL
        assert not [p for p in pids if alive(p)]
        assert s.poll()["stubborn"] == -signal.SIGKILL


def test_wait_with_timeout_polls_without_stopping(tmp_path):
    with LocalScheduler(tmp_path, console=False) as s:
        pid = s.submit("model_worker/0", ["sleep", "600"])
        s.submit("model_worker/1", ["sleep", "0.5"])
        t0 = time.monotonic()
        assert s.wait(timeout=0.3) is False
        assert 0.25 < time.monotonic() - t0 < 5
        assert s.running() == ["model_worker/0", "model_worker/1"] and alive(pid)
        assert (tmp_path / "model_worker" / "0.log").exists()
        os.kill(pid, signal.SIGTERM)  # a worker that was terminated counts as failed
        with pytest.raises(WorkerFailed, match=r"'model_worker/0' .* was killed by SIGTERM \(15\)"):
            while not s.wait(timeout=0.2):
                pass
    assert not alive(pid)


@pytest.fixture
def sigint_default():
    """Ctrl-C raises KeyboardInterrupt here even if pytest was started with SIGINT ignored (see LAUNCHER)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_in_process_stops_all(tmp_path, sigint_default):
    with LocalScheduler(tmp_path, console=False, grace=2.0) as s:
        pids = [s.submit(f"w{i}", ["sleep", "600"]) for i in range(2)]
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        assert not [p for p in pids if alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_process_stops_all_within_10s(tmp_path, sig):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs"), str(piddir), WORKER],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(launcher.stdout.readline())
        pids = wait_for_pids(piddir, ["w0", "w1"]) + [info["reaper"]]
        t0 = time.monotonic()
        launcher.send_signal(sig)
        launcher.wait(timeout=10)
        assert_all_gone(pids, within=10 - (time.monotonic() - t0))
        assert time.monotonic() - t0 < 10
        assert launcher.returncode == -signal.SIGINT  # KeyboardInterrupt re-raised after cleanup
    finally:
        launcher.kill()
        launcher.wait()


def test_sigkill_of_launcher_leaves_no_orphans(tmp_path):
    """The launcher cannot clean up after SIGKILL: PR_SET_PDEATHSIG ends the workers and
    the watchdog ends their children, including ones that moved to their own session."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs"), str(piddir), WORKER],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(launcher.stdout.readline())
        pids = wait_for_pids(piddir, ["w0", "w1"])
        time.sleep(2.5)  # > the watchdog's scan interval, so it has seen the setsid grandchildren
        launcher.kill()
        launcher.wait(timeout=10)
        took = assert_all_gone(pids + [info["reaper"]], within=10)
        assert took < 10
    finally:
        launcher.kill()
        launcher.wait()


def test_bad_submissions_are_named(tmp_path):
    with LocalScheduler(tmp_path, console=False) as s:
        for bad in ("a b", "../x", "a//b", "/a", ""):
            with pytest.raises(ValueError, match=f"worker name {bad!r} must be"):
                s.submit(bad, ["true"])
        with pytest.raises(TypeError, match=r"argv\[1\] of worker 'w' must be a str, got int"):
            s.submit("w", ["echo", 3])
        with pytest.raises(ValueError, match="env of worker 'w' sets OMP_NUM_THREADS=8; use n_threads="):
            s.submit("w", ["true"], env={"OMP_NUM_THREADS": "8"})
        with pytest.raises(RuntimeError, match="cannot start worker 'w': 'no-such-binary-xyz'"):
            s.submit("w", ["no-such-binary-xyz"])
        s.submit("w", ["true"])
        with pytest.raises(ValueError, match="worker name 'w' was already submitted"):
            s.submit("w", ["true"])
        with pytest.raises(KeyError, match="no worker named 'x'; workers: w"):
            s.pid("x")
        assert s.wait(timeout=10)
