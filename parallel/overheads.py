"""The fixed costs of megatron-core on this device, for the planner's device profile.

Why measured here and not counted from primitive ops: a megatron layer's forward and
backward run ~100 framework ops each (norms, rotary, reshapes, the distributed optimizer's
bookkeeping), and on small or CPU models that Python and dispatch time, not the GEMMs,
sets the step time. Timing a tiny model (whose GEMMs cost nothing) at two depths separates
the cost per layer from the cost per call (loss, schedule, optimizer step).
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable

TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
            hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
DEPTHS = (2, 6)
TOKENS = 32
DECODE_BATCH = 8
DECODE_STEPS = (2, 18)


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_engine_overheads(repeats: int = 7) -> dict[str, float]:
    """Seconds: ``layer_train_overhead_s`` / ``layer_forward_overhead_s`` (per layer and micro-batch),
    ``train_step_overhead_s`` (per optimizer step), ``forward_overhead_s`` (per forward call) and
    ``decode_layer_overhead_s`` / ``decode_step_overhead_s`` (per layer, and fixed, of one decode step of
    the generation engine at a small batch: sampling, scheduling, the KV cache's bookkeeping).
    Runs in this process on one rank (starts a 1-rank gloo group if none exists)."""
    import torch
    import torch.distributed as dist

    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.allocation import ParallelStrategy

    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        groups = build_model_groups([0], ParallelStrategy(1, 1, 1))
        ids = torch.randint(0, TINY["vocab_size"], (TOKENS,), generator=torch.Generator().manual_seed(0))
        targets = torch.roll(ids, -1)

        def loss_fn(out: Any, extra: Any):
            return -out.logprobs(targets).sum(), {}

        from parallel.generation import EngineConfig, GenerationEngine
        from realflow.api.generation import SamplingParams

        prompts = [ids[:8].tolist()] * DECODE_BATCH
        fwd, train, dec = {}, {}, {}
        for depth in DEPTHS:
            eng = MegatronEngine(dict(TINY, num_hidden_layers=depth), groups, None,
                                 EngineOptimizerConfig(lr=1e-5, total_train_steps=1000), seed=1)
            fwd[depth] = _median_s(lambda: eng.logprobs(ids, [TOKENS]), repeats)
            train[depth] = _median_s(lambda: eng.train_batch([(ids, [TOKENS], None)], loss_fn, lambda _: 1.0),
                                     repeats)
            gen = GenerationEngine.from_megatron(eng, EngineConfig(max_running_requests=DECODE_BATCH))
            steps = {n: _median_s(lambda n=n: gen.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True)),
                                  max(repeats // 2, 2)) for n in DECODE_STEPS}
            lo_n, hi_n = DECODE_STEPS
            dec[depth] = (steps[hi_n] - steps[lo_n]) / (hi_n - lo_n)
        lo, hi = DEPTHS
        layer_fwd = max((fwd[hi] - fwd[lo]) / (hi - lo), 0.0)
        layer_train = max((train[hi] - train[lo]) / (hi - lo), 0.0)
        decode_layer = max((dec[hi] - dec[lo]) / (hi - lo), 0.0)
        return {"decode_layer_overhead_s": decode_layer, "decode_step_overhead_s": max(dec[lo] - lo * decode_layer, 0.0), "layer_forward_overhead_s": layer_fwd, "forward_overhead_s": max(fwd[lo] - lo * layer_fwd, 0.0),
                "layer_train_overhead_s": layer_train,
                "train_step_overhead_s": max(train[lo] - lo * layer_train, 0.0)}
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":
    print(measure_engine_overheads())
