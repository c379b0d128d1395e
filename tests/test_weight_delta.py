"""Delta weight sync, for real: the trainer's writer (:class:`WeightPublisher`, as a model worker
runs it), the rollout controller's rounds and real generation server processes, over shared
memory and over a gloo broadcast group.

* 100 updates with random sparse changes: every server's delta base digest equals the
  writer's, and its engine's weights are bit-identical to a full load of the writer's state;
  the deltas carried a small fraction of the model's bytes;
* a server that missed versions refuses a delta (one line, keeps its weights) and the next
  plan sends it a full update, after which it is bit-identical again;
* a delta to a server of another model fails with one clear line, and the run-level check
  (preflight, before any worker starts) names the architecture difference.
"""
from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest
import torch

from realflow.api.rollout import RolloutSpec
from realflow.comm import shm
from realflow.rollout.controller import RolloutController
from realflow.weights.delta import DeltaError, DeltaReceiver, DeltaWriter, root_digest
from realflow.weights.publisher import WeightPublisher

torch.set_num_threads(1)
API_KEY = "test-token-0123456789"
BLOCK = 4096  # small blocks: the tiny model's tensors span several, so blocks are patched inside tensors


@pytest.fixture
def servers(two_tiny_qwen2, start_gen_server):
    started = [start_gen_server(two_tiny_qwen2["a"][0], "--api-key-env", "RF_TEST_KEY",
                                env={"RF_TEST_KEY": API_KEY}) for _ in range(2)]
    yield started
    for _, p in started:
        p.kill()
        p.wait()


def _spec(sync: str) -> RolloutSpec:
    return RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d", weight_sync=sync,
                       health_interval_s=0.5, weight_broadcast_timeout_s=20.0)


def _publisher() -> WeightPublisher:
    return WeightPublisher(f"{shm.DEFAULT_PREFIX}delta-test-{uuid.uuid4().hex[:8]}_", "127.0.0.1", BLOCK)


def _perturb(state: dict, gen: torch.Generator) -> dict:
    """A new version: a few random elements of one to three random tensors change."""
    out = dict(state)
    names = list(state)
    for i in torch.randperm(len(names), generator=gen)[:int(torch.randint(1, 4, (1,), generator=gen))]:
        t = state[names[i]].clone()
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
        flat[idx] += torch.randn(len(idx), generator=gen, dtype=flat.dtype)
        out[names[i]] = t
    return out


async def _round(ctl: RolloutController, pub: WeightPublisher, state: dict, v: int) -> dict:
    """What the master and the writer do after a train step: plan, publish, queue the round, wait."""
    plan = ctl.weight_plan(socket.gethostname())
    reply = await asyncio.to_thread(pub.publish, state, v, plan["group"], plan["shm"], plan.get("delta"))
    ctl.request_round(v, reply["handle"], None, reply.get("broadcast"), reply.get("shm_delta"))
    t0 = time.monotonic()
    while ctl.version < v:
        assert ctl.fatal is None, ctl.fatal
        assert time.monotonic() - t0 < 60, f"round {v} did not finish within 60 s"
        await asyncio.sleep(0.005)
    return dict(reply, plan=plan)


def _engine_digest(path: str, state: dict) -> str:
    """The engine weights a full load of ``state`` gives (the reference for bit-identity)."""
    from parallel.generation.engine import GenerationEngine

    eng = GenerationEngine.from_hf(path, tokenizer=None)
    eng.update_weights_from_tensors(state, "hf", 1)
    return eng.weights_digest()


async def _digests(ctl: RolloutController) -> dict[str, dict]:
    return {s.name: await ctl.pool.call(s, "/weights_digest", method="GET") for s in ctl.pool.servers}


def _run_updates(ctl_spec: RolloutSpec, urls: list[str], model, n: int, seed: int) -> tuple[dict, list, dict]:
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    pub = _publisher()

    async def main():
        ctl = RolloutController(ctl_spec, urls, API_KEY)
        await ctl.start()
        nonlocal state
        replies = []
        try:
            for v in range(1, n + 1):
                state = _perturb(state, gen) if v > 1 else state
                replies.append(await _round(ctl, pub, state, v))
                if v % 25 == 0 or v == n:
                    want = root_digest(pub._delta.table)
                    for name, d in (await _digests(ctl)).items():
                        assert d["weight_version"] == v and d["weight_root"] == want, (v, name, d)
            return replies, await _digests(ctl)
        finally:
            await ctl.close()

    try:
        replies, final = asyncio.run(main())
    finally:
        pub.close()
    return state, replies, final


@pytest.mark.timeout(600)
def test_100_sparse_updates_over_shared_memory_leave_every_server_bit_identical(servers, two_tiny_qwen2):
    path, model = two_tiny_qwen2["a"]
    state, replies, final = _run_updates(_spec("memory"), [u for u, _ in servers], model, 100, seed=0)
    ref = _engine_digest(path, state)
    assert {d["engine"] for d in final.values()} == {ref}  # bit-identical to a full load of the writer's state
    kinds = [r["shm_delta"]["base"] for r in replies]
    assert kinds[0] is None and all(b == v for v, b in enumerate(kinds[1:], 1))  # v1 full, then deltas
    sent = sum(r["weight_bytes"]["sent"] for r in replies[1:])
    full = sum(r["weight_bytes"]["full"] for r in replies[1:])
    assert sent < 0.1 * full, (sent, full)


@pytest.mark.timeout(300)
def test_sparse_updates_over_a_broadcast_group_leave_every_server_bit_identical(servers, two_tiny_qwen2):
    path, model = two_tiny_qwen2["a"]
    state, replies, final = _run_updates(_spec("broadcast"), [u for u, _ in servers], model, 12, seed=1)
    assert {d["engine"] for d in final.values()} == {_engine_digest(path, state)}
    assert [r["broadcast"]["delta"]["base"] for r in replies] == [None] + list(range(1, 12))
    assert replies[-1]["broadcast"]["meta"]["names"] != list(state)  # only the changed blocks travelled


@pytest.mark.timeout(300)
def test_server_that_missed_versions_refuses_the_delta_and_recovers_with_a_full_update(servers, two_tiny_qwen2):
    path, model = two_tiny_qwen2["a"]
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    pub = _publisher()

    async def main():
        ctl = RolloutController(_spec("memory"), [u for u, _ in servers], API_KEY)
        await ctl.start()
        nonlocal state
        try:
            for v in (1, 2):
                state = _perturb(state, gen)
                await _round(ctl, pub, state, v)
            s0, s1 = ctl.pool.servers
            before = (await ctl.pool.call(s1, "/weights_digest", method="GET"))["engine"]
            # versions 3 and 4 reach server 0 only (server 1 was, say, unreachable)
            for v in (3, 4):
                state = _perturb(state, gen)
                reply = await asyncio.to_thread(pub.publish, state, v, None, True, {"mode": "auto", "shm": v - 1})
                body = {"shm_handle": reply["handle"], "format": "hf", "weight_version": v, "unlink": False,
                        "delta": reply["shm_delta"]}
                await ctl.pool.call(s0, "/update_weights_from_tensor", body, timeout=60)
                if v == 4:  # the delta on v3 to server 1, which holds v2: refused, nothing changes
                    with pytest.raises(RuntimeError) as err:
                        await ctl.pool.call(s1, "/update_weights_from_tensor", body, timeout=60)
                shm.release(reply["handle"])
            await ctl.pool.check_health()
            after = (await ctl.pool.call(s1, "/weights_digest", method="GET"))
            versions = (s0.version, s1.version)
            reply5 = await _round(ctl, pub, _perturb(state, gen), 5)
            return err.value, before, after, versions, reply5, await _digests(ctl)
        finally:
            await ctl.close()

    try:
        err, before, after, versions, reply5, final = asyncio.run(main())
    finally:
        pub.close()
    msg = str(err)
    assert "is on v3, but this server holds v2" in msg and "needs a full update" in msg and "\n" not in msg
    assert after["engine"] == before and after["weight_version"] == 2  # kept its weights
    assert versions == (4, 2)
    assert reply5["plan"]["delta"]["shm"] is None and reply5["shm_delta"]["base"] is None  # a full update
    assert {d["weight_version"] for d in final.values()} == {5}
    assert len({d["engine"] for d in final.values()}) == 1 and len({d["weight_root"] for d in final.values()}) == 1


@pytest.mark.timeout(300)
def test_delta_to_a_server_of_another_model_fails_with_one_clear_line(servers, two_tiny_qwen2, tmp_path):
    from parallel.testing import make_tiny_hf

    _, model = two_tiny_qwen2["a"]
    other = make_tiny_hf(str(tmp_path / "wide"), seed=3, family="qwen2", intermediate_size=96)[1]
    mine = {k: t.detach().clone() for k, t in model.state_dict().items()}
    theirs = {k: t.detach().clone() for k, t in other.state_dict().items()}
    pub = _publisher()

    async def main():
        ctl = RolloutController(_spec("memory"), [servers[0][0]], API_KEY)
        await ctl.start()
        try:
            await _round(ctl, pub, mine, 1)  # the server holds v1 of its own model
            w = DeltaWriter(BLOCK)  # a writer training another model, also at v1
            w.commit(w.prepare(theirs, 1))
            theirs["model.norm.weight"] = theirs["model.norm.weight"] + 1
            tensors, man = w.message(w.prepare(theirs, 2), base=1)
            assert man["base"] == 1
            handle = shm.put_tensors(tensors, prefix=f"{shm.DEFAULT_PREFIX}delta-test-{uuid.uuid4().hex[:8]}_")
            try:
                with pytest.raises(RuntimeError) as err:
                    await ctl.pool.call(ctl.pool.servers[0], "/update_weights_from_tensor",
                                        {"shm_handle": handle, "format": "hf", "weight_version": 2,
                                         "unlink": False, "delta": man}, timeout=60)
            finally:
                shm.release(handle)
            return str(err.value), await _digests(ctl)
        finally:
            await ctl.close()

    try:
        msg, digests = asyncio.run(main())
    finally:
        pub.close()
    assert "400" in msg and "is for another model" in msg and "mlp" in msg and "[96, " in msg, msg
    assert "\n" not in msg and "rollout.model_path" in msg
    assert [d["weight_version"] for d in digests.values()] == [1]


def test_preflight_names_a_rollout_model_of_another_architecture(two_tiny_qwen2, tmp_path):
    from parallel.testing import make_tiny_hf
    from realflow.api.experiment import ExperimentSetup, ModelSpec
    from realflow.system.preflight import PreflightError, check_rollout_model

    wide = str(tmp_path / "wide")
    make_tiny_hf(wide, seed=3, family="qwen2", intermediate_size=96)
    path = two_tiny_qwen2["a"][0]
    setup = ExperimentSetup.__new__(ExperimentSetup)
    setup.models = {"actor": ModelSpec(role="actor", path=path)}
    setup.rollout = RolloutSpec(model_path=wide, tokenizer_path=path, dataset_path="d")
    with pytest.raises(PreflightError) as err:
        check_rollout_model(setup)
    assert "intermediate_size=96" in str(err.value) and "\n" not in str(err.value)
    setup.rollout = RolloutSpec(model_path=two_tiny_qwen2["b"][0], tokenizer_path=path, dataset_path="d")
    check_rollout_model(setup)  # same architecture, other weights: fine


def test_receiver_refuses_corrupted_blocks_and_keeps_its_version():
    gen = torch.Generator().manual_seed(4)
    state = {"w": torch.randn(5000, generator=gen), "b": torch.randn(7, generator=gen).bfloat16()}
    w, r = DeltaWriter(1024), DeltaReceiver()
    p = w.prepare(state, 1)
    r.commit(r.apply(w.message(p, None)[1], state))
    w.commit(p)
    state = dict(state, w=state["w"].clone())
    state["w"][4000] += 1
    tensors, man = w.message(w.prepare(state, 2), base=1)
    assert man["blocks"] == {"w": [[15, man["blocks"]["w"][0][1]]]} and man["sent_bytes"] == 1024
    bad = dict(tensors)
    bad[next(iter(bad))] = bad[next(iter(bad))].clone()
    bad[next(iter(bad))][0] ^= 1
    with pytest.raises(DeltaError, match="block 15 of 'w' does not match its digest"):
        r.apply(man, bad)
    assert r.version == 1
    r.commit(r.apply(man, tensors))
    assert r.version == 2 and torch.equal(r.tensors["w"], state["w"]) and r.root == man["root"]
