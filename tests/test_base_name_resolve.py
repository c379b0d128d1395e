"""Name resolution against real backends: a directory, a real etcd and a real redis-server.

Every behaviour test runs on all backends through the ``resolver`` fixture; the
multi-process tests start real Python processes that use the same backend.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from realflow.base.name_resolve import (
    NameExists,
    NameNotFound,
    NameResolveConfig,
    NameResolveError,
    NameWaitTimeout,
    make_name_resolver,
)
from realflow.base.name_resolve_redis import PASSWORD_ENV, RedisNameResolver, glob_escape
from realflow.base.network import find_free_port
from realflow.scheduler.proc import terminate_all

pytestmark = pytest.mark.timeout(60)

# A tiny program run in child processes: python -c CHILD '<config json>' MODE ARGS...
CHILD = r"""
import json, sys, time
from realflow.base.name_resolve import NameExists, NameResolveConfig, make_name_resolver
r = make_name_resolver(NameResolveConfig(**json.loads(sys.argv[1])))
mode, args = sys.argv[2], sys.argv[3:]
if mode == "own":            # own TTL keys until killed
    ttl = float(args[0])
    for k in args[1:]:
        r.add(k, "alive", ttl=ttl)
    print("ready", flush=True)
    time.sleep(600)
elif mode == "add_later":    # add a key after a delay
    time.sleep(float(args[0]))
    r.add(args[1], args[2])
elif mode == "race":         # start together, write own keys, race for one shared key
    start, prefix, n, me = float(args[0]), args[1], int(args[2]), args[3]
    while time.time() < start:
        time.sleep(0.001)
    won = False
    for i in range(n):
        r.add(f"{prefix}/keys/{me}-{i}", me)
        if i == n // 2:
            try:
                r.add(f"{prefix}/leader", me)
                won = True
            except NameExists:
                pass
    print("won" if won else "lost", flush=True)
"""


REDIS_INSTALL_HINT = "apt-get update && apt-get install -y redis-server"


@pytest.fixture(scope="module")
def start_redis(tmp_path_factory):
    """``start(*extra_args) -> port``: a real redis-server on 127.0.0.1 (no persistence),
    answering PING; every one started is killed with the module.

    A missing redis-server is a test FAILURE, not a skip: CI must install it."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"redis-server not found on PATH; install it ({REDIS_INSTALL_HINT})", pytrace=False)
    procs: list[subprocess.Popen] = []

    def start(*extra: str) -> int:
        data_dir = tmp_path_factory.mktemp("redis")
        port = find_free_port()
        log = open(data_dir / "redis.log", "wb")
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(data_dir), *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        procs.append(proc)
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited with {proc.returncode}; see {data_dir / 'redis.log'}",
                            pytrace=False)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return port
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"redis-server on port {port} not answering after 30s; see {data_dir / 'redis.log'}",
                            pytrace=False)
            time.sleep(0.05)

    yield start
    terminate_all(procs, grace=10)


@pytest.fixture(scope="module")
def redis_server(start_redis):
    """(host, port) of one real redis-server shared by the module's tests."""
    return "127.0.0.1", start_redis()


@pytest.fixture(params=["file", "etcd", "redis"])
def backend(request, tmp_path):
    """(NameResolveConfig, unique key prefix) for one backend."""
    if request.param == "file":
        cfg = NameResolveConfig(type="file", root=str(tmp_path / "names"))
    else:
        host, port = request.getfixturevalue(f"{request.param}_server")
        cfg = NameResolveConfig(type=request.param, host=host, port=port)
    return cfg, f"test/{uuid.uuid4().hex[:10]}"


@pytest.fixture
def resolver(backend):
    cfg, _ = backend
    r = make_name_resolver(cfg)
    yield r
    r.close()


@pytest.fixture
def ns(backend):
    return backend[1]


def run_child(cfg: NameResolveConfig, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(dataclasses.asdict(cfg)), *args],
                            stdout=subprocess.PIPE, text=True, **kw)


def wait_gone(r, key: str, timeout: float) -> float:
    """Seconds until ``key`` disappeared; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            r.get(key)
        except NameNotFound:
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"key {key} still present after {timeout}s")


def test_add_get_replace(resolver, ns):
    key = f"{ns}/worker/0"
    resolver.add(key, "tcp://127.0.0.1:5000 ünïcode")
    assert resolver.get(key) == "tcp://127.0.0.1:5000 ünïcode"
    with pytest.raises(NameExists, match=f"'{key}' already exists"):
        resolver.add(key, "other")
    assert resolver.get(key) == "tcp://127.0.0.1:5000 ünïcode"
    resolver.add(key, "new", replace=True)
    assert resolver.get("/" + key + "/") == "new"  # surrounding slashes are normalized


def test_missing_key_is_keyerror_naming_key(resolver, ns):
    with pytest.raises(KeyError) as ei:
        resolver.get(f"{ns}/nope")
    assert isinstance(ei.value, NameNotFound)
    assert f"'{ns}/nope' not found" in str(ei.value)
    with pytest.raises(NameNotFound, match="nope"):
        resolver.delete(f"{ns}/nope")


def test_subtree_is_component_wise(resolver, ns):
    for k, v in [("a", "1"), ("a/b", "2"), ("a/b/c", "3"), ("ab", "4"), ("a-x", "5")]:
        resolver.add(f"{ns}/{k}", v)
    assert resolver.get_subtree(f"{ns}/a") == {f"{ns}/a": "1", f"{ns}/a/b": "2", f"{ns}/a/b/c": "3"}
    assert resolver.find_subtree(f"{ns}/a/b") == [f"{ns}/a/b", f"{ns}/a/b/c"]
    assert resolver.find_subtree(f"{ns}/zzz") == []
    resolver.delete(f"{ns}/a/b")
    assert resolver.find_subtree(f"{ns}/a") == [f"{ns}/a", f"{ns}/a/b/c"]
    assert resolver.clear_subtree(f"{ns}/a") == 2
    assert resolver.find_subtree(ns) == [f"{ns}/a-x", f"{ns}/ab"]


def test_wait_returns_value_added_by_another_process(resolver, backend, ns):
    cfg, _ = backend
    child = run_child(cfg, "add_later", "0.5", f"{ns}/late", "here")
    try:
        t0 = time.monotonic()
        assert resolver.wait(f"{ns}/late", timeout=20) == "here"
        assert time.monotonic() - t0 >= 0.3
    finally:
        child.wait(timeout=20)
    assert child.returncode == 0


def test_wait_timeout_names_key_and_duration(resolver, ns):
    t0 = time.monotonic()
    with pytest.raises(NameWaitTimeout) as ei:
        resolver.wait(f"{ns}/never", timeout=0.6)
    took = time.monotonic() - t0
    assert 0.55 <= took < 3
    msg = str(ei.value)
    assert f"'{ns}/never'" in msg and "0.6" in msg and "timed out" in msg
    assert isinstance(ei.value, TimeoutError)


def test_wait_subtree(resolver, ns):
    resolver.add(f"{ns}/w/0", "a")
    resolver.add(f"{ns}/w/1", "b")
    assert resolver.wait_subtree(f"{ns}/w", 2, timeout=5) == {f"{ns}/w/0": "a", f"{ns}/w/1": "b"}
    with pytest.raises(NameWaitTimeout) as ei:
        resolver.wait_subtree(f"{ns}/w", 3, timeout=0.3)
    msg = str(ei.value)
    assert f"3 names under '{ns}/w'" in msg and f"found 2: {ns}/w/0, {ns}/w/1" in msg


def test_ttl_key_dies_with_its_owner_and_replace_detaches(resolver, backend, ns):
    """Liveness: the owner's keep-alive holds a key past its TTL; killing the owner
    makes it vanish after the TTL. A key replaced by another writer is no longer the
    dead owner's and survives."""
    cfg, _ = backend
    ttl = 2.0
    live, taken = f"{ns}/hb/owner", f"{ns}/hb/taken"
    child = run_child(cfg, "own", str(ttl), live, taken)
    try:
        assert child.stdout.readline().strip() == "ready"
        resolver.add(taken, "mine now", replace=True)
        time.sleep(ttl * 1.5)  # longer than the TTL: only the refresher keeps it
        assert resolver.get(live) == "alive"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        gone_after = wait_gone(resolver, live, timeout=ttl + 5)
        assert gone_after > 0.2  # it expired, nobody deleted it at once
        assert resolver.get(taken) == "mine now"
    finally:
        child.kill()
        child.wait()


def test_stop_keep_alive_lets_key_expire(resolver, ns):
    resolver.add(f"{ns}/tmp", "x", ttl=2)
    resolver.add(f"{ns}/perm", "y")
    assert resolver.owned_keys() == [f"{ns}/tmp"]
    resolver.stop_keep_alive()
    assert resolver.owned_keys() == []
    assert resolver.get(f"{ns}/tmp") == "x"
    wait_gone(resolver, f"{ns}/tmp", timeout=6)
    assert resolver.get(f"{ns}/perm") == "y"
    resolver.add(f"{ns}/tmp", "again")  # an expired key can be added without replace
    assert resolver.get(f"{ns}/tmp") == "again"


def test_delete_and_clear_owned_ttl_keys(resolver, ns):
    resolver.add(f"{ns}/hb/a", "1", ttl=5)
    resolver.add(f"{ns}/hb/b", "2", ttl=5)
    resolver.add(f"{ns}/hb/c", "3", ttl=5)
    resolver.delete(f"{ns}/hb/a")
    assert resolver.owned_keys() == [f"{ns}/hb/b", f"{ns}/hb/c"]
    with pytest.raises(NameNotFound):
        resolver.get(f"{ns}/hb/a")
    assert resolver.clear_subtree(f"{ns}/hb") == 2
    assert resolver.owned_keys() == [] and resolver.find_subtree(ns) == []


def test_concurrent_writers_exactly_one_wins(resolver, backend, ns):
    cfg, _ = backend
    n_procs, n_keys = 4, 10
    start = time.time() + 1.5  # all children begin writing at the same moment
    children = [run_child(cfg, "race", str(start), ns, str(n_keys), f"p{i}") for i in range(n_procs)]
    results = []
    for c in children:
        out, _ = c.communicate(timeout=30)
        assert c.returncode == 0
        results.append(out.strip())
    assert sorted(results) == ["lost"] * (n_procs - 1) + ["won"]
    winner = f"p{results.index('won')}"
    assert resolver.get(f"{ns}/leader") == winner
    keys = resolver.get_subtree(f"{ns}/keys")
    assert len(keys) == n_procs * n_keys
    assert all(k.rsplit("/", 1)[1].startswith(v + "-") for k, v in keys.items())


def test_bad_keys_and_values_are_named(tmp_path):
    r = make_name_resolver(NameResolveConfig(type="file", root=str(tmp_path)))
    for bad, why in [("", "empty"), ("a//b", "empty component"), ("a/../b", "must not start with '.'"),
                     ("a/.hidden", "must not start with '.'"), ("a b", "may only contain"),
                     ("exp/hmac_secret", "looks like a secret")]:
        with pytest.raises(NameResolveError, match=why):
            r.add(bad, "v")
    with pytest.raises(NameResolveError, match="value of 'k' must be a str, got int"):
        r.add("k", 3)
    with pytest.raises(NameResolveError, match="ttl of 'k' must be > 0"):
        r.add("k", "v", ttl=0)
    r.close()
    with pytest.raises(NameResolveError, match="closed"):
        r.add("k", "v")


def test_runs_do_not_see_each_others_names(resolver, ns):
    """Keys of other experiments/trials (same server or directory) never show up in a
    run's subtree, nor do they go when that run's subtree is cleared."""
    runs = [f"{ns}/realflow/exp/trial0", f"{ns}/realflow/exp/trial01", f"{ns}/realflow/exp/trial1",
            f"{ns}/realflow/exp0/trial0", f"{ns}/realflow/exp-b/trial0"]
    for run in runs:
        resolver.add(f"{run}/workers/0", run, ttl=30)
        resolver.add(f"{run}/master", run)
    for run in runs:
        assert resolver.get_subtree(run) == {f"{run}/master": run, f"{run}/workers/0": run}
    assert resolver.find_subtree(f"{ns}/realflow/exp") == [
        f"{runs[0]}/master", f"{runs[0]}/workers/0", f"{runs[1]}/master", f"{runs[1]}/workers/0",
        f"{runs[2]}/master", f"{runs[2]}/workers/0"]
    assert resolver.clear_subtree(runs[0]) == 2
    assert resolver.find_subtree(runs[0]) == []
    for run in runs[1:]:
        assert len(resolver.find_subtree(run)) == 2


def test_make_name_resolver_from_config_or_dict(tmp_path):
    with pytest.raises(NameResolveError, match="name_resolve.type='zookeeper' is not a known backend; "
                                               "choose 'file', 'etcd' or 'redis'"):
        make_name_resolver(NameResolveConfig(type="zookeeper"))
    with pytest.raises(NameResolveError, match="name_resolve.port=70000 is not a TCP port"):
        make_name_resolver(NameResolveConfig(type="redis", port=70000))
    with pytest.raises(NameResolveError, match="unknown field.*hots"):
        make_name_resolver({"type": "etcd", "hots": "x"})
    r = make_name_resolver({"type": "file", "root": str(tmp_path)})
    r.add("a", "1")
    assert make_name_resolver(NameResolveConfig(root=str(tmp_path))).get("a") == "1"


def test_unreachable_etcd_is_one_clear_error():
    port = find_free_port()
    with pytest.raises(NameResolveError, match=f"etcd at 127.0.0.1:{port} unreachable"):
        make_name_resolver(NameResolveConfig(type="etcd", port=port))


def test_file_backend_is_shared_between_resolvers(tmp_path):
    """Two resolvers on one directory see each other's keys; records are plain JSON."""
    a = make_name_resolver(NameResolveConfig(type="file", root=str(tmp_path)))
    b = make_name_resolver(NameResolveConfig(type="file", root=str(tmp_path)))
    a.add("x/y", "1")
    assert b.get("x/y") == "1"
    rec = json.loads((tmp_path / "x" / "y" / ".value").read_text())
    assert rec["value"] == "1" and rec["expires"] is None
    b.delete("x/y")
    assert not (tmp_path / "x").exists()  # empty directories are pruned
    assert os.listdir(tmp_path) == [".lock"]


# ---- redis backend specifics ----------------------------------------------------------

@pytest.fixture
def redis_raw(redis_server):
    """A plain redis client on the test server, to look at what the backend stored."""
    import redis

    host, port = redis_server
    c = redis.Redis(host=host, port=port, socket_timeout=5, decode_responses=True)
    yield c
    c.close()


def test_redis_ttl_is_redis_expiry_rearmed_by_keep_alive(redis_server, redis_raw):
    """A TTL key carries a real Redis expiry; the keep-alive re-arms it; once the owner
    stops, Redis itself drops it (no client-side bookkeeping)."""
    host, port = redis_server
    ns = f"test/{uuid.uuid4().hex[:10]}"
    r = RedisNameResolver(host, port)
    try:
        r.add(f"{ns}/hb", "x", ttl=1.5)
        r.add(f"{ns}/perm", "y")
        assert 0 < redis_raw.pttl(f"{ns}/hb") <= 1500
        assert redis_raw.pttl(f"{ns}/perm") == -1  # no expiry
        assert json.loads(redis_raw.get(f"{ns}/hb"))["value"] == "x"
        time.sleep(2.5)  # well past the TTL: only the keep-alive holds it
        assert r.get(f"{ns}/hb") == "x" and redis_raw.pttl(f"{ns}/hb") > 0
        r.stop_keep_alive()
        gone_after = wait_gone(r, f"{ns}/hb", timeout=1.5 + 3)
        assert gone_after > 0.2
        assert redis_raw.exists(f"{ns}/hb") == 0 and r.get(f"{ns}/perm") == "y"
    finally:
        r.close()


def test_redis_killed_owner_process_key_expires(redis_server):
    host, port = redis_server
    cfg = NameResolveConfig(type="redis", host=host, port=port)
    key, ttl = f"test/{uuid.uuid4().hex[:10]}/workers/0", 1.5
    child = run_child(cfg, "own", str(ttl), key)
    r = RedisNameResolver(host, port)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(ttl * 1.5)
        assert r.get(key) == "alive"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert wait_gone(r, key, timeout=ttl + 2) <= ttl + 0.5
    finally:
        child.kill()
        child.wait()
        r.close()


def test_redis_replaced_key_is_not_refreshed_by_old_owner(redis_server, redis_raw):
    host, port = redis_server
    key = f"test/{uuid.uuid4().hex[:10]}/leader"
    a, b = RedisNameResolver(host, port), RedisNameResolver(host, port)
    try:
        a.add(key, "a", ttl=1)
        b.add(key, "b", replace=True)  # no TTL: b's key must stay permanent
        time.sleep(1.5)  # a's keep-alive ran and gave up on the key
        assert a.owned_keys() == [] and b.get(key) == "b" and redis_raw.pttl(key) == -1
    finally:
        a.close()
        b.close()


def test_redis_glob_characters_do_not_leak_between_subtrees(redis_server):
    """Keys cannot hold glob characters (rejected by key validation); namespaces can, and
    they are escaped in SCAN patterns, so 't*' does not see 'tx', nor 't[ab]' see 'ta'."""
    host, port = redis_server
    tag = uuid.uuid4().hex[:8]
    names = [f"{tag}*:", f"{tag}x:", f"{tag}[ab]:", f"{tag}a:", f"{tag}?:", f"{tag}\\:"]
    rs = [RedisNameResolver(host, port, namespace=n) for n in names]
    try:
        for i, r in enumerate(rs):
            r.add("exp/trial/w/0", str(i))
            r.add("exp/trial", str(i))
        for i, r in enumerate(rs):
            assert r.get_subtree("exp") == {"exp/trial": str(i), "exp/trial/w/0": str(i)}, names[i]
        assert rs[0].clear_subtree("exp") == 2
        assert all(len(r.find_subtree("exp")) == 2 for r in rs[1:])
        for bad in ("a*", "a?b", "a[b]", "a\\b"):
            with pytest.raises(NameResolveError, match="may only contain"):
                rs[0].add(f"exp/{bad}", "v")
        assert glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"
    finally:
        for r in rs:
            r.clear_subtree("exp")
            r.close()


def test_unreachable_redis_names_host_port_and_field():
    port = find_free_port()  # nothing listens: refused at once
    t0 = time.monotonic()
    with pytest.raises(NameResolveError) as ei:
        make_name_resolver(NameResolveConfig(type="redis", port=port))
    assert time.monotonic() - t0 < 5
    assert f"name_resolve.host/port: cannot reach redis at 127.0.0.1:{port} within 5s" in str(ei.value)


def test_silent_redis_times_out_instead_of_hanging():
    """A server that accepts connections but never answers: bounded by the timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever reads
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(NameResolveError, match=f"cannot reach redis at 127.0.0.1:{port} within 1s"):
            RedisNameResolver("127.0.0.1", port, timeout=1)
        assert time.monotonic() - t0 < 4


def test_redis_password_comes_from_the_environment(start_redis, monkeypatch):
    port = start_redis("--requirepass", "s3cr3t-pw")
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    with pytest.raises(NameResolveError, match=f"redis at 127.0.0.1:{port} rejected the login.*{PASSWORD_ENV}"):
        make_name_resolver(NameResolveConfig(type="redis", port=port))
    monkeypatch.setenv(PASSWORD_ENV, "s3cr3t-pw")
    r = make_name_resolver(NameResolveConfig(type="redis", port=port))
    try:
        r.add("exp/trial/master", "tcp://127.0.0.1:1")
        assert r.get("exp/trial/master") == "tcp://127.0.0.1:1"
        assert "s3cr3t" not in r.describe()
    finally:
        r.close()


def test_port_zero_means_the_backends_default_port():
    """port=0 (the config default) is 6379 for redis; whatever listens there or not,
    the resolver targets that port."""
    try:
        r = make_name_resolver(NameResolveConfig(type="redis"))
    except NameResolveError as e:
        assert "127.0.0.1:6379" in str(e)
    else:
        assert r.port == 6379
        r.close()
    assert NameResolveConfig().port == 0
