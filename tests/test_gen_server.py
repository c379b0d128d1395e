"""HTTP contract of the gen server, on a real server process (builtin backend, tiny model).

Every endpoint is exercised through :class:`GenerationClient`; outputs are
checked against transformers (greedy tokens exact, logprobs within
LOGPROB_ATOL); pause (abort / retract) + weight updates (disk, shared memory)
+ continue; bad requests answer 4xx with a message and the server stays healthy.
The backend lock's stuck-holder warning is a unit test on real threads (no server).
"""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import requests
import torch

from realflow.rollout.gen_client import GenerationClient, GenerationServerError

torch.set_num_threads(1)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def models(two_tiny_qwen2):
    return two_tiny_qwen2


@pytest.fixture(scope="module")
def server(models, start_gen_server):
    """(url, process) of a gen server on model a."""
    yield start_gen_server(models["a"][0], "--max-running-requests", "16")


@pytest.fixture
def client(server):
    with GenerationClient(server[0], timeout=30, generate_timeout=120) as c:
        yield c
        assert c.is_healthy(), "server not healthy after the test"


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def check_logprobs(model, prompt, out, lps, lo=0, hi=None):
    logits = model(torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(out)[:, None]).squeeze(1)
    d = (ref[lo:hi] - torch.tensor(lps)[lo:hi]).abs().max().item()
    assert d <= LOGPROB_ATOL, d


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_generate_contract(client, models):
    _, ma = models["a"]
    v0 = client.model_info()["weight_version"]
    r = client.generate([1, 2, 3], {"max_new_tokens": 6, **GREEDY}, rid="one")
    assert isinstance(r, dict) and r["meta_info"]["id"] == "one"
    assert r["output_ids"] == hf_greedy(ma, [1, 2, 3], 6)
    m = r["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 6}
    assert m["prompt_tokens"] == 3 and m["completion_tokens"] == 6 and m["weight_version"] == v0
    assert [t for _, t, _ in m["output_token_logprobs"]] == r["output_ids"]
    check_logprobs(ma, [1, 2, 3], r["output_ids"], [lp for lp, _, _ in m["output_token_logprobs"]])
    batch = client.generate([[5, 6], [7, 8, 9, 10]], [{"max_new_tokens": 3, **GREEDY},
                                                      {"max_new_tokens": 5, **GREEDY}], return_logprob=False)
    assert [len(b["output_ids"]) for b in batch] == [3, 5]
    assert "output_token_logprobs" not in batch[0]["meta_info"]
    assert batch[1]["output_ids"] == hf_greedy(ma, [7, 8, 9, 10], 5)
    n = client.generate([4, 4], {"max_new_tokens": 4, "n": 3, "seed": 3, "ignore_eos": True})
    assert isinstance(n, list) and len(n) == 3
    again = client.generate([4, 4], {"max_new_tokens": 4, "n": 3, "seed": 3, "ignore_eos": True})
    assert [x["output_ids"] for x in n] == [x["output_ids"] for x in again]


def test_concurrent_requests_join_running_batch(client, models):
    _, ma = models["a"]
    prompts = [[i + 1, i + 2, i + 3][: 1 + i % 3] for i in range(12)]
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        with GenerationClient(client.base_url) as c:
            results[i] = c.generate(prompts[i], {"max_new_tokens": 8 + i, **GREEDY})["output_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 12
    for i, p in enumerate(prompts):
        assert results[i] == hf_greedy(ma, p, 8 + i), i


def _background_batch(client, n_prompts=16, max_new=200):
    """Start ``n_prompts`` greedy, EOS-ignoring prompts in a thread; return once the
    server has sampled a token (the server's own counter, not a sleep)."""
    box: dict = {}
    before = client.metrics()["realflow_gen_tokens_generated_total"]

    def run():
        box["res"] = client.generate([[3 + i, 9] for i in range(n_prompts)],
                                     {"max_new_tokens": max_new, **GREEDY})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while client.metrics()["realflow_gen_tokens_generated_total"] <= before:
        assert time.monotonic() < deadline, "generation never started"
        time.sleep(0.005)
    return t, box


def test_pause_abort_update_disk_continue(client, models):
    (pa, ma), (pb, mb) = models["a"], models["b"]
    # 8 waves of 16 running requests x 250 tokens (context 256, EOS ignored): ~2000 decode
    # steps.  The pause takes effect at the next step, so it lands while requests run however
    # the threads are scheduled; one wave (16 x 200 tokens: ~0.1 s on a 2-core CPU) was too
    # short a window.
    n_prompts, max_new = 128, 250
    with GenerationClient(client.base_url) as c2:
        t, box = _background_batch(c2, n_prompts, max_new)
        assert client.pause_generation("abort")["aborted"] > 0
        t.join(60)
    res = box["res"]
    assert len(res) == n_prompts
    for r in res:  # finished before the pause, or ended by it with what it had
        fr, n_out = r["meta_info"]["finish_reason"], len(r["output_ids"])
        assert r["meta_info"]["completion_tokens"] == n_out
        if fr["type"] != "abort":
            assert fr == {"type": "length", "length": max_new} and n_out == max_new, fr
    # aborted while running: partial output (requests still queued end with none)
    partial = [(i, r) for i, r in enumerate(res)
               if r["meta_info"]["finish_reason"]["type"] == "abort" and r["output_ids"]]
    assert partial, "no running request was aborted"
    i, part = partial[0]
    v = client.update_weights_from_disk(pb)["weight_version"]
    queued = {}
    qt = threading.Thread(target=lambda: queued.update(r=client.generate([2], {"max_new_tokens": 3, **GREEDY})))
    qt.start()  # while paused: waits in the queue
    time.sleep(0.3)
    assert qt.is_alive() and client.metrics()["realflow_gen_paused"] == 1
    client.continue_generation()
    qt.join(60)
    assert queued["r"]["output_ids"] == hf_greedy(mb, [2], 3)
    prompt = [3 + i, 9]
    check_logprobs(ma, prompt, part["output_ids"], [x[0] for x in part["meta_info"]["output_token_logprobs"]])
    prefix = prompt + part["output_ids"]
    cont = client.generate(prefix, {"max_new_tokens": 5, **GREEDY})
    assert cont["output_ids"] == hf_greedy(mb, prefix, 5) and cont["meta_info"]["weight_version"] == v
    client.update_weights_from_disk(pa)  # back to a for the other tests


def test_pause_retract_update_tensor_continue(client, models):
    (pa, ma), (pb, mb) = models["a"], models["b"]
    v_a = client.health()["weight_version"]
    with GenerationClient(client.base_url) as c2:
        t, box = _background_batch(c2)
        assert client.pause_generation("retract")["aborted"] == 0
        r = client.update_weights_from_tensors(dict(mb.state_dict()), weight_version=v_a + 10)
        assert r["weight_version"] == v_a + 10
        client.continue_generation()
        t.join(120)
    spans = 0
    for i, r in enumerate(box["res"]):
        vs = r["meta_info"]["output_token_weight_versions"]
        assert r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 200
        assert vs == sorted(vs) and set(vs) <= {v_a, v_a + 10}
        k = vs.count(v_a)
        lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        if 0 < k < len(vs):
            spans += 1
            prompt = [3 + i, 9]
            check_logprobs(ma, prompt, r["output_ids"], lps, hi=k)
            check_logprobs(mb, prompt, r["output_ids"], lps, lo=k)
            assert r["output_ids"][:k] == hf_greedy(ma, prompt, k)
            assert r["output_ids"][k:k + 5] == hf_greedy(mb, prompt + r["output_ids"][:k], 5)
    assert spans > 0, "no sequence was interrupted (pause came too late)"
    client.flush_cache()
    client.update_weights_from_disk(pa)


def test_stage_while_generating_then_commit(client, models):
    """Staged weights are built while the server generates (no pause); the commit swaps them
    in: each answer's tokens are A's up to the commit and B's after, with B's log-probs."""
    (pa, ma), (_, mb) = models["a"], models["b"]
    assert client.health()["weight_staging"] is True
    v_a = client.health()["weight_version"]
    with GenerationClient(client.base_url) as c2:
        t, box = _background_batch(c2)
        r = client.update_weights_from_tensors(dict(mb.state_dict()), weight_version=v_a + 3, stage=True)
        assert r["staged_version"] == v_a + 3 and client.health()["weight_version"] == v_a
        with pytest.raises(GenerationServerError, match="version .* is staged"):
            client.commit_staged_weights(v_a + 4)
        assert client.commit_staged_weights(v_a + 3)["weight_version"] == v_a + 3
        t.join(120)
    spans = 0
    for i, r in enumerate(box["res"]):
        vs = r["meta_info"]["output_token_weight_versions"]
        assert len(r["output_ids"]) == 200 and vs == sorted(vs) and set(vs) <= {v_a, v_a + 3}
        k = vs.count(v_a)
        if 0 < k < len(vs):
            spans += 1
            prompt = [3 + i, 9]
            lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
            check_logprobs(ma, prompt, r["output_ids"], lps, hi=k)
            check_logprobs(mb, prompt, r["output_ids"], lps, lo=k)
    assert spans > 0, "no sequence was running at the commit"
    with pytest.raises(GenerationServerError, match="nothing is staged"):
        client.commit_staged_weights()
    client.update_weights_from_disk(pa)


def test_bad_requests_get_4xx(client, server):
    url = server[0]
    bad_before = client.metrics()["realflow_gen_bad_requests_total"]
    cases = [
        ("/generate", b"{not json", "JSON"),
        ("/generate", {"sampling_params": {}}, "input_ids"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"input_ids": [1, 999999]}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"input_ids": [1], "sampling_params": {"n": 0}}, "n="),
        ("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),
        ("/generate", {"input_ids": [1], "foo": 1}, "foo"),
        ("/generate", {"input_ids": [[1], []]}, r"input_ids[1]"),
        ("/generate", {"input_ids": [1] * 300}, "context"),
        ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        # bounded: one request may not ask for millions of sequences (it held the engine for minutes)
        ("/generate", {"input_ids": [1], "sampling_params": {"n": 10_000_000, "max_new_tokens": 1}}, "at most 4096"),
        ("/generate", {"input_ids": [[1]] * 100, "sampling_params": {"n": 41}}, "4100 sequences"),
        ("/generate", b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, "nonexistent"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_tensor", {"shm_handle": {"segment": "../x", "size": 1, "tensors": {}}}, "handle"),
        ("/update_weights_from_tensor", {"shm_handle": {"segment": None, "size": 0, "tensors": {}},
                                         "format": "onnx"}, "format"),
        ("/update_weights_from_tensor", {"shm_handle": {"segment": None, "size": 0, "tensors": {}},
                                         "stage": "yes"}, "stage"),
        ("/commit_staged_weights", {"weight_version": "x"}, "weight_version"),
        ("/abort_request", {}, "rid"),
        ("/no_such_endpoint", {}, "Not Found"),
    ]
    for path, body, msg in cases:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        resp = requests.post(url + path, timeout=30, **kw)
        assert 400 <= resp.status_code < 500, (path, body, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert msg in err, (path, body, err)
    assert client.metrics()["realflow_gen_bad_requests_total"] >= bad_before + len(cases)
    assert client.health()["status"] == "ok"
    assert len(client.generate([1, 2], {"max_new_tokens": 2, **GREEDY})["output_ids"]) == 2
    with pytest.raises(GenerationServerError) as e:
        client.generate([1, 2], {"top_k": 0})
    assert e.value.status == 400 and "top_k" in str(e.value)


def test_metrics_and_abort_request(client):
    before = client.metrics()["realflow_gen_tokens_generated_total"]
    client.generate([[1], [2]], {"max_new_tokens": 4, **GREEDY})
    m = client.metrics()
    for key in ("realflow_gen_running_requests", "realflow_gen_queued_requests",
                "realflow_gen_tokens_per_second", "realflow_gen_weight_version"):
        assert key in m
    assert m["realflow_gen_tokens_generated_total"] >= before + 8
    assert client.abort_request("no-such-rid")["aborted"] == 0
    text = requests.get(client.base_url + "/metrics", timeout=10).text
    assert "# TYPE realflow_gen_tokens_generated_total counter" in text


def test_client_timeouts_name_server(server):
    from realflow.base.network import find_free_ports

    dead = f"http://127.0.0.1:{find_free_ports(1)[0]}"
    with pytest.raises(GenerationServerError, match="127.0.0.1.*/health"):
        GenerationClient(dead, timeout=2).health()
    with GenerationClient(server[0], timeout=5, generate_timeout=0.001) as c:
        with pytest.raises(GenerationServerError, match=r"did not answer POST /generate"):
            c.generate([1] * 10, {"max_new_tokens": 200, **GREEDY})


def _wait_until(cond, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_step_wait_warns_names_holder_and_keeps_waiting(caplog):
    """A step thread kept from the backend lock warns once per period, names the holder, never raises."""
    from realflow.rollout.gen_server_state import _BackendLock

    period = 0.2
    lock = _BackendLock(warn_after_s=period)
    held, release = threading.Event(), threading.Event()
    stepped, queued_done = threading.Event(), threading.Event()

    def holder():  # e.g. a long weight update
        with lock:
            held.set()
            release.wait(5)

    def step():
        with lock.for_step():
            stepped.set()

    def queued():  # a handler waiting behind the holder: the step thread must let it go first
        with lock:
            assert not stepped.is_set()
        queued_done.set()

    def warnings():
        return [r for r in list(caplog.records)
                if r.levelno == logging.WARNING and "backend lock" in r.getMessage()]

    threads = [threading.Thread(target=holder, name="weight-update", daemon=True)]
    threads[0].start()
    assert held.wait(5)
    with caplog.at_level(logging.WARNING, logger="realflow.gen_server"):
        threads.append(threading.Thread(target=step, name="gen-step", daemon=True))
        threads[-1].start()
        _wait_until(lambda: len(warnings()) >= 1)  # blocked on the lock itself, nobody queued
        first = warnings()[0].getMessage()
        assert "'gen-step'" in first and "0 caller(s)" in first and "'weight-update'" in first
        threads.append(threading.Thread(target=queued, name="pause-handler", daemon=True))
        threads[-1].start()
        _wait_until(lambda: any("1 caller(s)" in r.getMessage() for r in warnings()))
        assert not stepped.is_set()  # still waiting after warning: no raise, no giving up
        release.set()
        for t in threads:
            t.join(5)
            assert not t.is_alive(), t.name
    assert stepped.is_set() and queued_done.is_set()
    times = [r.created for r in warnings()]
    assert all(b - a >= period * 0.9 for a, b in zip(times, times[1:])), times  # once per period


def test_weight_update_from_a_damaged_checkpoint_is_4xx_and_changes_nothing(client, server, models, tmp_path):
    import shutil

    url, path = server[0], models["a"][0]
    before = client.generate([1, 2, 3], {"max_new_tokens": 4, **GREEDY})["output_ids"]
    truncated, broken, other = tmp_path / "truncated", tmp_path / "broken", tmp_path / "other"
    for d in (truncated, broken, other):
        shutil.copytree(path, d)
    st = next(truncated.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    (broken / "config.json").write_text("{ not json")
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] * 2
    (other / "config.json").write_text(json.dumps(cfg))
    for d, msg in ((truncated, "truncated or corrupt"), (broken, "not valid JSON"), (other, "hidden_size=")):
        resp = requests.post(url + "/update_weights_from_disk", json={"model_path": str(d)}, timeout=60)
        assert resp.status_code == 400 and msg in resp.json()["error"], (d, resp.status_code, resp.text)
    assert client.generate([1, 2, 3], {"max_new_tokens": 4, **GREEDY})["output_ids"] == before


def test_limits_name_the_field_and_a_full_queue_answers_429_with_retry_after(models, start_gen_server):
    """Bounds from the server's config: over one -> 400/413 naming it; past the queued-token
    budget -> 429 + Retry-After, which GenerationClient waits out; /health stays fast meanwhile."""
    url, _ = start_gen_server(models["a"][0], "--max-running-requests", "4", "--max-new-tokens", "64",
                              "--max-prompt-tokens", "32", "--max-body-bytes", "20000",
                              "--max-queued-tokens", "300")
    over = [
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 65}}, 400, "max_new_tokens"),
        ({"input_ids": [1] * 33}, 400, "max_prompt_tokens"),
        ({"input_ids": [[1]] * 10, "sampling_params": {"max_new_tokens": 40}}, 400, "max_queued_tokens"),
        ({"input_ids": [1] * 8000}, 413, "max_body_bytes=20000"),
    ]
    for body, status, msg in over:
        resp = requests.post(url + "/generate", json=body, timeout=30)
        assert resp.status_code == status and msg in resp.json()["error"], (body, resp.status_code, resp.text)

    # fill the queue: 4 x (1 + 60) tokens of 300, then one more request must wait for room. The
    # server is paused (retract: requests queue) so that none of the four can finish first on a
    # busy machine and make room before the fifth arrives
    long = {"max_new_tokens": 60, **GREEDY}
    with GenerationClient(url, timeout=30, generate_timeout=120) as c:
        c.pause_generation("retract")
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(c.generate([1], long))) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while c.metrics()["realflow_gen_queued_tokens"] < 4 * 61 and time.monotonic() < deadline:
            time.sleep(0.02)
        resp = requests.post(url + "/generate", json={"input_ids": [2], "sampling_params": long}, timeout=30)
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1 and "max_queued_tokens" in resp.json()["error"]
        t0 = time.monotonic()
        assert requests.get(url + "/health", timeout=5).json()["status"] == "ok"
        assert time.monotonic() - t0 < 1.0
        # the client waits out the 429s and gets its answer once there is room
        late: list = []
        waiter = threading.Thread(target=lambda: late.append(c.generate([2], long)))
        waiter.start()
        while c.metrics()["realflow_gen_overloaded_total"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        c.continue_generation()
        waiter.join(120)
        assert len(late) == 1 and len(late[0]["output_ids"]) == 60
        for t in threads:
            t.join(60)
        assert len(results) == 4
        m = c.metrics()
        assert m["realflow_gen_overloaded_total"] >= 2 and m["realflow_gen_queued_tokens"] == 0


def test_a_nan_weight_update_fails_requests_with_500_and_a_good_update_recovers(client, models):
    """Non-finite logits never become tokens: each request fails with 500 naming itself and the
    weight version; the server stays up, and the next good weights generate correctly."""
    pa, ma = models["a"]
    v = client.model_info()["weight_version"]
    bad = {k: t.clone() for k, t in ma.state_dict().items()}
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    client.update_weights_from_tensors(bad, weight_version=v + 7)
    resp = requests.post(client.base_url + "/generate", timeout=60, json={
        "input_ids": [[1, 2, 3], [4, 5]], "rid": ["nan-a", "nan-b"],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}})
    assert resp.status_code == 500, resp.text
    body = resp.json()
    assert body["success"] is False and sorted(body["rid"]) == ["nan-a", "nan-b"], body
    assert body["weight_version"] == v + 7 and "non-finite logits at output token 0" in body["error"], body
    assert f"(weight version {v + 7})" in body["error"] and "request nan-" in body["error"], body
    with pytest.raises(GenerationServerError) as e:
        client.generate([6], {"max_new_tokens": 2, **GREEDY})
    assert e.value.status == 500
    assert client.is_healthy() and client.metrics()["realflow_gen_failed_requests_total"] >= 3
    client.update_weights_from_disk(pa)  # good weights: generation is right again
    r = client.generate([1, 2, 3], {"max_new_tokens": 5, **GREEDY})
    assert r["output_ids"] == hf_greedy(ma, [1, 2, 3], 5)


@pytest.mark.parametrize("args, key", [
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization=0.0 must be in (0, 1]"),
    (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization=1.2 must be in (0, 1]"),
    (["--max-model-len", "0"], "--max-model-len=0 must be an integer >= 2"),
])
def test_bad_memory_flags_are_one_line_errors_before_any_backend(args, key, capsys):
    """The inference memory keys are checked before the backend is built (no model is read)."""
    from realflow.rollout.gen_server import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", *args])
    assert e.value.code == 2 and key in capsys.readouterr().err


def test_memory_keys_reach_the_builtin_engine_and_sglang_by_its_names(models):
    """``max_model_len`` / ``gpu_memory_utilization``: the builtin engine's KV cache length, and
    SGLang's ``--context-length`` / ``--mem-fraction-static``; above the model's context: an error."""
    from parallel.generation.backend import build_builtin_backend
    from parallel.generation.sglang_backend import sglang_command
    from realflow.api.generation import BackendConfig

    path = models["a"][0]
    eng = build_builtin_backend(BackendConfig(path, max_running_requests=2, max_model_len=32,
                                              gpu_memory_utilization=0.25))
    assert eng.max_context == 32 and eng.config.gpu_memory_utilization == 0.25
    with pytest.raises(ValueError, match=r"max_model_len=100000 is above the model's context"):
        build_builtin_backend(BackendConfig(path, max_model_len=100_000))
    cmd = sglang_command(BackendConfig(path, max_model_len=2048, gpu_memory_utilization=0.8), "127.0.0.1", 30000)
    assert cmd[cmd.index("--context-length") + 1] == "2048"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.8"
