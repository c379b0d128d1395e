"""The rollout controller against real generation server processes (builtin engine, tiny model).

* 101 weight-update rounds (shared memory) while requests generate, in both interruption
  modes: every request ends with exactly its token budget (nothing lost, nothing generated
  twice), versions never go back within a request, interruptions really happened; then
  every server reports the last version and its log-probs on a probe equal transformers'
  on the last weights.
* A server killed mid-run: its requests finish on the other; with none left, a clear
  error names every server.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from realflow.api.rollout import RolloutSpec
from realflow.comm import shm
from realflow.rollout.controller import RolloutController
from realflow.rollout.server_pool import NoServerError

torch.set_num_threads(1)
API_KEY = "test-token-0123456789"
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def models(two_tiny_qwen2):
    return two_tiny_qwen2


@pytest.fixture
def servers(models, start_gen_server):
    started = [start_gen_server(models["a"][0], "--max-running-requests", "32", "--api-key-env", "RF_TEST_KEY",
                                env={"RF_TEST_KEY": API_KEY}) for _ in range(2)]
    yield started
    for _, p in started:
        p.kill()
        p.wait()


def _spec(mode: str) -> RolloutSpec:
    return RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d", interrupt_mode=mode,
                       health_interval_s=0.5)


def _hf_logprobs(model, ids: list[int], n_prompt: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(n_prompt, len(ids))]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["abort", "recompute"])
def test_weight_rounds_during_generation_lose_and_duplicate_nothing(servers, models, mode):
    state = {k: {n: t.detach().clone() for n, t in m.state_dict().items()} for k, (_, m) in models.items()}
    rounds, budget = 101, 48

    async def main():
        ctl = RolloutController(_spec(mode), [u for u, _ in servers], API_KEY)
        await ctl.start()
        try:
            params = {"max_new_tokens": budget, "temperature": 1.0, "ignore_eos": True}
            reqs = [asyncio.create_task(ctl.pool.complete(f"q{i}", [1 + i % 7, 2, 3], dict(params, seed=i)))
                    for i in range(40)]
            for v in range(1, rounds + 1):
                handle = shm.put_tensors(state["b" if v % 2 else "a"])
                ctl.request_round(v, handle, None)
                while ctl.version < v:
                    assert ctl.fatal is None, ctl.fatal
                    await asyncio.sleep(0.002)
                if v % 20 == 0:  # keep requests flowing during the rounds
                    reqs += [asyncio.create_task(ctl.pool.complete(f"late{v}-{i}", [4, 5], dict(params, seed=v + i)))
                             for i in range(4)]
            done = await asyncio.gather(*reqs)
            probe = await ctl.pool.broadcast("/generate", {"input_ids": [3, 1, 4, 1], "return_logprob": True,
                                                          "sampling_params": {"max_new_tokens": 6,
                                                                              "temperature": 0.0}})
            health = {s.name: await ctl.pool.call(s, "/health", method="GET") for s in ctl.pool.servers}
            return done, probe, health, ctl.state()
        finally:
            await ctl.close()

    done, probe, health, st = asyncio.run(main())
    assert st["rounds"] == rounds and st["version"] == rounds
    assert len(done) == 40 + 4 * (rounds // 20)
    for r in done:  # every token exactly once, with its logprob and version
        assert len(r.output_ids) == len(r.logprobs) == len(r.versions) == budget
        assert r.versions == sorted(r.versions)
        assert r.finish_reason == "length"
    if mode == "abort":
        assert sum(r.resubmits for r in done) > 0  # rounds really interrupted running requests
    assert any(r.versions[0] != r.versions[-1] for r in done)  # some requests spanned updates
    assert {h["weight_version"] for h in health.values()} == {rounds}
    mb = models["b"][1]
    for name, res in probe.items():
        lps = [x[0] for x in res["meta_info"]["output_token_logprobs"]]
        ref = _hf_logprobs(mb, [3, 1, 4, 1] + res["output_ids"], 4)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < LOGPROB_ATOL, name


@pytest.mark.timeout(300)
def test_killed_server_fails_over_then_none_left_is_a_clear_error(servers):
    (u0, p0), (u1, p1) = servers

    async def main():
        ctl = RolloutController(_spec("abort"), [u0, u1], API_KEY)
        await ctl.start()
        try:
            params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
            reqs = [asyncio.create_task(ctl.pool.complete(f"k{i}", [1, 2, 3], dict(params, seed=i)))
                    for i in range(16)]
            while ctl.pool.servers[0].in_flight == 0:
                await asyncio.sleep(0.01)
            p0.kill()  # (a few tokens into its requests)
            done = await asyncio.gather(*reqs)
            st = ctl.state()
            p1.kill()
            with pytest.raises(NoServerError) as err:
                for _ in range(3):
                    await ctl.pool.complete("last", [1, 2], params)
            return done, st, str(err.value)
        finally:
            await ctl.close()

    done, st, message = asyncio.run(main())
    assert all(len(r.output_ids) == 200 for r in done)
    assert st["failovers"] > 0 and not st["servers"]["gen_server/0"]["alive"]
    assert any("gen_server/1" in r.servers for r in done)
    assert "no generation server is alive" in message
    assert "gen_server/0" in message and "gen_server/1" in message
