"""Replay recorded samples through both engines, token for token, and look inside.

Why: the generator's log-probs of its own samples differ from the trainer's (kernels,
precision, batch shapes, the KV-cache path, stale or corrupt weights).  A gap in the stats
says *that* they differ; finding *why* needs both sides run again on the same tokens, with
the hidden states compared op by op.  This module is that replay; the verdict (which knob
closes the gap) is the doctor's (``experiments/mismatch_doctor.py``).

* :func:`replay_generator` teacher-forces the built-in generation engine's
  :class:`~parallel.generation.decoder.Decoder` as the engine runs it: one right-padded
  prefill of the prompts, then one decode step per response token against the KV cache,
  finished rows leaving the batch as the engine removes them (last row into the hole).
  ``full_prefill=True`` instead runs prompt + response through one prefill (no KV-cache
  decode): the attention-path knob.
* :func:`replay_trainer` runs :meth:`parallel.engine.MegatronEngine.logprobs` on the packed
  samples with the run's micro-batch budget.
* With ``probe=True`` both keep the residual stream after the embedding, after each layer's
  attention and MLP blocks, the final norm's output and the logits, at the positions that
  predict the response tokens: ``hidden[(op, layer)][sample]`` is ``[n_response, width]``
  on both sides, so :func:`divergence` compares like with like.

A sample is a token list (prompt + response) and its prompt length; the response log-probs
are of ``log_softmax(logits / temperature)``.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from parallel.generation.decoder import KVCache

__all__ = ["Replay", "replay_generator", "replay_trainer", "divergence", "gap_stats", "point_order",
           "point_name"]

Key = tuple[str, int]  # (op, layer): ("embedding", -1), ("attention", i), ("mlp", i), ("final_norm", -1), ("logits", -1)


@dataclass
class Replay:
    """Per sample: the log-prob of each response token; with probes, the hidden states."""

    logprobs: list[torch.Tensor]  # [n_i] fp32
    hidden: dict[Key, list[Optional[torch.Tensor]]] = field(default_factory=dict)  # key -> sample -> [n_i, D]
    #: MoE generator replays (KV-cache path): per sample, the experts each token was routed to,
    #: ``[len(sample), layers, topk]`` aligned with its tokens (the last token, never fed, is 0)
    routes: Optional[list[torch.Tensor]] = None


def point_order(num_layers: int) -> list[Key]:
    """The probe points in forward order."""
    keys: list[Key] = [("embedding", -1)]
    for i in range(num_layers):
        keys += [("attention", i), ("mlp", i)]
    return keys + [("final_norm", -1), ("logits", -1)]


def point_name(key: Key) -> str:
    op, layer = key
    return f"layer {layer} {op}" if layer >= 0 else op.replace("_", " ")


class _Capture:
    """Collects probe outputs into ``[n_i, D]`` fp32 buffers, one per (point, sample)."""

    def __init__(self, n_resp: list[int]) -> None:
        self.n = n_resp
        self.hidden: dict[Key, list[Optional[torch.Tensor]]] = defaultdict(lambda: [None] * len(n_resp))

    def put(self, key: Key, sample: int, start: int, x: torch.Tensor) -> None:
        bufs = self.hidden[key]
        if bufs[sample] is None:
            bufs[sample] = torch.zeros(self.n[sample], x.shape[-1], dtype=torch.float32)
        bufs[sample][start:start + x.shape[0]] = x.detach().float().cpu()


def _lp(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    lg = logits.float() if temperature == 1.0 else logits.float() / temperature
    return torch.log_softmax(lg, -1).gather(-1, targets.to(lg.device)[:, None]).squeeze(-1).cpu()


def _check(seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[int]:
    n = [len(s) - p for s, p in zip(seqs, prompt_lens)]
    bad = [i for i, (k, p) in enumerate(zip(n, prompt_lens)) if k < 1 or p < 1]
    if bad:
        raise ValueError(f"sample {bad[0]}: needs a prompt and at least one response token "
                         f"(length {len(seqs[bad[0]])}, prompt {prompt_lens[bad[0]]})")
    return n


@torch.inference_mode()
def replay_generator(engine: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                     temperature: float = 1.0, *, probe: bool = False, full_prefill: bool = False) -> Replay:
    """Teacher-forced replay on a :class:`parallel.generation.GenerationEngine` built with at
    least ``len(seqs)`` slots and room for the longest sample (see module docstring)."""
    n = _check(seqs, prompt_lens)
    dec = engine.decoder
    J = len(seqs)
    longest = max(len(s) for s in seqs)
    if longest > engine.max_context:
        raise ValueError(f"samples up to {longest} tokens need an engine with that max_model_len "
                         f"(it has {engine.max_context})")
    dev = engine.weights.device
    # the replay's own contiguous cache (one slot per sample), beside the engine's pool
    cache = KVCache(engine.spec, J, engine.max_context, engine.weights.dtype, dev)
    cap = _Capture(n) if probe else None
    lps = [torch.zeros(k) for k in n]
    where: dict[str, Any] = {}  # what the current probe call's rows are

    def on_probe(op: str, layer: int, x: torch.Tensor) -> None:
        key = (op, layer)
        if where["phase"] == "prefill":
            if x.dim() == 3:
                for i in range(J):
                    a, b = where["span"][i]
                    cap.put(key, i, 0, x[i, a:b])
            else:
                for i in range(J):
                    cap.put(key, i, 0, x[i:i + 1])
        elif where["phase"] == "decode":
            for r, i in enumerate(where["rows"]):
                cap.put(key, i, where["step"], x[r:r + 1])
        elif where["phase"] == "logits":  # full prefill: one sample's positions through logits()
            cap.put(key, where["sample"], 0, x)

    dec.probe = on_probe if probe else None
    try:
        if full_prefill:
            ins = [list(s[:-1]) for s in seqs]  # the last token predicts nothing
            ids, lens = _right_padded(ins, dev)
            last_x: dict[str, torch.Tensor] = {}
            L = dec.spec.num_layers

            def keep_last(op: str, layer: int, x: torch.Tensor) -> None:
                if op == "mlp" and layer == L - 1 and x.dim() == 3:
                    last_x["x"] = x.clone()
                if probe and x.dim() == 3:
                    on_probe(op, layer, x)
            where.update(phase="prefill", span=[(p - 1, len(s) - 1) for s, p in zip(seqs, prompt_lens)])
            dec.probe = keep_last
            dec.prefill(ids, lens, cache, 0)
            dec.probe = on_probe if probe else None
            where["phase"] = "logits"
            for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
                where["sample"] = i
                logits = dec.logits(last_x["x"][i, p - 1:len(s) - 1])
                lps[i] = _lp(logits, torch.tensor(s[p:]), temperature)
            return Replay(lps, dict(cap.hidden) if cap else {})
        ids, lens = _right_padded([list(s[:p]) for s, p in zip(seqs, prompt_lens)], dev)
        where.update(phase="prefill", span=[(p - 1, p) for p in prompt_lens])
        logits = dec.prefill(ids, lens, cache, 0)
        routes = None
        if dec.moe is not None:  # the experts of every fed token (what routing replay hands the trainer)
            k = dec.routing.shape[-1]
            routes = [torch.zeros(len(s), dec.spec.num_layers, k, dtype=torch.long) for s in seqs]
            for i, p in enumerate(prompt_lens):
                routes[i][:p] = dec.routing[i, :p].long().cpu()
        firsts = torch.tensor([s[p] for s, p in zip(seqs, prompt_lens)])
        for i, v in enumerate(_lp(logits, firsts, temperature).tolist()):
            lps[i][0] = v
        rows = list(range(J))  # row r of the running batch holds sample rows[r] (KV slot r)
        _remove(rows, [r for r, i in enumerate(rows) if n[i] == 1], cache, prompt_lens, 0)
        step = 1
        while rows:
            toks = torch.tensor([seqs[i][prompt_lens[i] + step - 1] for i in rows], device=dev)
            pos = torch.tensor([prompt_lens[i] + step - 1 for i in rows], device=dev)
            where.update(phase="decode", rows=list(rows), step=step)
            logits = dec.decode(toks, pos, cache)
            if routes is not None:
                for r, i in enumerate(rows):
                    routes[i][prompt_lens[i] + step - 1] = dec.routing[r].long().cpu()
            nxt = torch.tensor([seqs[i][prompt_lens[i] + step] for i in rows])
            for i, v in zip(rows, _lp(logits, nxt, temperature).tolist()):
                lps[i][step] = v
            _remove(rows, [r for r, i in enumerate(rows) if n[i] == step + 1], cache, prompt_lens, step)
            step += 1
        return Replay(lps, dict(cap.hidden) if cap else {}, routes)
    finally:
        dec.probe = None


def _right_padded(seqs: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), P, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids.to(dev), torch.tensor([len(s) for s in seqs], dtype=torch.long, device=dev)


def _remove(rows: list[int], done: list[int], cache: Any, prompt_lens: Sequence[int], step: int) -> None:
    """The engine's ``_remove_rows``: highest row first, the last row moves into the hole."""
    for r in sorted(done, reverse=True):
        last = len(rows) - 1
        if r != last:
            cache.move(last, r, prompt_lens[rows[last]] + step)
            rows[r] = rows[last]
        rows.pop()


def replay_trainer(engine: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                   max_tokens_per_mb: Optional[int], temperature: float = 1.0, *, probe: bool = False,
                   routes: Optional[Sequence[torch.Tensor]] = None) -> Replay:
    """:meth:`MegatronEngine.logprobs` of the packed samples (``max_tokens_per_mb`` as the run;
    1 = one sequence per micro-batch); with ``probe``, forward hooks on the GPTModel; with
    ``routes`` (an MoE generator replay's), every token goes to the generator's experts."""
    n = _check(seqs, prompt_lens)
    packed = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    lens = [len(s) for s in seqs]
    handles = _hooks(engine, seqs, prompt_lens, _Capture(n)) if probe else None
    # the probe reads each sample's rows whole: a shared-prefix row (training.shared_prefix)
    # keeps them apart here (the log-probs are the same either way)
    try:
        kw = {} if routes is None else {"routed_experts": torch.cat(list(routes))}
        with engine.without_shared_prefix() if probe else contextlib.nullcontext():
            lp = engine.logprobs(packed, lens, max_tokens_per_mb, temperature=temperature, **kw)
    finally:
        cap = None
        if handles is not None:
            cap, hs = handles
            for h in hs:
                h.remove()
    lp = lp.float().cpu()
    out, off = [], 0
    for s, p in zip(seqs, prompt_lens):
        out.append(lp[off + p - 1:off + len(s) - 1].clone())
        off += len(s)
    return Replay(out, dict(cap.hidden) if cap else {})


def _hooks(engine: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], cap: _Capture):
    """Forward hooks on the GPTModel (hidden states ``[s, b, h]``: sequence first); each micro-batch's
    rows (pad-free: the segments of its one row) are matched to samples by their tokens (read from
    the model's input in a pre-hook)."""
    model = engine.module
    vocab = engine.arch.vocab_size
    free: dict[tuple[int, ...], deque] = defaultdict(deque)
    for i, s in enumerate(seqs):
        free[tuple(s)].append(i)
    rows: list[tuple[int, int, int]] = []  # (batch row, start in the row, sample)

    def on_input(_mod, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        pos = args[1] if len(args) > 1 else kwargs["position_ids"]
        packed = kwargs.get("packed_seq_params")
        rows.clear()
        if packed is not None:  # pad-free: one row of back-to-back sequences (parallel/packed_batch.py)
            spans, start = [], 0
            for n in packed.segments:
                spans.append((0, start, n))
                start += n
        else:
            ar = torch.arange(ids.shape[1], device=ids.device)
            spans = [(r, 0, int((pos[r] == ar).sum())) for r in range(ids.shape[0])]
        for r, start, n in spans:
            q = free.get(tuple(ids[r, start:start + n].tolist()))
            if q:
                rows.append((r, start, q.popleft()))

    def put(key: Key, x: torch.Tensor) -> None:
        for r, start, i in rows:
            cap.put(key, i, 0, x[start + prompt_lens[i] - 1:start + len(seqs[i]) - 1, r])

    def first(o: Any) -> torch.Tensor:
        return o[0] if isinstance(o, (tuple, list)) else o

    hs = [model.register_forward_pre_hook(on_input, with_kwargs=True),
          model.embedding.register_forward_hook(lambda m, a, o: put(("embedding", -1), first(o)))]
    for li, layer in enumerate(model.decoder.layers):
        hs.append(layer.pre_mlp_layernorm.register_forward_pre_hook(
            lambda m, a, li=li: put(("attention", li), a[0])))
        hs.append(layer.register_forward_hook(lambda m, a, o, li=li: put(("mlp", li), first(o))))
    hs.append(model.decoder.final_layernorm.register_forward_hook(lambda m, a, o: put(("final_norm", -1), first(o))))
    hs.append(model.output_layer.register_forward_hook(
        lambda m, a, o: put(("logits", -1), first(o)[..., :vocab])))
    return cap, hs


def divergence(a: Replay, b: Replay, keys: Sequence[Key]) -> list[tuple[Key, float]]:
    """Per probe point: the largest relative difference ``|a - b| / |b|`` of one token's vector
    over every sample and position (points either side lacks are left out)."""
    out = []
    for key in keys:
        xa, xb = a.hidden.get(key), b.hidden.get(key)
        if not xa or not xb:
            continue
        worst = 0.0
        for u, v in zip(xa, xb):
            if u is None or v is None:
                continue
            rel = (u - v).norm(dim=-1) / v.norm(dim=-1).clamp_min(1e-12)
            worst = max(worst, float(rel.max()))
        out.append((key, worst))
    return out


def gap_stats(behaviour: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor]) -> dict[str, float]:
    """The gap between two sides' log-probs of the same tokens: mean / max |Δ log p|, the k3
    estimate of KL(behaviour || trainer) (tokens were drawn from the behaviour policy), and the
    fraction of tokens with |Δ| > 0.1 and > 1."""
    g = torch.cat([torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in behaviour])
    t = torch.cat([torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in trainer])
    if g.numel() == 0:
        return {"tokens": 0, "mean_abs": 0.0, "max_abs": 0.0, "k3_kl": 0.0, "frac_gt_0.1": 0.0, "frac_gt_1": 0.0}
    d = t - g  # log(pi_trainer / pi_behaviour)
    a = d.abs()
    return {"tokens": int(g.numel()), "mean_abs": float(a.mean()), "max_abs": float(a.max()),
            "k3_kl": float((d.exp() - 1 - d).mean()), "frac_gt_0.1": float((a > 0.1).double().mean()),
            "frac_gt_1": float((a > 1).double().mean())}
