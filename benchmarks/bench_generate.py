"""Generation throughput: realflow's built-in engine vs transformers ``generate``.

One command (``python benchmarks/bench_generate.py``): a random Qwen2 model with
the project's tiny architecture (:class:`experiments.init_model.TinyArchConfig`,
context raised so 128 new tokens fit), batch 32, 128 new tokens, greedy, fp32,
one thread.  Both run in this process on the same checkpoint; the engine's
output must equal transformers' (else the ratio would be meaningless).  Prints
tokens/s of each and the ratio (goal >= 2x).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=160, help="the project's tokenizer size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for each side")
    a = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from experiments.init_model import TinyArchConfig
    from parallel.generation import EngineConfig, GenerationEngine
    from realflow.api.generation import SamplingParams

    torch.set_num_threads(a.threads)
    arch = asdict(TinyArchConfig())
    arch["max_position_embeddings"] = max(arch["max_position_embeddings"], a.prompt_len + a.new_tokens)
    cfg = Qwen2Config(vocab_size=a.vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, **arch)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float().eval()
    n_params = sum(p.numel() for p in model.parameters())
    tmp = tempfile.TemporaryDirectory(prefix="bench_gen_")
    path = tmp.name
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, a.vocab, (a.batch, a.prompt_len), generator=g)
    total = a.batch * a.new_tokens

    def run_hf() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        with torch.no_grad():
            # eos_token_id=None: exactly new_tokens each, like the engine's ignore_eos
            # (faster for transformers than min_new_tokens, which adds a logits processor)
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                 max_new_tokens=a.new_tokens, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0, out[:, a.prompt_len:].tolist()

    engine = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=a.batch))
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)

    def run_engine() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        res = engine.generate(prompts.tolist(), params)
        return time.perf_counter() - t0, [r.output_ids for r in res]

    run_engine()  # warm-up (allocations, first-call dispatch)
    t_hf, out_hf = min(run_hf() for _ in range(a.repeats))
    t_en, out_en = min(run_engine() for _ in range(a.repeats))
    same = sum(x == y for x, y in zip(out_hf, out_en))
    print(f"model: qwen2 {n_params / 1e6:.2f}M params, batch {a.batch}, prompt {a.prompt_len}, "
          f"{a.new_tokens} new tokens, fp32, {a.threads} thread(s)")
    print(f"transformers generate: {total / t_hf:10.0f} tokens/s ({t_hf:.3f} s)")
    print(f"realflow engine:       {total / t_en:10.0f} tokens/s ({t_en:.3f} s)")
    print(f"identical greedy outputs: {same}/{a.batch}")
    print(f"ratio engine / transformers: {t_hf / t_en:.2f}x (goal >= 2x)")
    tmp.cleanup()


if __name__ == "__main__":
    main()
