"""Heartbeats: a killed worker process is reported lost; clean stops and forged beats are not confused with life."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from realflow.comm.auth import SECRET_ENV, Signer, new_secret, secret_to_hex
from realflow.comm import codec
from realflow.comm.heartbeat import Heartbeater, HeartbeatMonitor

pytestmark = pytest.mark.timeout(90)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = new_secret()

BEATING_WORKER = textwrap.dedent("""
    import sys, time
    from realflow.comm.auth import secret_from_env
    from realflow.comm.heartbeat import Heartbeater
    hb = Heartbeater(sys.argv[1], sys.argv[2], secret_from_env(), interval=0.2, status=lambda: {"step": 3}).start()
    time.sleep(600)
""")


def wait_until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_killed_worker_process_is_lost():
    with HeartbeatMonitor(SECRET, timeout=1.0) as mon:
        assert mon.address.startswith("tcp://127.0.0.1:")
        env = dict(os.environ, PYTHONPATH=REPO, **{SECRET_ENV: secret_to_hex(SECRET)})
        proc = subprocess.Popen([sys.executable, "-c", BEATING_WORKER, "hb0", mon.address], env=env)
        try:
            wait_until(lambda: mon.last_seen("hb0") is not None, 60, "the first beat")
            assert abs(mon.last_seen("hb0") - time.time()) < 1.0
            assert mon.status("hb0") == {"step": 3}
            time.sleep(1.5)  # beating steadily: never lost
            assert mon.lost_workers() == []
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            wait_until(lambda: mon.lost_workers() == ["hb0"], 5, "hb0 to be reported lost")
            detected_after = time.monotonic() - killed_at
            assert 0.7 <= detected_after <= 2.5, detected_after
        finally:
            proc.kill()
            proc.wait(10)


def test_clean_stop_is_not_loss_and_expected_silence_is():
    with HeartbeatMonitor(SECRET, timeout=0.6) as mon:
        mon.expect(["quiet"])
        hb = Heartbeater("polite", mon.address, SECRET, interval=0.1).start()
        wait_until(lambda: mon.last_seen("polite") is not None, 10, "a beat from 'polite'")
        hb.stop()
        wait_until(lambda: "polite" in mon.left_workers(), 5, "the bye")
        time.sleep(0.8)
        assert mon.lost_workers() == ["quiet"]  # never beat at all
        assert mon.last_seen("quiet") is None


def test_a_starved_monitor_does_not_declare_live_workers_lost():
    """Silence is judged by what the monitor has read: while its thread cannot run (here: blocked
    on its lock; in a run: a long GIL-holding call in the master on an overloaded host) beats pile
    up unread, and a worker beating all along must not be reported lost when it looks again."""
    with HeartbeatMonitor(SECRET, timeout=0.5) as mon:
        hb = Heartbeater("alive", mon.address, SECRET, interval=0.1).start()
        try:
            wait_until(lambda: mon.last_seen("alive") is not None, 10, "a beat from 'alive'")
            with mon._lock:  # the monitor thread blocks in its next beat's bookkeeping
                time.sleep(1.5)
            assert mon.lost_workers() == []
            time.sleep(0.3)
            assert mon.lost_workers() == []
        finally:
            hb.stop()


def test_forged_beats_are_dropped():
    with HeartbeatMonitor(SECRET, timeout=1.0) as mon:
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(mon.address)
        try:
            wrong = Signer(new_secret(), "forger")
            right = Signer(SECRET, "honest")
            beat = codec.encode({"k": "beat"})

            def send_until_dropped():  # PUB drops until the subscription arrived: keep sending
                pub.send_multipart(wrong.sign(beat, to="monitor"))
                pub.send_multipart([b"unsigned beat"])
                pub.send_multipart(right.sign(beat, to="monitor"))
                return mon.dropped >= 2 and mon.last_seen("honest") is not None

            wait_until(send_until_dropped, 10, "beats to reach the monitor")
            assert mon.last_seen("forger") is None
        finally:
            pub.close()
