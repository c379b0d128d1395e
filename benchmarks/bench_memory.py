"""Memory for time: what each way of training a model costs in peak memory and step time, same run.

    python benchmarks/bench_memory.py [--quick] [--threads 1]

For each model (a ~20M-parameter Qwen2 shape, and the shape of the SFT default of
``experiments/init_model.py``) every VARIANT builds a MegatronEngine (d1, fp32 on CPU,
the run's precision on a GPU) and trains it on the same batch: warm-up steps (Adam's state is
allocated by the first), then timed steps (median), then one step whose memory is measured:

* CPU: the torch profiler's allocation events (``profile_memory=True``), summed in time order:
  the peak of the bytes allocated and not yet freed since the step began -- exact, per tensor;
* GPU: ``torch.cuda.max_memory_allocated`` above what was allocated when the step began.

That peak is the step's working memory above the resident state (weights, gradient buffer,
optimizer state): activations kept for the backward, and the temporaries of the moment of the
peak.  Each row prints it and its step time next to the baseline (the first variant) measured in
the same run.  Goal: recompute's activation memory >= 3x smaller at <= 35% more step time.

Extending: a row is a function in VARIANTS taking the engine's keyword arguments and returning
them changed; a section is a function in SECTIONS taking the parsed arguments.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 2 ** 20
# ~21M parameters: 6 layers x 2.8M + a tied 8192 x 512 embedding
QWEN2_20M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=True)


def default_model() -> dict[str, Any]:
    """The SFT default's architecture (experiments/init_model.py) and its tokenizer's vocabulary size."""
    from dataclasses import asdict

    from experiments.init_model import TinyArchConfig

    return dict(vocab_size=105, **asdict(TinyArchConfig()))  # the worked_arithmetic tokenizer's vocabulary


# ----------------------------------------------------------------------------- variants (rows)


def _training(**kw: Any) -> Any:
    from realflow.api.model_options import TrainingMemoryConfig

    return TrainingMemoryConfig(**kw)


def full_finetune(kw: dict[str, Any]) -> dict[str, Any]:
    """The baseline: every parameter trained, every activation kept for the backward."""
    return {**kw, "training": _training()}


def recompute_full(kw: dict[str, Any]) -> dict[str, Any]:
    """Whole layers re-run in the backward (keeps each layer's input only)."""
    return {**kw, "training": _training(gradient_checkpointing="full")}


def recompute_selective(kw: dict[str, Any]) -> dict[str, Any]:
    """The attention core re-run in the backward."""
    return {**kw, "training": _training(gradient_checkpointing="selective")}


def lora_r16(kw: dict[str, Any]) -> dict[str, Any]:
    """LoRA r=16, alpha 32 on q/k/v/o (the seed's settings): the base frozen, adapters trained."""
    from realflow.api.model_options import LoRAConfig

    return {**kw, "training": _training(),
            "lora": LoRAConfig(enabled=True, r=16, alpha=32.0, dropout=0.05,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])}


VARIANTS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
    ("full fine-tuning", full_finetune),
    ("full + recompute (full)", recompute_full),
    ("full + recompute (selective)", recompute_selective),
    ("LoRA r=16 (q,k,v,o)", lora_r16),
]


# ----------------------------------------------------------------------------- measuring


def batch(vocab: int, n_seqs: int, seq_len: int, seed: int = 0) -> list[Any]:
    """One micro-batch of ``n_seqs`` packed sequences of ``seq_len`` tokens (80% loss tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_seqs * seq_len,), generator=g)
    mask = (torch.rand(n_seqs * seq_len, generator=g) < 0.8).float()
    return [(ids, [seq_len] * n_seqs, (torch.roll(ids, -1), mask))]


def _loss(outputs: Any, extra: Any) -> tuple[torch.Tensor, dict[str, float]]:
    labels, mask = extra
    return -(outputs.logprobs(labels) * mask).sum(), {}


def _weight(extra: Any) -> float:
    return float(extra[1].sum())


def peak_step_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated during ``step()`` above what was allocated when it began."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def measure(ckpt: str, cfg: Any, kw: dict[str, Any], mbs: list[Any], warmup: int, steps: int) -> dict[str, float]:
    """Median step seconds and the peak step memory of one engine built with ``kw``."""
    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig

    opt = EngineOptimizerConfig(lr=1e-5, weight_decay=0.0, warmup_steps_proportion=0.0,
                                lr_scheduler_type="constant", total_train_steps=1000)
    eng = MegatronEngine(cfg, build_model_groups([0], ParallelStrategy()), ckpt, opt, seed=1, **kw)

    def step() -> None:
        eng.train_batch(mbs, _loss, _weight)
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = peak_step_bytes(step, eng.device)
    state = trained_state_bytes(eng)
    del eng
    gc.collect()
    return {"step_s": statistics.median(times), "peak_bytes": float(peak), **state}


def trained_state_bytes(eng: Any) -> dict[str, float]:
    """Trainable parameters and what training keeps for them: gradient buffers, the optimizer's
    states and its own parameter shards (fp32 masters in bf16 runs; views of the weights in fp32)."""
    trainable = [p for p in eng.module.parameters() if p.requires_grad]
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in trainable
                if getattr(p, "main_grad", None) is not None)
    inner = eng.optimizer.optimizer
    moments = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    own = {p.data_ptr() for p in trainable}
    masters = sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"]
                  if p.data_ptr() not in own and p.dim() > 0 and not _is_view_of(p, trainable))
    return {"trainable": float(sum(p.numel() for p in trainable)), "state_bytes": float(grads + moments + masters)}


def _is_view_of(p: torch.Tensor, params: list[torch.Tensor]) -> bool:
    base = p.untyped_storage().data_ptr()
    return any(q.untyped_storage().data_ptr() == base for q in params)


def memory_section(args: argparse.Namespace) -> None:
    """Activation memory and step time of every variant, per model, against the first variant."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_gpu = torch.cuda.is_available()
    models = [("Qwen2 ~20M", QWEN2_20M, (4, 256) if args.quick else (8, 512)),
              ("SFT default", default_model(), (8, 128) if args.quick else (32, 128))]
    warmup, steps = (1, 2) if args.quick else (2, 4)
    for title, arch, (n_seqs, seq_len) in models:
        cfg = Qwen2Config(**arch)
        ckpt = os.path.join(args.tmp, title.replace(" ", "_"))
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        model.float().save_pretrained(ckpt)
        del model
        kw: dict[str, Any] = {}
        if on_gpu:
            kw["config_overrides"] = {"bf16": True, "params_dtype": torch.bfloat16}
        mbs = batch(cfg.vocab_size, n_seqs, seq_len)
        print(f"\n## {title}: {n_params / 1e6:.1f}M parameters, {arch['num_hidden_layers']} layers, hidden "
              f"{arch['hidden_size']}; one micro-batch of {n_seqs} x {seq_len} tokens; "
              f"{'bf16 on ' + torch.cuda.get_device_name() if on_gpu else 'fp32 on CPU'}, "
              f"{torch.get_num_threads()} thread(s)")
        print(f"| {'variant':<30} | {'step peak MiB':>13} | {'memory vs base':>14} | {'step s':>7} | "
              f"{'time vs base':>12} | {'trainable':>10} | {'grads+optim MiB':>15} | {'vs base':>7} |")
        print(f"|{'-' * 32}|{'-' * 15}|{'-' * 16}|{'-' * 9}|{'-' * 14}|{'-' * 12}|{'-' * 17}|{'-' * 9}|")
        base = None
        for name, variant in VARIANTS:
            r = measure(ckpt, cfg, variant(kw), mbs, warmup, steps)
            base = base or r
            print(f"| {name:<30} | {r['peak_bytes'] / MiB:13.1f} | "
                  f"{base['peak_bytes'] / max(r['peak_bytes'], 1):13.2f}x | {r['step_s']:7.3f} | "
                  f"{r['step_s'] / base['step_s']:11.2f}x | {r['trainable'] / 1e6:9.3f}M | "
                  f"{r['state_bytes'] / MiB:15.2f} | {100 * r['state_bytes'] / base['state_bytes']:6.2f}% |",
                  flush=True)
    print("\nmemory vs base = base peak / variant peak (goal for recompute: >= 3x); "
          "time vs base = variant step / base step (goal: <= 1.35x); grads+optim = gradient buffers + "
          "optimizer states + its master shards of the trained parameters (goal for LoRA: <= 5% of full)")


def weight_update_section(args: argparse.Namespace) -> None:
    """Bytes and time of one weight update on a ~100M model: full vs LoRA adapters vs delta, and
    the generation engine's decode linears with adapters merged vs run separately."""
    from benchmarks.bench_lora_update import print_sections

    print_sections(args.quick)


SECTIONS: list[tuple[str, Callable[[argparse.Namespace], None]]] = [
    ("activation memory and step time: full fine-tuning vs recompute vs LoRA", memory_section),
    ("weight updates: full vs LoRA adapters vs delta (~100M model)", weight_update_section),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller batches, fewer steps (a smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import logging

    logging.disable(logging.WARNING)
    import torch.distributed as dist

    from realflow.base.devices import distributed_backend, select_device

    select_device(0)
    args.tmp = tempfile.mkdtemp(prefix="rf_bench_mem_")
    atexit.register(shutil.rmtree, args.tmp, True)
    dist.init_process_group(distributed_backend(), init_method=f"file://{args.tmp}/store", rank=0, world_size=1)
    for title, section in SECTIONS:
        print(f"\n# {title}")
        section(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
