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

# the reference layer: the width of the CPU default models (what the planner scales from)
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=128, intermediate_size=352,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024,
            hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
DEPTHS = (2, 6)
TOKENS = 32
MANY_TOKENS = 512  # with TOKENS: the per-token cost of a layer (GEMMs, elementwise passes, norms)
SEQ = 16  # tokens per packed sequence
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


def _layer_params(cfg: dict[str, Any]) -> int:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    return (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd * h + cfg["num_attention_heads"] * hd * h \
        + 3 * f * h


def measure_engine_overheads(repeats: int = 7) -> dict[str, float]:
    """Seconds: ``layer_train_token_s`` / ``layer_forward_token_s`` (per layer and token, at the reference
    layer of ``layer_reference_params`` parameters), ``layer_train_overhead_s`` /
    ``layer_forward_overhead_s`` (per layer and micro-batch),
    ``train_step_overhead_s`` (per optimizer step), ``forward_overhead_s`` (per forward call) and
    ``decode_layer_overhead_s`` / ``decode_step_overhead_s`` (per layer, and fixed, of one decode step of
    the generation engine at a small batch: sampling, scheduling, the KV cache's bookkeeping).
    Runs in this process on one rank (starts a 1-rank gloo group if none exists)."""
    import torch
    import torch.distributed as dist

    from parallel.engine import MegatronEngine
    from parallel.generation import EngineConfig, GenerationEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.allocation import ParallelStrategy
    from realflow.api.generation import SamplingParams

    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        groups = build_model_groups([0], ParallelStrategy(1, 1, 1))
        ids = torch.randint(0, TINY["vocab_size"], (TOKENS,), generator=torch.Generator().manual_seed(0))
        prompts = [ids[:8].tolist()] * DECODE_BATCH
        many = torch.randint(0, TINY["vocab_size"], (MANY_TOKENS,), generator=torch.Generator().manual_seed(1))
        batches = {TOKENS: (ids, [SEQ] * (TOKENS // SEQ)), MANY_TOKENS: (many, [SEQ] * (MANY_TOKENS // SEQ))}

        def loss_for(t: Any):
            tg = torch.roll(t, -1)
            return lambda out, extra: (-out.logprobs(tg).sum(), {})

        fwd, train, dec = {}, {}, {}
        for depth in DEPTHS:
            eng = MegatronEngine(dict(TINY, num_hidden_layers=depth), groups, None,
                                 EngineOptimizerConfig(lr=1e-5, total_train_steps=1000), seed=1)
            for n, (t, lens) in batches.items():
                fwd[depth, n] = _median_s(lambda: eng.logprobs(t, lens), repeats)
                train[depth, n] = _median_s(lambda: eng.train_batch([(t, lens, None)], loss_for(t), lambda _: 1.0),
                                            repeats)
            gen = GenerationEngine.from_megatron(eng, EngineConfig(max_running_requests=DECODE_BATCH))
            steps = {n: _median_s(lambda n=n: gen.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True)),
                                  max(repeats // 2, 2)) for n in DECODE_STEPS}
            lo_n, hi_n = DECODE_STEPS
            dec[depth] = (steps[hi_n] - steps[lo_n]) / (hi_n - lo_n)
        lo, hi = DEPTHS
        out: dict[str, float] = {}
        for name, t in (("train", train), ("forward", fwd)):
            per_layer = {n: (t[hi, n] - t[lo, n]) / (hi - lo) for n in (TOKENS, MANY_TOKENS)}
            per_token = max((per_layer[MANY_TOKENS] - per_layer[TOKENS]) / (MANY_TOKENS - TOKENS), 0.0)
            out[f"layer_{name}_token_s"] = per_token
            out[f"layer_{name}_overhead_s"] = max(per_layer[TOKENS] - per_token * TOKENS, 0.0)
            fixed = t[lo, TOKENS] - lo * per_layer[TOKENS]
            out["train_step_overhead_s" if name == "train" else "forward_overhead_s"] = max(fixed, 0.0)
        out["layer_reference_params"] = float(_layer_params(TINY))
        decode_layer = max((dec[hi] - dec[lo]) / (hi - lo), 0.0)
        out["decode_layer_overhead_s"] = decode_layer
        out["decode_step_overhead_s"] = max(dec[lo] - lo * decode_layer, 0.0)
        return out
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":
    print(measure_engine_overheads())
