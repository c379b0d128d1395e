"""Train-step throughput: MegatronEngine vs a plain PyTorch loop, same run.

    python benchmarks/bench_train_step.py [--steps 6] [--threads 1]

Both sides train the same small Qwen2 model (identical weights, from one HF
checkpoint) on the same packed variable-length batches, split into the same
micro-batches, with the same loss (token-summed CE / global weight), clipping
and AdamW.  Steps alternate between the two so machine noise hits both alike;
the median step time gives tokens/s.  Goal: engine >= 0.8x plain PyTorch.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)


def make_batches(n_steps: int, vocab: int, seed: int = 0):
    """Per step: 2 micro-batches of 4 sequences, lengths 64..256, 80% loss tokens."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n_steps):
        mbs = []
        for _ in range(2):
            lens = torch.randint(64, 257, (4,), generator=g).tolist()
            ids = torch.randint(0, vocab, (sum(lens),), generator=g)
            labels = torch.roll(ids, -1)
            mask = (torch.rand(sum(lens), generator=g) < 0.8).float()
            mbs.append((ids, lens, (labels, mask)))
        steps.append(mbs)
    return steps


def loss_fn(logits, extra):
    """Masked NLL sum (plain loop: full logits)."""
    labels, mask = extra
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (ce * mask).sum(), {}


def engine_loss_fn(outputs, extra):
    """The same loss through the engine's per-token view (vocab-parallel log-probs)."""
    labels, mask = extra
    return -(outputs.logprobs(labels) * mask).sum(), {}


def plain_step(model, opt, mbs, clip: float) -> None:
    total_w = sum(float(e[1].sum()) for _, _, e in mbs)
    opt.zero_grad(set_to_none=True)
    for ids, lens, (labels, mask) in mbs:
        b, s = len(lens), max(lens)
        valid = torch.arange(s)[None] < torch.tensor(lens)[:, None]
        padded = torch.zeros(b, s, dtype=torch.long)
        padded[valid] = ids
        logits = model(padded, attention_mask=valid.long()).logits[valid].float()
        (loss_fn(logits, (labels, mask))[0] / total_w).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig

    tmp = tempfile.mkdtemp(prefix="rf_bench_")
    atexit.register(shutil.rmtree, tmp, True)  # leave nothing behind in /tmp
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    cfg = Qwen2Config(**MODEL)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).float().save_pretrained(os.path.join(tmp, "ckpt"))
    ckpt = os.path.join(tmp, "ckpt")

    opt_cfg = EngineOptimizerConfig(lr=1e-4, weight_decay=0.0, beta2=0.999, warmup_steps_proportion=0.0,
                                    gradient_clipping=1.0, lr_scheduler_type="constant", total_train_steps=1000)
    engine = MegatronEngine(cfg, build_model_groups([0], ParallelStrategy()), ckpt, opt_cfg, seed=1)
    plain = Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.0)

    batches = make_batches(args.warmup + args.steps, cfg.vocab_size)
    tokens = [sum(sum(lens) for _, lens, _ in mbs) for mbs in batches]
    t_engine, t_plain = [], []
    for i, mbs in enumerate(batches):
        t0 = time.perf_counter()
        engine.train_batch(mbs, engine_loss_fn, lambda e: float(e[1].sum()))
        t1 = time.perf_counter()
        plain_step(plain, popt, mbs, opt_cfg.gradient_clipping)
        t2 = time.perf_counter()
        if i >= args.warmup:
            t_engine.append((t1 - t0) / tokens[i])
            t_plain.append((t2 - t1) / tokens[i])
    eng_tps, plain_tps = 1 / statistics.median(t_engine), 1 / statistics.median(t_plain)
    n_params = sum(p.numel() for p in plain.parameters())
    print(f"model: Qwen2 {n_params / 1e6:.1f}M params, fp32 CPU, {args.threads} thread(s); "
          f"{args.steps} timed steps of ~{statistics.mean(tokens):.0f} tokens (2 micro-batches)")
    print(f"megatron engine : {eng_tps:8.1f} tokens/s")
    print(f"plain pytorch   : {plain_tps:8.1f} tokens/s")
    print(f"ratio engine/plain = {eng_tps / plain_tps:.2f}x (goal >= 0.8x)")
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
