"""What a weight update costs, full vs LoRA adapters vs delta, and merged vs separate low-rank decode.

``update_rows(quick)`` (the weight-update section of ``bench_memory.py``) measures on the HF state
of a ~100M-parameter Qwen2 (``bench_weight_delta.HUNDRED_M``), one CPU thread, each ratio
against the full update in the same run:

* full: the bytes of the whole model and the time of a memcpy of it (what a shared-memory
  publish costs at least) plus a generation engine's update from it;
* LoRA r=16 on q/k/v/o (the seed's targets) and on all seven linears: the adapter's bytes, the
  same memcpy, and the receiving engine's work (merge ``W + (alpha/r) B A`` into its base, then
  the update of the merged linears);
* delta: ``bench_weight_delta``'s rows (sparse changes and one Adam step in fp32 and bf16).

``decode_rows(quick)`` is why the generation engine merges adapters instead of running them
beside the base weights: one decode step's linears of the default model and of the ~100M shape
(batch 32 tokens), merged (``x W^T``) against separate (``x W^T + s (x A^T) B^T`` for every
adapted linear), timed in the same run.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_weight_delta import HUNDRED_M, QUICK, qwen2_state, weight_update_rows  # noqa: E402

MiB = 2 ** 20
TARGETS = {"q,k,v,o": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "all linears": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _timed(fn: Any, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adapters(state: dict[str, torch.Tensor], targets: list[str], r: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """PEFT-named random adapters of rank ``r`` for ``targets`` of every layer of ``state``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in state.items():
        module = name[:-len(".weight")]
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
            continue
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, w.shape[1], generator=g) * 0.01
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(w.shape[0], r, generator=g) * 0.01
    return out


def _engine_for(shape: dict[str, int], state: dict[str, torch.Tensor], tmp: str) -> Any:
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from parallel.generation import EngineConfig, GenerationEngine

    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=512)
    cfg.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"))
    return GenerationEngine.from_hf(tmp, EngineConfig(max_running_requests=1, max_model_len=64), tokenizer=None)


def update_rows(quick: bool) -> list[dict[str, Any]]:
    shape = QUICK if quick else HUNDRED_M
    state = qwen2_state(shape)
    full = _nbytes(state)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        eng = _engine_for(shape, state, tmp)
        eng.adapter_scaling = 2.0
        copy_full = _timed(lambda: {k: v.clone() for k, v in state.items()})
        apply_full = _timed(lambda: eng.update_weights_from_tensors(state, "hf"), repeat=2)
        rows.append({"case": "full model", "bytes": full, "copy_s": copy_full, "apply_s": apply_full})
        for label, targets in TARGETS.items():
            ad = adapters(state, targets, 16)
            copy_s = _timed(lambda: {k: v.clone() for k, v in ad.items()})
            apply_s = _timed(lambda: eng.update_weights_from_tensors(ad, "hf"), repeat=2)
            rows.append({"case": f"LoRA r=16 ({label})", "bytes": _nbytes(ad), "copy_s": copy_s, "apply_s": apply_s})
    for r in weight_update_rows(quick):
        rows.append({"case": f"delta: {r['case']} ({r['dtype']})", "bytes": int(r["sent_MB"] * 1e6),
                     "copy_s": r["writer_hash_s"] + r["writer_gather_s"], "apply_s": r["receiver_apply_s"]})
    for row in rows:
        row["bytes_vs_full"] = full / max(row["bytes"], 1)
    return rows


def decode_rows(quick: bool) -> list[dict[str, Any]]:
    """One decode step's linears, merged vs separate low-rank, r = 16 on all seven linears."""
    from dataclasses import asdict

    from experiments.init_model import TinyArchConfig

    tiny = asdict(TinyArchConfig())
    shapes = [("SFT default", tiny["hidden_size"], tiny["intermediate_size"], tiny["num_hidden_layers"])]
    if not quick:
        shapes.append(("~100M", HUNDRED_M["hidden_size"], HUNDRED_M["intermediate_size"],
                       HUNDRED_M["num_hidden_layers"]))
    rows = []
    for title, h, f, layers in shapes:
        ws = [torch.randn(o, i) * 0.02 for o, i in ((h, h), (h, h), (h, h), (h, h), (f, h), (f, h), (h, f))]
        ab = [(torch.randn(16, w.shape[1]) * 0.01, torch.randn(w.shape[0], 16) * 0.01) for w in ws]
        wt = [w.t().contiguous() for w in ws]
        at = [(a.t().contiguous(), b.t().contiguous()) for a, b in ab]
        x = torch.randn(32, h)
        xf = torch.randn(32, f)

        def merged() -> None:
            for _ in range(layers):
                for w, inp in zip(wt, [x, x, x, x, x, x, xf]):
                    inp @ w

        def separate() -> None:
            for _ in range(layers):
                for w, (a, b), inp in zip(wt, at, [x, x, x, x, x, x, xf]):
                    inp @ w + ((inp @ a) @ b) * 2.0

        merged()
        separate()
        tm, ts = _timed(merged, 20), _timed(separate, 20)
        rows.append({"model": title, "merged_ms": tm * 1e3, "separate_ms": ts * 1e3, "ratio": ts / tm})
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print_sections(args.quick)


def print_sections(quick: bool) -> None:
    rows = update_rows(quick)
    print(f"| {'update':<36} | {'MiB':>9} | {'fewer bytes':>11} | {'copy s':>7} | {'apply s':>8} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 13}|{'-' * 9}|{'-' * 10}|")
    for r in rows:
        print(f"| {r['case']:<36} | {r['bytes'] / MiB:9.2f} | {r['bytes_vs_full']:10.1f}x | {r['copy_s']:7.3f} | "
              f"{r['apply_s']:8.3f} |", flush=True)
    print("fewer bytes = full model bytes / update bytes (goal for LoRA r=16: >= 20x); copy s: the update's "
          "memcpy (delta rows: the writer's hashing); apply s: the receiving engine's update (LoRA: merge "
          "into the base, then update the merged linears)")
    print(f"\n| {'decode linears, batch 32':<24} | {'merged ms':>9} | {'separate ms':>11} | {'separate / merged':>17} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 13}|{'-' * 19}|")
    for r in decode_rows(quick):
        print(f"| {r['model']:<24} | {r['merged_ms']:9.3f} | {r['separate_ms']:11.3f} | {r['ratio']:16.2f}x |")


if __name__ == "__main__":
    main()
