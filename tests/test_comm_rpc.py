"""Request/reply over real ZMQ sockets with a worker in a separate process (plus forged-frame attacks)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq

from realflow.comm import codec
from realflow.comm.auth import SECRET_ENV, Signer, Verifier, new_secret, secret_to_hex
from realflow.comm.rpc import (MasterEndpoint, RemoteError, ReplyThen, RequestTimeout, WorkerEndpoint,
                               WorkersMissing, WorkerUnreachable)

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = new_secret()

WORKER_CODE = textwrap.dedent("""
    import signal, sys, threading, time
    import torch
    torch.set_num_threads(1)
    from realflow.comm.auth import secret_from_env
    from realflow.comm.rpc import WorkerEndpoint

    calls = {"record": 0}
    def record(p):
        calls["record"] += 1
        return calls["record"]
    def boom(p):
        raise ValueError(f"kaboom {p}")
    handlers = {
        "echo": lambda p: p,
        "boom": boom,
        "sleep": lambda p: time.sleep(p) or "slept",
        "record": record,
        "count": lambda p: calls["record"],
        "double": lambda p: {k: v * 2 for k, v in p.items()},
        "bad_result": lambda p: {"x": object()},
    }
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    with WorkerEndpoint(sys.argv[1], sys.argv[2], secret_from_env()) as w:
        w.serve(handlers, stop)
""")


def spawn_worker(name: str, address: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO, **{SECRET_ENV: secret_to_hex(SECRET)})
    return subprocess.Popen([sys.executable, "-c", WORKER_CODE, name, address], env=env)


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def master():
    m = MasterEndpoint(SECRET)
    assert m.address.startswith("tcp://127.0.0.1:")
    proc = spawn_worker("w0", m.address)
    try:
        m.wait_for_workers(["w0"], timeout=60)
        yield m
    finally:
        stop_process(proc)
        m.close()
    assert proc.returncode == 0  # the serve loop exited cleanly on SIGTERM


def test_round_trip_with_tensors_across_processes(master):
    payload = {"bf16": torch.randn(4, 3).bfloat16(), "ids": torch.arange(10), "mask": torch.tensor([True, False]),
               "meta": {"answer": "42", "n": (1, 2)}}
    out = master.call("w0", "echo", payload, timeout=10)
    for k in ["bf16", "ids", "mask"]:
        assert out[k].dtype == payload[k].dtype
        assert torch.equal(out[k].view(torch.uint8), payload[k].view(torch.uint8))
    assert out["meta"] == {"answer": "42", "n": (1, 2)}
    doubled = master.call("w0", "double", {"x": torch.ones(3, dtype=torch.float16)}, timeout=10)
    assert torch.equal(doubled["x"], torch.full((3,), 2.0, dtype=torch.float16))


def test_large_frames_zero_copy_path(master):
    """Frames >= 64 KiB go with copy=False and come back as zmq.Frame-backed tensors."""
    big = torch.randn(1 << 20).bfloat16()  # 2 MiB
    blob = os.urandom(300_000)
    out = master.call("w0", "echo", {"big": big, "blob": codec.RawBuffer(blob)}, timeout=30)
    assert torch.equal(out["big"].view(torch.uint8), big.view(torch.uint8))
    assert bytes(out["blob"]) == blob
    out["big"][0] = 1.0  # decoded tensors alias their private frame and are writable
    assert out["big"][0].item() == 1.0


def test_pipelined_requests(master):
    ids = [master.request("w0", "echo", i, timeout=10) for i in range(50)]
    assert master.workers_of(ids) == {"w0"}  # (the master's heartbeat check asks who it waits for)
    results = master.wait(ids, timeout=10)
    assert [results[i] for i in ids] == list(range(50))
    assert master.workers_of(ids) == set()  # collected: nobody is waited for any more
    with pytest.raises(ValueError, match="unknown request id"):
        master.wait(ids[:1])  # already collected


def test_handler_exception_is_remote_error(master):
    with pytest.raises(RemoteError) as ei:
        master.call("w0", "boom", 7, timeout=10)
    e = ei.value
    assert (e.worker, e.handler) == ("w0", "boom")
    assert "ValueError: kaboom 7" in str(e) and "Traceback" in e.remote_traceback
    with pytest.raises(RemoteError, match="no handler 'nope'"):
        master.call("w0", "nope", timeout=10)
    with pytest.raises(RemoteError, match=r"cannot encode object at payload\['x'\]"):
        master.call("w0", "bad_result", timeout=10)
    assert master.call("w0", "echo", "still serving", timeout=10) == "still serving"


def test_a_failed_request_shows_before_its_siblings_answer(master):
    """``any_failed``: the master learns of one failed request while another of the same batch is
    still running (in a run, that one may be blocked in a collective with the failed worker and
    never answer: Master._wait stops waiting and raises the failure, naming worker and handler)."""
    bad = master.request("w0", "boom", 3, timeout=10)
    slow = master.request("w0", "sleep", 1.5, timeout=10)
    t0 = time.monotonic()
    while not master.any_failed([slow, bad]):
        master.poll_once(0.1)
        assert time.monotonic() - t0 < 10
    assert not master.done([slow, bad])  # the sibling has not answered, yet the failure is known
    with pytest.raises(RemoteError, match="kaboom 3"):
        master.wait([slow, bad], timeout=10)
    assert master.wait([slow], timeout=10)[slow] == "slept"


def test_deadline_names_worker_handler_and_request(master):
    t0 = time.monotonic()
    rid = master.request("w0", "sleep", 1.0, timeout=0.3)
    with pytest.raises(RequestTimeout) as ei:
        master.wait([rid], timeout=30)
    assert time.monotonic() - t0 < 0.9
    assert ei.value.missing == [(rid, "w0", "sleep")]
    assert "'w0'" in str(ei.value) and "'sleep'" in str(ei.value) and f"request {rid}" in str(ei.value)
    # the wait timeout (shorter than the deadline) names it too
    rid2 = master.request("w0", "sleep", 0.5, timeout=10)
    with pytest.raises(RequestTimeout, match=f"'w0' handler 'sleep' request {rid2}"):
        master.wait([rid2], timeout=0.1)
    assert master.call("w0", "echo", 1, timeout=10) == 1  # worker finished sleeping and serves again


def test_expired_request_is_answered_not_run(master):
    before = master.call("w0", "count", timeout=10)
    slow = master.request("w0", "sleep", 0.8, timeout=10)
    late = master.request("w0", "record", None, timeout=0.2)  # queued behind the sleep: expires in the queue
    assert master.wait([slow], timeout=10)[slow] == "slept"
    master.poll(2.0)  # the worker's "expired" answer
    with pytest.raises(RequestTimeout, match="after its deadline and did not run it"):
        master.wait([late], timeout=5)
    assert master.call("w0", "count", timeout=10) == before  # the handler never ran


def test_wait_for_workers_names_missing(master):
    t0 = time.monotonic()
    with pytest.raises(WorkersMissing) as ei:
        master.wait_for_workers(["w0", "ghost1", "ghost2"], timeout=0.5)
    assert ei.value.missing == ["ghost1", "ghost2"]
    assert "ghost1" in str(ei.value) and "ghost2" in str(ei.value)
    assert 0.5 <= time.monotonic() - t0 < 2.0


def test_bad_requests_fail_at_the_edge(master):
    with pytest.raises(WorkerUnreachable, match="'ghost'"):
        master.request("ghost", "echo", 1)
    with pytest.raises(TypeError, match=r"payload\['fn'\]"):
        master.request("w0", "echo", {"fn": print})
    with pytest.raises(ValueError, match="timeout"):
        master.request("w0", "echo", 1, timeout=0)


def _raw_dealer(address: str, identity: bytes) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, identity)
    s.connect(address)
    return s


def test_forged_frames_to_master_are_dropped(master, caplog):
    caplog.set_level(logging.WARNING, logger="realflow.comm.rpc")
    before = master.dropped
    hello = codec.encode({"k": "hello"})
    socks = []
    try:
        evil = _raw_dealer(master.address, b"evil")
        socks.append(evil)
        evil.send_multipart([b"garbage"])  # unsigned, one frame
        evil.send_multipart([b"\x00" * 32 + b"not msgpack \xc1", b"x"])  # garbled header
        evil.send_multipart(Signer(new_secret(), "evil").sign(hello, to="master"))  # wrong secret
        spy = _raw_dealer(master.address, b"spy")
        socks.append(spy)
        good = [bytes(memoryview(f)) for f in Signer(SECRET, "spy").sign(hello, to="master")]
        spy.send_multipart([good[0][:-2]])  # truncated
        flipped = bytearray(good[-1])
        flipped[-1] ^= 1
        spy.send_multipart([bytes(flipped)])  # tampered
        spy.send_multipart(good)  # valid: accepted
        spy.send_multipart(good)  # exact replay
        imposter = _raw_dealer(master.address, b"imposter")
        socks.append(imposter)
        imposter.send_multipart(Signer(SECRET, "w0").sign(hello, to="master"))  # signed as w0, connected as imposter
        deadline = time.monotonic() + 10
        while master.dropped - before < 7 and time.monotonic() < deadline:
            master.poll(0.1)
    finally:
        for s in socks:
            s.close()
    assert master.dropped - before == 7
    assert "spy" in master.workers and "evil" not in master.workers
    logged = caplog.text
    for claimed in ["'evil'", "'spy'", "'w0'", "<identity evil>"]:
        assert claimed in logged, claimed
    assert master.call("w0", "echo", "alive", timeout=10) == "alive"


def test_forged_frames_to_worker_are_dropped():
    """A fake master (raw ROUTER) attacks a worker; the worker keeps serving valid requests."""
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind("tcp://127.0.0.1:*")
    address = fake.getsockopt_string(zmq.LAST_ENDPOINT)
    calls = []
    stop = threading.Event()
    worker = WorkerEndpoint("wf", address, SECRET)
    thread = threading.Thread(target=worker.serve, args=({"record": calls.append, "echo": lambda p: p}, stop))
    thread.start()
    signer, verifier = Signer(SECRET, "master"), Verifier(SECRET, "master")

    def recv_body(timeout=10.0):
        assert fake.poll(int(timeout * 1000)), "worker did not answer"
        frames = fake.recv_multipart()
        env, payload = verifier.verify(frames[1:])
        return codec.decode(payload)

    def req(rid, handler, payload=None):
        return codec.encode({"k": "req", "id": rid, "h": handler, "dl": time.time() + 10, "p": payload})

    try:
        assert recv_body()["k"] == "hello"
        valid = [bytes(memoryview(f)) for f in signer.sign(req(1, "record", "ok"), to="wf")]
        fake.send_multipart([b"wf", b"garbage"])
        fake.send_multipart([b"wf", *Signer(new_secret(), "master").sign(req(2, "record", "forged"), to="wf")])
        fake.send_multipart([b"wf", valid[0][:-2]])  # truncated
        fake.send_multipart([b"wf", *signer.sign(req(3, "record", "misaddressed"), to="someone-else")])
        fake.send_multipart([b"wf", *valid])  # the real one
        assert recv_body() == {"k": "rep", "id": 1, "ok": True, "r": None}
        fake.send_multipart([b"wf", *valid])  # replay
        fake.send_multipart([b"wf", *signer.sign(req(4, "echo", "still here"), to="wf")])
        assert recv_body()["r"] == "still here"
        assert calls == ["ok"]
        assert worker.dropped == 5
    finally:
        stop.set()
        thread.join(5)
        worker.close()
        fake.close()


def test_master_restart_workers_say_hello_again():
    first = MasterEndpoint(SECRET)
    port = int(first.address.rsplit(":", 1)[1])
    stop = threading.Event()
    worker = WorkerEndpoint("wr", first.address, SECRET)
    thread = threading.Thread(target=worker.serve, args=({"echo": lambda p: p}, stop))
    thread.start()
    try:
        first.wait_for_workers(["wr"], timeout=10)
        first.close()
        second = None
        for _ in range(50):  # the port is released asynchronously
            try:
                second = MasterEndpoint(SECRET, port=port)
                break
            except zmq.ZMQError:
                time.sleep(0.1)
        assert second is not None
        with second:
            second.wait_for_workers(["wr"], timeout=10)  # probe -> hello again
            assert second.call("wr", "echo", 5, timeout=10) == 5
    finally:
        stop.set()
        thread.join(5)
        worker.close()


def test_reply_then_runs_after_the_reply_and_before_the_next_request():
    """``ReplyThen.then`` starts only once the reply is out (it waits for the test to have the reply in hand),
    finishes before the next request is served, and a failure there refuses every later request by name."""
    got_reply = threading.Event()
    done: list[str] = []

    def after():
        assert got_reply.wait(10), "then() ran before the reply reached the master"
        time.sleep(0.05)  # a slow tail: the next request must still see its effect
        done.append("stored")

    def broken_after():
        raise OSError("disk full while storing")

    handlers = {
        "store": lambda p: ReplyThen({"ok": p}, after),
        "seen": lambda p: list(done),
        "fail_later": lambda p: ReplyThen("fine", broken_after),
    }
    with MasterEndpoint(SECRET) as m:
        stop = threading.Event()
        worker = WorkerEndpoint("wt", m.address, SECRET)
        thread = threading.Thread(target=worker.serve, args=(handlers, stop))
        thread.start()
        try:
            m.wait_for_workers(["wt"], timeout=10)
            assert m.call("wt", "store", 3, timeout=10) == {"ok": 3}
            got_reply.set()
            assert m.call("wt", "seen", None, timeout=10) == ["stored"]
            assert m.call("wt", "fail_later", None, timeout=10) == "fine"
            for _ in range(2):  # sticky: the worker's state is no longer what the master believes
                refused = r"(?s)after replying to request \d+ \(.fail_later.\) failed.*disk full"
                with pytest.raises(RemoteError, match=refused):
                    m.call("wt", "seen", None, timeout=10)
        finally:
            stop.set()
            thread.join(5)
            worker.close()
