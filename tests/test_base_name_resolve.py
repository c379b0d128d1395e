"""Name resolution against real backends: a directory and a real etcd server.

Every behaviour test runs on both backends through the ``resolver`` fixture; the
multi-process tests start real Python processes that use the same backend.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
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
from realflow.base.network import find_free_port

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


@pytest.fixture(params=["file", "etcd"])
def backend(request, tmp_path):
    """(NameResolveConfig, unique key prefix) for one backend."""
    if request.param == "file":
        cfg = NameResolveConfig(type="file", root=str(tmp_path / "names"))
    else:
        host, port = request.getfixturevalue("etcd_server")
        cfg = NameResolveConfig(type="etcd", host=host, port=port)
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


def test_make_name_resolver_from_config_or_dict(tmp_path):
    with pytest.raises(NameResolveError, match="name_resolve.type='redis' is not a known backend"):
        make_name_resolver(NameResolveConfig(type="redis"))
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
