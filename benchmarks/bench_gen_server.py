"""Generation server over HTTP vs the same engine driven in-process: requests/s and latency.

One command (``python benchmarks/bench_gen_server.py``): a random Qwen2 model with the
project's tiny architecture, ``--requests`` single-prompt requests (prompts of 4-32
tokens, 8-64 new tokens, greedy, EOS ignored so both sides do the same work) kept
``--concurrency`` in flight.  In-process: a loop adds a request to the engine whenever
one finishes and steps it.  HTTP: a real gen server process (one torch thread, as the
in-process engine) and an asyncio client holding the same number of requests open.
Both sides must produce the same tokens.  Prints requests/s, p50/p99 latency of each
and the ratios (what the HTTP server, its admission and its step thread cost).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(4, 32))], rng.choice([8, 16, 32, 64]))
            for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def run_in_process(path: str, work: list[tuple[list[int], int]], concurrency: int
                   ) -> tuple[float, list[float], list[list[int]]]:
    from parallel.generation import EngineConfig, GenerationEngine
    from realflow.api.generation import SamplingParams

    engine = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=concurrency))
    engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    started: dict[str, float] = {}
    latency: list[float] = [0.0] * len(work)
    outputs: list[list[int]] = [[] for _ in work]
    next_i = 0
    t0 = time.perf_counter()

    def add(i: int) -> None:
        prompt, new = work[i]
        started[f"r{i}"] = time.perf_counter()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))

    while next_i < min(concurrency, len(work)):
        add(next_i)
        next_i += 1
    while engine.has_work():
        for r in engine.step():
            i = int(r.rid[1:])
            latency[i] = time.perf_counter() - started[r.rid]
            outputs[i] = r.output_ids
            if next_i < len(work):
                add(next_i)
                next_i += 1
    return time.perf_counter() - t0, latency, outputs


def run_http(url: str, work: list[tuple[list[int], int]], concurrency: int
             ) -> tuple[float, list[float], list[list[int]]]:
    import aiohttp

    latency: list[float] = [0.0] * len(work)
    outputs: list[list[int]] = [[] for _ in work]

    async def main() -> float:
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int) -> None:
                prompt, new = work[i]
                body = {"input_ids": prompt, "rid": f"b{i}",
                        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
                async with sem:
                    t = time.perf_counter()
                    async with session.post(url + "/generate", json=body,
                                            timeout=aiohttp.ClientTimeout(total=600)) as resp:
                        data = await resp.json()
                        assert resp.status == 200, data
                    latency[i] = time.perf_counter() - t
                    outputs[i] = data["output_ids"]
            await one(0)  # warm-up, not timed
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(len(work))))
            return time.perf_counter() - t0

    return asyncio.run(main()), latency, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=160, help="the project's tokenizer size")
    a = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from experiments.init_model import TinyArchConfig
    from realflow.rollout.local_server import start_local_gen_server
    from realflow.scheduler.proc import terminate_all

    torch.set_num_threads(1)
    arch = asdict(TinyArchConfig())
    arch["max_position_embeddings"] = max(arch["max_position_embeddings"], 128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=a.vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                         **arch)).float().eval()
    tmp = tempfile.TemporaryDirectory(prefix="bench_gen_server_")
    model.save_pretrained(tmp.name)
    work = _workload(a.requests, a.vocab)
    tokens = sum(new for _, new in work)

    t_in, lat_in, out_in = run_in_process(tmp.name, work, a.concurrency)
    url, proc = start_local_gen_server(tmp.name, "--max-running-requests", str(a.concurrency),
                                       log_path=os.path.join(tmp.name, "server.log"))
    try:
        t_http, lat_http, out_http = run_http(url, work, a.concurrency)
        from realflow.rollout.gen_client import GenerationClient

        with GenerationClient(url) as c:
            busy_tps = c.metrics()["realflow_gen_busy_tokens_per_second"]
    finally:
        terminate_all([proc], grace=10)
    same = sum(x == y for x, y in zip(out_in, out_http))

    print(f"model: qwen2 {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {a.requests} requests "
          f"({tokens} new tokens), {a.concurrency} in flight, greedy, fp32, 1 torch thread each side")
    for name, t, lat in (("in-process engine", t_in, lat_in), ("gen server (HTTP)", t_http, lat_http)):
        print(f"{name:18s}: {a.requests / t:8.1f} requests/s  {tokens / t:8.0f} tokens/s  "
              f"p50 {_pct(lat, 50) * 1000:7.1f} ms  p99 {_pct(lat, 99) * 1000:7.1f} ms")
    print(f"server's engine while stepping: {busy_tps:.0f} tokens/s (the rest of the gap: steps with fewer "
          f"running requests while answers travel back and new requests come in)")
    print(f"identical outputs: {same}/{a.requests}")
    print(f"ratio HTTP / in-process: throughput {t_in / t_http:.2f}x, p50 latency "
          f"{_pct(lat_http, 50) / _pct(lat_in, 50):.2f}x, p99 latency {_pct(lat_http, 99) / _pct(lat_in, 99):.2f}x")
    tmp.cleanup()


if __name__ == "__main__":
    main()
