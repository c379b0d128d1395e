"""Every endpoint that checks authentication logs what it drops, rate-limited per claimed sender.

A flood of forged messages reaches each real endpoint of a run -- the master's and a
worker's RPC sockets, the heartbeat monitor, a trajectory inbox, the gen server's and the
rollout controller's HTTP services -- and each must count every one, keep serving, and
log the first :data:`LOG_FIRST` per claimed sender (naming it), not all of them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import zmq

from realflow.comm import codec
from realflow.comm.auth import Signer, new_secret
from realflow.comm.drop_log import LOG_EVERY, LOG_FIRST, DropLog

pytestmark = pytest.mark.timeout(120)

FLOOD = 3 * LOG_FIRST
SECRET = new_secret()


def _drop_lines(caplog, who: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "realflow.comm.drops" and r.getMessage().startswith(who)]


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_drop_log_rate_limits_per_sender_and_bounds_memory(caplog):
    caplog.set_level(logging.WARNING, logger="realflow.comm.drops")
    log = DropLog("unit", "message")
    for _ in range(2 * LOG_EVERY + 5):
        log("mallory", "bad mac")
    log("eve", "bad mac")
    lines = _drop_lines(caplog, "unit")
    assert log.count == 2 * LOG_EVERY + 6
    assert len(lines) == log.logged == LOG_FIRST + 2 + 1  # first 10, the 1000th and 2000th, eve's first
    assert "'mallory'" in lines[0] and "bad mac" in lines[0] and f"({2 * LOG_EVERY} dropped" in lines[-2]
    for i in range(20_000):  # made-up names do not grow memory without bound
        log(f"sender{i}", "x")
    assert len(log._per_sender) <= 10_000


def test_master_and_worker_rpc_sockets_log_forged_frames_rate_limited(caplog):
    from realflow.comm.rpc import MasterEndpoint, WorkerEndpoint

    caplog.set_level(logging.WARNING, logger="realflow.comm.drops")
    master = MasterEndpoint(SECRET)
    evil = zmq.Context.instance().socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.setsockopt(zmq.IDENTITY, b"evil")
    evil.connect(master.address)
    forger = Signer(new_secret(), "evil")
    try:
        for _ in range(FLOOD):
            evil.send_multipart(forger.sign(codec.encode({"k": "hello"}), to="master"))
        deadline = time.monotonic() + 10
        while master.dropped < FLOOD and time.monotonic() < deadline:
            master.poll(0.1)
        assert master.dropped == FLOOD and "evil" not in master.workers
        lines = _drop_lines(caplog, "master")
        assert len(lines) == LOG_FIRST and all("'evil'" in x for x in lines), lines
    finally:
        evil.close()
        master.close()

    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind("tcp://127.0.0.1:*")
    worker = WorkerEndpoint("w9", fake.getsockopt_string(zmq.LAST_ENDPOINT), SECRET)
    stop = threading.Event()
    thread = threading.Thread(target=worker.serve, args=({"echo": lambda p: p}, stop))
    thread.start()
    try:
        assert fake.poll(10_000), "worker did not say hello"
        fake.recv_multipart()
        wrong = Signer(new_secret(), "master")
        for i in range(FLOOD):
            body = codec.encode({"k": "req", "id": i, "h": "echo", "dl": time.time() + 10, "p": i})
            fake.send_multipart([b"w9", *wrong.sign(body, to="w9")])
        _wait(lambda: worker.dropped == FLOOD, "the worker to drop the flood")
        lines = _drop_lines(caplog, "worker 'w9'")
        assert len(lines) == LOG_FIRST and all("'master'" in x for x in lines), lines
    finally:
        stop.set()
        thread.join(5)
        worker.close()
        fake.close()


def test_heartbeat_monitor_and_trajectory_inbox_log_forged_messages_rate_limited(caplog):
    from realflow.comm.heartbeat import HeartbeatMonitor
    from realflow.system.trajectory_inbox import TrajectoryInbox

    caplog.set_level(logging.WARNING, logger="realflow.comm.drops")
    with HeartbeatMonitor(SECRET, timeout=1.0) as mon:
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(mon.address)
        forger = Signer(new_secret(), "forger")
        try:
            _wait(lambda: (pub.send_multipart(forger.sign(codec.encode({"k": "beat"}), to="monitor"))
                           or mon.dropped > 0), "the subscription (PUB drops until then)")
            before = mon.dropped
            for _ in range(FLOOD):
                pub.send_multipart(forger.sign(codec.encode({"k": "beat"}), to="monitor"))
            _wait(lambda: mon.dropped >= before + FLOOD, "the monitor to drop the flood")
        finally:
            pub.close()
    lines = _drop_lines(caplog, "heartbeat monitor")
    assert len(lines) == LOG_FIRST and all("'forger'" in x for x in lines), lines

    inbox = TrajectoryInbox("model_worker/3", SECRET)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(inbox.address)
    try:
        forger = Signer(new_secret(), "rollout_worker/9")
        for _ in range(FLOOD):
            push.send_multipart(forger.sign(codec.encode({"not": "a rollout"}), "model_worker/3"))
        _wait(lambda: inbox.dropped == FLOOD, "the inbox to drop the flood")
        assert inbox.received == 0
    finally:
        push.close()
        inbox.close()
    lines = _drop_lines(caplog, "model_worker/3 trajectory inbox")
    assert len(lines) == LOG_FIRST and all("'rollout_worker/9'" in x for x in lines), lines


def test_http_services_log_requests_without_the_token_rate_limited(caplog, tmp_path):
    """The gen server and the rollout controller answer 401 and log it, rate-limited per peer."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from parallel.generation import GenerationEngine
    from parallel.testing import make_tiny_hf
    from realflow.api.rollout import RolloutSpec
    from realflow.rollout.controller import RolloutController, build_controller_app
    from realflow.rollout.gen_server import GenServer, build_app

    caplog.set_level(logging.WARNING, logger="realflow.comm.drops")
    make_tiny_hf(str(tmp_path), seed=1, family="qwen2")
    server = GenServer(GenerationEngine.from_hf(str(tmp_path)), str(tmp_path))
    spec = RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d")
    controller = RolloutController(spec, [], "the-key")

    async def flood(app, path: str, method: str) -> tuple[list[int], int]:
        async with TestServer(app, host="127.0.0.1") as ts, aiohttp.ClientSession() as session:
            statuses = []
            for i in range(FLOOD):
                headers = {"Authorization": "Bearer wrong"} if i % 2 else {}
                async with session.request(method, ts.make_url(path), json={}, headers=headers) as resp:
                    statuses.append(resp.status)
            async with session.get(ts.make_url("/health" if path == "/generate" else "/state"),
                                   headers={"Authorization": "Bearer the-key"}) as resp:
                return statuses, resp.status

    statuses, ok = asyncio.run(flood(build_app(server, "the-key"), "/generate", "POST"))
    assert statuses == [401] * FLOOD and ok == 200 and server.unauthorized.count == FLOOD
    statuses, ok = asyncio.run(flood(build_controller_app(controller, "the-key"), "/admit", "POST"))
    assert statuses == [401] * FLOOD and ok == 200
    for who in ("gen server", "rollout controller"):
        lines = _drop_lines(caplog, who)
        assert len(lines) == LOG_FIRST and all("'127.0.0.1'" in x and "API key" in x for x in lines), (who, lines)
