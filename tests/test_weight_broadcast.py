"""Weights by torch.distributed broadcast (the path to servers on other hosts), for real:
the trainer's writer (:class:`WeightSender`, as a model worker runs it), the rollout
controller and real generation server processes in one gloo weight group over TCP.

* rounds while requests generate: nothing lost or generated twice; afterwards every
  server reports the last version and its log-probs on a probe equal transformers' on
  the last weights;
* a receiver killed between rounds: the next round regroups without it (new generation)
  and the survivor keeps up;
* a member that never joins: a clear error naming the group and its receivers, within
  the timeout; malformed requests: 4xx naming the field.
"""
from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from realflow.api.rollout import RolloutSpec
from realflow.weights.broadcast import GroupSpec, TensorMeta, WeightBroadcastError, WeightGroup, open_store
from realflow.rollout.controller import RolloutController
from realflow.weights.broadcast_writer import WeightSender

torch.set_num_threads(1)
API_KEY = "test-token-0123456789"
LOGPROB_ATOL = 1e-4


@pytest.fixture
def servers(two_tiny_qwen2, start_gen_server):
    started = [start_gen_server(two_tiny_qwen2["a"][0], "--max-running-requests", "32", "--api-key-env",
                                "RF_TEST_KEY", env={"RF_TEST_KEY": API_KEY}) for _ in range(2)]
    yield started
    for _, p in started:
        p.kill()
        p.wait()


def _spec() -> RolloutSpec:
    return RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d", weight_sync="broadcast",
                       health_interval_s=0.5, weight_broadcast_timeout_s=20.0)


def _hf_logprobs(model, ids: list[int], n_prompt: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(n_prompt, len(ids))]


async def _round(ctl: RolloutController, sender: WeightSender, state: dict, v: int) -> None:
    """What the master does after a train step: plan, publish (the writer), queue the round."""
    plan = ctl.weight_plan(socket.gethostname())
    assert plan["group"] is not None and plan["shm"] is False  # broadcast mode: every server receives
    bc = await asyncio.to_thread(sender.publish, state, plan["group"], v)
    ctl.request_round(v, None, None, bc)
    t0 = time.monotonic()
    while ctl.version < v:
        assert ctl.fatal is None, ctl.fatal
        assert time.monotonic() - t0 < 60, f"round {v} did not finish"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(300)
def test_broadcast_rounds_during_generation_reach_every_server_exactly(servers, two_tiny_qwen2):
    models = two_tiny_qwen2
    state = {k: {n: t.detach().clone() for n, t in m.state_dict().items()} for k, (_, m) in models.items()}
    rounds, budget = 9, 120
    sender = WeightSender("127.0.0.1")

    async def main():
        ctl = RolloutController(_spec(), [u for u, _ in servers], API_KEY)
        await ctl.start()
        try:
            params = {"max_new_tokens": budget, "temperature": 1.0, "ignore_eos": True}
            reqs = [asyncio.create_task(ctl.pool.complete(f"q{i}", [1 + i % 7, 2, 3], dict(params, seed=i)))
                    for i in range(24)]
            for v in range(1, rounds + 1):
                # requests running when the round pauses the servers: they must span it (not a race
                # between the first round's group setup and 24 short requests finishing)
                reqs += [asyncio.create_task(ctl.pool.complete(f"r{v}-{i}", [4, 5], dict(params, seed=100 * v + i)))
                         for i in range(2)]
                while not any(s.in_flight for s in ctl.pool.servers):
                    await asyncio.sleep(0.005)
                await _round(ctl, sender, state["b" if v % 2 else "a"], v)
            done = await asyncio.gather(*reqs)
            probe = await ctl.pool.broadcast("/generate", {"input_ids": [3, 1, 4, 1], "return_logprob": True,
                                                          "sampling_params": {"max_new_tokens": 6,
                                                                              "temperature": 0.0}})
            health = {s.name: await ctl.pool.call(s, "/health", method="GET") for s in ctl.pool.servers}
            return done, probe, health, ctl.state(), ctl.groups.generation
        finally:
            await ctl.close()

    try:
        done, probe, health, st, generation = asyncio.run(main())
    finally:
        sender.close()
    assert st["rounds"] == rounds and st["version"] == rounds and st["broadcast_failures"] == 0
    assert generation == 1  # one group for all rounds
    assert len(sender.sent_s) == rounds
    for r in done:  # every token exactly once, with its logprob and version
        assert len(r.output_ids) == len(r.logprobs) == len(r.versions) == budget
        assert r.versions == sorted(r.versions)
    assert any(r.versions[0] != r.versions[-1] for r in done)  # some requests spanned updates
    assert {h["weight_version"] for h in health.values()} == {rounds}
    assert {h["weight_group"] for h in health.values()} == {"realflow-weights"}
    for name, res in probe.items():  # the last version sent is "b" (odd)
        lps = [x[0] for x in res["meta_info"]["output_token_logprobs"]]
        ref = _hf_logprobs(models["b"][1], [3, 1, 4, 1] + res["output_ids"], 4)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < LOGPROB_ATOL, name


@pytest.mark.timeout(300)
def test_receiver_killed_next_round_regroups_without_it(servers, two_tiny_qwen2):
    state = {k: {n: t.detach().clone() for n, t in m.state_dict().items()} for k, (_, m) in two_tiny_qwen2.items()}
    (u0, p0), (u1, _) = servers
    sender = WeightSender("127.0.0.1")

    async def main():
        ctl = RolloutController(_spec(), [u0, u1], API_KEY)
        await ctl.start()
        try:
            await _round(ctl, sender, state["b"], 1)
            gen1 = ctl.groups.generation
            p0.kill()
            p0.wait()
            while ctl.pool.servers[0].alive:  # the health loop notices
                await asyncio.sleep(0.1)
            await _round(ctl, sender, state["a"], 2)
            await _round(ctl, sender, state["b"], 3)
            h = await ctl.pool.call(ctl.pool.servers[1], "/health", method="GET")
            return gen1, ctl.groups.generation, ctl.groups.members, h
        finally:
            await ctl.close()

    try:
        gen1, gen3, members, health = asyncio.run(main())
    finally:
        sender.close()
    assert gen3 == gen1 + 1 and members == ["gen_server/1"]
    assert health["weight_version"] == 3


def test_member_that_never_joins_is_named_within_the_timeout():
    spec = GroupSpec("realflow-weights", 7, ["gen_server/0", "gen_server/9"], "127.0.0.1", timeout_s=2.0)
    store = open_store(spec, 0)
    t0 = time.monotonic()
    with pytest.raises(WeightBroadcastError) as err:
        WeightGroup(spec, 0, "127.0.0.1", store=store)
    assert time.monotonic() - t0 < 15
    msg = str(err.value)
    assert "realflow-weights" in msg and "gen_server/9" in msg and "generation 7" in msg


def test_tensor_meta_from_body_names_what_is_wrong():
    t = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    meta = TensorMeta.of(t)
    assert TensorMeta.from_body(meta.to_body()) == meta and meta.nbytes() == 2 * 3 * 4 + 3 * 2
    for body, needle in (({"names": ["w"], "dtypes": ["float32"]}, "required"),
                         ({"names": ["w"], "dtypes": ["float99"], "shapes": [[2]]}, "float99"),
                         ({"names": ["w"], "dtypes": ["float32"], "shapes": [[-1]]}, "shape"),
                         ({"names": ["w", "x"], "dtypes": ["float32"], "shapes": [[1]]}, "equal length")):
        with pytest.raises(ValueError, match=needle):
            TensorMeta.from_body(body)


@pytest.mark.timeout(120)
def test_malformed_group_requests_are_4xx_naming_the_field(servers):
    import aiohttp

    url = servers[0][0]
    cases = [
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]],
                                              "group_name": "g"}, "no weight group"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                        "world_size": 2, "group_name": "g"}, "rank_offset"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1,
                                        "world_size": 2, "group_name": "g"}, "master_port"),
        ("/init_weights_update_group", {"master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"},
         "master_address"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                        "world_size": 2, "group_name": "g", "backend": "nccl"}, "gloo"),
        ("/update_weights_from_distributed", {"names": "w", "group_name": "g"}, "names"),
        ("/destroy_weights_update_group", {"group_name": "g"}, "no such weight group"),
    ]

    async def main():
        out = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            for path, body, _ in cases:
                async with s.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                    out.append((r.status, (await r.json())["error"]))
        return out

    for (path, _, needle), (status, error) in zip(cases, asyncio.run(main())):
        assert 400 <= status < 500 and needle in error, (path, status, error)
