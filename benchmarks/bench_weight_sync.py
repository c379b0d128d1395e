"""Weight-update round of asynchronous PPO: in memory (shared memory) vs ``weight_sync=disk``.

One command (``python benchmarks/bench_weight_sync.py``). For the default model (the
project's tiny architecture) and a ~100M-parameter Qwen2, a real generation server
process (builtin engine) serves requests while the rollout controller runs rounds.
A round is timed from "the trainer holds the new weights in memory" to "the servers
generate again":

* memory: ``put_tensors`` of the HF-named state into one shared-memory segment, then
  stage (the server builds the new weights beside the old ones while it keeps
  generating) -> pause -> commit (a pointer swap) -> continue;
* disk: ``save_pretrained`` (safetensors) into a fresh directory, then pause ->
  ``/update_weights_from_disk`` -> continue (as SGLang-based systems do).

Two figures per side: the whole round, and the stall -- pause to continue, the time
generation stops, which is what a weight update costs the rollout side. Each side
runs ``--rounds`` times alternating with the other; the medians and their ratios are
printed (goal: in memory >= 5x faster). The disk side writes to the
directory of ``--disk-dir`` (default: a temporary directory, usually tmpfs-backed or
page-cached: the most favourable case for disk).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HUNDRED_M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=True)


def _server(path: str) -> tuple[str, subprocess.Popen]:
    from realflow.rollout.local_server import start_local_gen_server

    return start_local_gen_server(path, timeout_s=180)


def measure(name: str, arch: dict, rounds: int, disk_dir: str | None) -> tuple[float, float]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from realflow.api.rollout import RolloutSpec
    from realflow.comm import shm
    from realflow.rollout.controller import RolloutController

    cfg = Qwen2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **arch)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float().eval()
    n_params = sum(p.numel() for p in model.parameters())
    # what the trainer exports: HF names, one copy of tied embeddings
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    work = tempfile.TemporaryDirectory(prefix="bench_wsync_", dir=disk_dir)
    init = os.path.join(work.name, "init")
    model.save_pretrained(init)
    url, proc = _server(init)
    # the trainer publishes through a pool of pre-faulted segments (as the model worker does)
    nbytes = sum(t.numel() * t.element_size() for t in state.values()) + (1 << 20)
    pool = shm.ShmPool(max_bytes=3 * nbytes, max_segments=2)
    pool.reserve(nbytes, 2)
    spec = RolloutSpec(model_path=init, tokenizer_path=init, dataset_path="-", health_interval_s=5.0)
    times: dict[str, list[float]] = {"memory": [], "disk": []}
    stalls: dict[str, list[float]] = {"memory": [], "disk": []}

    async def run() -> None:
        ctl = RolloutController(spec, [url], None)
        await ctl.start()
        # keep the server busy: a round must interrupt real generation
        params = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}
        busy = [asyncio.create_task(ctl.pool.complete(f"b{i}", [5, 6, 7], dict(params, seed=i))) for i in range(8)]
        version = 0
        try:
            for _ in range(rounds):
                for mode in ("memory", "disk"):
                    version += 1
                    t0 = time.perf_counter()
                    if mode == "memory":
                        ctl.request_round(version, pool.put_tensors(state), None)
                    else:
                        path = os.path.join(work.name, f"v{version}")
                        model.save_pretrained(path)
                        ctl.request_round(version, None, path)
                    while ctl.version < version:
                        if ctl.fatal:
                            raise RuntimeError(ctl.fatal)
                        await asyncio.sleep(0.0005)
                    times[mode].append(time.perf_counter() - t0)
                    stalls[mode].append(ctl.stall_times[-1])
                    pool.wait_idle(60.0)  # (the refill of the used segment runs between rounds)
                    busy = [t for t in busy if not t.done()]
                    busy += [asyncio.create_task(ctl.pool.complete(f"v{version}-{i}", [5, 6], dict(params, seed=i)))
                             for i in range(8 - len(busy))]
            for t in busy:
                t.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
        finally:
            await ctl.close()

    try:
        asyncio.run(run())
    finally:
        pool.close()
        proc.kill()
        proc.wait()
        work.cleanup()
    mem, disk = statistics.median(times["memory"]), statistics.median(times["disk"])
    smem, sdisk = statistics.median(stalls["memory"]), statistics.median(stalls["disk"])
    print(f"{name}: {n_params / 1e6:.1f}M parameters, {rounds} rounds each (medians):\n"
          f"  whole round   in memory {mem * 1e3:7.1f} ms, disk {disk * 1e3:7.1f} ms  ->  {disk / mem:5.1f}x\n"
          f"  generation stopped  in memory {smem * 1e3:7.1f} ms, disk {sdisk * 1e3:7.1f} ms  ->  "
          f"{sdisk / smem:5.1f}x  (goal >= 5x)", flush=True)
    return mem, disk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--disk-dir", default=None, help="where the disk side writes (default: the temp dir)")
    ap.add_argument("--skip-100m", action="store_true")
    a = ap.parse_args()
    import torch

    from experiments.init_model import TinyArchConfig

    torch.set_num_threads(1)
    measure("default tiny model", dict(asdict(TinyArchConfig()), vocab_size=160), a.rounds, a.disk_dir)
    if not a.skip_100m:
        measure("~100M Qwen2", HUNDRED_M, a.rounds, a.disk_dir)


if __name__ == "__main__":
    main()
