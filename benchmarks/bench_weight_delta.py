"""Delta weight sync: bytes and time of a weight update, full vs delta, on a ~100M-parameter shape.

``weight_update_rows(quick)`` returns one row per case (for ``bench_memory.py`` and the
like); ``python benchmarks/bench_weight_delta.py [--quick]`` prints them as a table.
Every ratio is against the full update measured in the same run, on the same state.

Cases (the HF-named state of a Qwen2 of ``HUNDRED_M``'s shape, random weights):

* ``sparse-3pct``: 3% of the tensors change (a few elements each);
* ``adam-fp32``: one Adam step (lr 1e-6, random gradients) on fp32 weights, published fp32;
* ``adam-bf16``: the same step on fp32 master weights, published as bf16 (what a bf16
  trainer sends): only elements whose bf16 rounding moved change -- verl reports 1-3%.

Per case: the fraction of elements whose bytes changed, the fraction of 1 MiB blocks
that changed (what the delta sends), the bytes sent, and the times: the writer's
(hash every block, gather the changed ones), the receiver's (patch and verify), and a
plain copy of the full state (what a full update costs at least: one memcpy into
shared memory), all on this machine's CPU, one thread.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from realflow.weights.delta import BLOCK_BYTES, DeltaReceiver, DeltaWriter  # noqa: E402

HUNDRED_M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000)
QUICK = dict(HUNDRED_M, num_hidden_layers=2, vocab_size=8000)


def qwen2_state(shape: dict[str, int], dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF names and shapes of a Qwen2 (tied embeddings), N(0, 0.02) weights, norms at 1."""
    g = torch.Generator().manual_seed(seed)
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.q_proj.bias": (h,), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.weight": (h, h),
                       p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (f, h),
                       p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    shapes["model.norm.weight"] = (h,)
    return {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02).to(dtype)
            for n, s in shapes.items()}


def adam_step(master: dict[str, torch.Tensor], lr: float = 1e-6, seed: int = 1) -> dict[str, torch.Tensor]:
    """The fp32 weights after one torch.optim.Adam step on random gradients."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(t.clone()) for t in master.values()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    torch.optim.Adam(params, lr=lr).step()
    return {n: p.detach() for n, p in zip(master, params)}


def sparse_change(state: dict[str, torch.Tensor], frac_tensors: float, seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    names = list(state)
    pick = torch.randperm(len(names), generator=g)[:max(1, round(frac_tensors * len(names)))]
    out = dict(state)
    for i in pick.tolist():
        t = state[names[i]].clone()
        idx = torch.randint(0, t.numel(), (16,), generator=g)
        t.view(-1)[idx] += 0.01
        out[names[i]] = t
    return out


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def measure(name: str, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One case: a writer and a receiver at ``before``; the update to ``after`` as full and as delta."""
    w, r = DeltaWriter(BLOCK_BYTES), DeltaReceiver()
    p0 = w.prepare(before, 1)
    tensors, man = w.message(p0, None)
    r.commit(r.apply(man, tensors))
    w.commit(p0)

    changed = sum(int((a.view(-1).view(torch.uint8 if a.element_size() == 1 else _int(a)) !=
                       b.view(-1).view(torch.uint8 if b.element_size() == 1 else _int(b))).sum())
                  for a, b in zip(before.values(), after.values()))
    elements = sum(t.numel() for t in after.values())

    t0 = time.perf_counter()
    copy = {n: t.clone() for n, t in after.items()}  # a full update's floor: one copy of every byte
    t_copy = time.perf_counter() - t0
    del copy
    t0 = time.perf_counter()
    prep = w.prepare(after, 2)
    t_hash = time.perf_counter() - t0
    t0 = time.perf_counter()
    tensors, man = w.message(prep, 1, "off")
    full_sent = man["sent_bytes"]
    tensors, man = w.message(prep, 1, "auto")
    t_msg = time.perf_counter() - t0
    t0 = time.perf_counter()
    pending = r.apply(man, tensors)
    t_apply = time.perf_counter() - t0
    r.commit(pending)
    assert r.root == prep.root  # the receiver holds the writer's version, bit for bit
    n_blocks = sum(len(d) for d in prep.table.values())
    changed_blocks = sum(len(i) for i in (prep.changed or {}).values())
    full = _nbytes(after)
    return {"case": name, "dtype": str(next(iter(after.values())).dtype).removeprefix("torch."),
            "params_M": round(elements / 1e6, 1), "full_MB": round(full / 1e6, 1),
            "elements_changed_pct": round(100 * changed / elements, 3),
            "blocks_changed_pct": round(100 * changed_blocks / n_blocks, 2),
            "kind": "delta" if man["base"] is not None else "full",
            "sent_MB": round(man["sent_bytes"] / 1e6, 2), "sent_vs_full": round(man["sent_bytes"] / full_sent, 4),
            "copy_full_s": round(t_copy, 3), "writer_hash_s": round(t_hash, 3),
            "writer_gather_s": round(t_msg, 3), "receiver_apply_s": round(t_apply, 3)}


def _int(t: torch.Tensor) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def weight_update_rows(quick: bool) -> list[dict[str, Any]]:
    """One row per case (see the module docstring); ``quick``: a 2-layer, 8k-vocab shape."""
    torch.set_num_threads(1)
    shape = QUICK if quick else HUNDRED_M
    master = qwen2_state(shape)
    rows = [measure("sparse-3pct", master, sparse_change(master, 0.03))]
    stepped = adam_step(master)
    rows.append(measure("adam-fp32 lr=1e-6", master, stepped))
    rows.append(measure("adam-bf16 lr=1e-6", {n: t.bfloat16() for n, t in master.items()},
                        {n: t.bfloat16() for n, t in stepped.items()}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 2-layer, 8k-vocab shape instead of ~100M parameters")
    rows = weight_update_rows(ap.parse_args().quick)
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))


if __name__ == "__main__":
    main()
