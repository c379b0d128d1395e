"""The cost model: an MFC's work on a layout, in seconds, from a device profile.

Why a closed form rather than a trace: the search evaluates thousands of layouts, so
each estimate must take microseconds; ``benchmarks/bench_planner.py`` checks the form
against measured steps. The terms, per data-parallel rank:

* GEMMs: ``2 * params * tokens`` FLOPs forward (x3 with backward), split over tp and pp,
  at ``matmul_flops``, plus ``matmul_overhead_s`` per GEMM call (4 per layer);
* attention: causal, ``2 * layers * heads * head_dim * sum(s^2)`` FLOPs forward (x3.5);
* small ops (norms, activations, residuals): ``op_overhead_s`` each, ~12 per layer;
* tensor parallelism: two all-reduces of the micro-batch's activations per layer forward
  (four with backward) over the tp group;
* pipeline parallelism: 1F1B's bubble ``(pp - 1) / micro-batches`` (the micro-batches the token
  budget makes: the engine does not split further for the pipeline) and a p2p send of the
  activations per stage boundary and micro-batch;
* training: the gradient all-reduce over dp (fp32 main grads) and the Adam update, memory
  bound over the dp-sharded states;
* generation: a prefill of the prompts, then one decode step per generated token of the
  longest answer (a synchronous batch waits for its slowest), each step the larger of its
  GEMM FLOPs and reading the weights (and KV cache) from memory, plus a fixed cost per layer;
  when the KV caches of a rank's sequences exceed its free memory, the engine decodes them in
  waves that fit (continuous batching), each wave as long as its longest answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from realflow.api.allocation import ParallelStrategy
from realflow.planner.cluster import ClusterSpec
from realflow.planner.microbatches import micro_batch_shapes
from realflow.planner.profile import LinkProfile

GEMMS_PER_LAYER = 4  # fused qkv, attention output projection, fused fc1 [gate; up], fc2
SMALL_OPS_PER_LAYER = 12
ACT_BYTES_PER_TOKEN_HIDDEN = 34  # activation bytes per token and hidden unit per layer (Korthikanti et al., 16-bit)


@dataclass(frozen=True)
class ModelFacts:
    """The numbers of a decoder-only transformer the cost model needs, from its HF config."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelFacts":
        from realflow.base.hf_models import language_fields

        cfg = language_fields(cfg)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                               "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"model config lacks {missing} (an HF config.json of a decoder-only model is needed)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(layers=int(cfg["num_hidden_layers"]), hidden=hidden, ffn=int(cfg["intermediate_size"]),
                   heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads), vocab=int(cfg["vocab_size"]))

    @property
    def layer_params(self) -> int:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim * self.hidden
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.ffn * self.hidden + 2 * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

    def gemm_flops_fwd(self, tokens: float) -> float:
        return 2.0 * (self.layers * self.layer_params + self.vocab * self.hidden) * tokens

    def attn_flops_fwd(self, sum_sq: float) -> float:
        return 2.0 * self.layers * self.heads * self.head_dim * sum_sq  # causal: half of 4*s^2*d

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Work:
    """What an MFC processes in one step (global over its data-parallel ranks)."""

    kind: str  # "train" | "inference" | "generate"
    seqs: int
    seq_len: float  # mean total length (prompt + answer) of a sequence
    prompt_len: float = 0.0  # generate: prompt tokens per sequence
    gen_len_max: float = 0.0  # generate: decode steps of the batch (its longest answer)
    gen_len_mean: float = 0.0
    max_tokens_per_mb: int = 0  # 0: one micro-batch per rank
    kv_budget_bytes: float = 0.0  # generate: memory a rank may give the KV cache (0 = unbounded)
    updates: int = 1  # train: optimizer steps per call (PPO epochs x mini-batches)
    seq_len_max: float = 0.0  # the longest sequence (0: all are seq_len long)
    seq_len_min: float = 0.0  # the shortest (0: 1 token)
    group: int = 1  # sequences per sample (a prompt's answers: they share a micro-batch)
    # the engine runs micro-batches pad-free (training.pad_free): cut by real tokens, no padding
    pad_free: bool = False
    # prompt tokens per sequence a group computes once (training.shared_prefix; 0 = none shared)
    shared_prompt: float = 0.0

    @property
    def computed_len(self) -> float:
        """Rows computed per sequence: its length, less its share of a prompt computed once per group."""
        return self.seq_len - self.shared_prompt * (1.0 - 1.0 / max(self.group, 1))


@dataclass
class Cost:
    """Seconds by component; ``total`` is what the MFC occupies its devices for."""

    compute: float = 0.0
    overhead: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    dp_sync: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.overhead + self.tp_comm + self.pp_comm + self.bubble + self.dp_sync + self.optimizer


def allreduce_s(link: LinkProfile, n: int, nbytes: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.bandwidth


def p2p_s(link: LinkProfile, nbytes: float) -> float:
    return link.alpha_s + nbytes / link.bandwidth


def _groups(workers: Sequence[int], s: ParallelStrategy) -> tuple[list[int], list[int], list[int]]:
    """The first tp, pp and dp group of ``workers`` in megatron's rank order (tp fastest, then dp,
    then pp: see parallel.groups), to pick the link each collective crosses."""
    w = list(workers)
    tp = w[:s.tp]
    dp = w[:s.tp * s.dp:s.tp]
    pp = w[::s.tp * s.dp][:s.pp]
    return tp, pp, dp


def mfc_cost(facts: ModelFacts, s: ParallelStrategy, workers: Sequence[int], work: Work,
             cluster: ClusterSpec) -> Cost:
    dev = cluster.device
    tp_g, pp_g, dp_g = _groups(workers, s)
    tp_link, pp_link, dp_link = cluster.link(tp_g), cluster.link(pp_g), cluster.link(dp_g)
    seqs_rank = max(work.seqs / s.dp, 1.0)
    layers_stage = math.ceil(facts.layers / s.pp)
    if work.kind == "generate":
        waves = generation_waves(facts, s, work, seqs_rank, dev.params_bytes)
        one = _generate(facts, s, work, seqs_rank / waves, layers_stage, dev, tp_link, pp_link)
        return Cost(**{k: waves * v for k, v in vars(one).items()})
    c = Cost()
    # every update's mini-batch is split into micro-batches of its own (padded ones: the runtime's
    # partition, see microbatches.py); the engine pipelines the micro-batches it is given, not
    # more: with fewer micro-batches than stages, 1F1B's bubble is most of the step
    shapes = micro_batch_shapes(work, s.dp, s.pp, dev.packed_attention or work.pad_free)
    mbs = sum(w for w, _, _ in shapes)  # expected micro-batches (padded: averaged over deals)
    factor = 3.0 if work.kind == "train" else 1.0
    tokens = 0.0
    for w, n, length in shapes:
        one = Cost()
        _forward(one, facts, s, n * length, n * length ** 2, layers_stage, 1, dev, tp_link, factor)
        for k, v in vars(one).items():
            setattr(c, k, getattr(c, k) + w * v)
        tokens += w * n * length
    measured = dev.layer_costs(s.tp, work.kind == "train", tokens / mbs)[1]
    if measured > 0:  # the framework's measured cost per layer replaces the primitive-op count
        c.overhead = mbs * layers_stage * measured + (dev.call_overhead(s.tp, False) if work.kind != "train" else 0.0)
    mb_act = tokens / mbs * facts.hidden * dev.params_bytes
    c.pp_comm += (s.pp - 1) * mbs * p2p_s(pp_link, mb_act) * (2 if work.kind == "train" else 1)
    per_stage = c.compute + c.overhead + c.tp_comm
    c.bubble += per_stage * (s.pp - 1) * work.updates / mbs
    if work.kind == "train":
        rank_params = facts.params / (s.tp * s.pp)
        u = work.updates
        c.dp_sync += u * allreduce_s(dp_link, s.dp, rank_params * 4)  # fp32 main grads, every update
        c.optimizer += u * (rank_params / s.dp * 16 * 3 / dev.memory_bandwidth
                            + (dev.call_overhead(s.tp, True) or 4 * layers_stage * dev.op_overhead_s))
    return c


def _micro_batches(tokens: float, work: Work) -> int:
    return max(1, math.ceil(tokens / work.max_tokens_per_mb)) if work.max_tokens_per_mb else 1


def generation_waves(facts: ModelFacts, s: ParallelStrategy, work: Work, seqs_rank: float, dtype_bytes: int) -> int:
    """How many rounds a rank decodes its sequences in, when their KV caches do not fit at once."""
    if work.kv_budget_bytes <= 0:
        return 1
    per_seq = (work.prompt_len + work.gen_len_max) * facts.kv_bytes_per_token(dtype_bytes) / (s.tp * s.pp)
    return math.ceil(seqs_rank / max(int(work.kv_budget_bytes // per_seq), 1))


def _generate(facts: ModelFacts, s: ParallelStrategy, work: Work, seqs_rank: float, layers_stage: int,
              dev: Any, tp_link: LinkProfile, pp_link: LinkProfile) -> Cost:
    """One wave of ``seqs_rank`` sequences on a rank: the prefill, then the decode steps."""
    c = Cost()
    _forward(c, facts, s, seqs_rank * work.prompt_len, seqs_rank * work.prompt_len ** 2, layers_stage, 1, dev,
             tp_link)
    steps = work.gen_len_max
    live = seqs_rank * work.gen_len_mean / steps  # the batch shrinks as answers end: its mean over the steps
    ctx = work.prompt_len + work.gen_len_mean / 2
    # with pp > 1 the batch is pipelined as pp micro-batches, so each stage reads its weights pp
    # times a step: decoding, which is memory bound, gains nothing from pp but capacity
    weight_reads = facts.params * dev.params_bytes / s.tp
    kv_bytes = live * ctx * facts.kv_bytes_per_token(dev.params_bytes) / (s.tp * s.pp)
    flops = (facts.gemm_flops_fwd(live) + facts.attn_flops_fwd(live * ctx * 2)) / (s.tp * s.pp)
    tp_measured = dev.measured_at(s.tp) and dev.tp_decode_layer_overhead_s > 0
    c.compute += steps * max(flops / dev.matmul_flops, (weight_reads + kv_bytes) / dev.memory_bandwidth,
                             measured_decode_compute_s(facts, dev, live, layers_stage, s.tp, tp_measured))
    # at the measured tp every fixed cost is its own measurement (a decode step's embedding
    # all-reduce and logits gather; a tp collective here costs ~0.3-4 ms, the step's GEMMs less)
    at = s.tp if tp_measured else 1
    c.overhead += steps * (facts.layers * dev.engine_value("decode_layer_overhead_s", at)  # every stage, once per micro-batch
                           + dev.engine_value("decode_step_overhead_s", at) + live * dev.engine_value("decode_seq_s", at))
    c.overhead += dev.engine_value("generate_call_overhead_s", at) + seqs_rank * dev.engine_value("generate_seq_overhead_s", at)
    act = live * facts.hidden * dev.params_bytes
    if not tp_measured:  # a measured tp layer includes its collectives
        c.tp_comm += steps * layers_stage * 2 * allreduce_s(tp_link, s.tp, act)
    c.pp_comm += steps * (s.pp - 1) * p2p_s(pp_link, act)
    return c


def measured_decode_compute_s(facts: ModelFacts, dev: Any, live: float, layers: int, tp: int,
                              tp_measured: bool) -> float:
    """One decode step's per-sequence layer work as the engine measured it (``decode_layer_seq_s``
    at the reference layer, scaled by the layer's size, split by tp unless measured at it) plus
    the LM head's GEMM; 0 without a measurement (the roofline alone prices the step)."""
    per_seq = dev.tp_decode_layer_seq_s if tp_measured else dev.decode_layer_seq_s
    if per_seq <= 0 or dev.layer_reference_params <= 0:
        return 0.0
    shard = 1 if tp_measured else tp
    layers_s = live * layers * per_seq * facts.layer_params / dev.layer_reference_params / shard
    return layers_s + 2.0 * facts.vocab * facts.hidden * live / tp / dev.matmul_flops


def _forward(c: Cost, facts: ModelFacts, s: ParallelStrategy, tokens: float, sum_sq: float, layers_stage: int,
             mbs: int, dev: Any, tp_link: LinkProfile, factor: float = 1.0) -> None:
    split = s.tp * s.pp
    train = factor > 1
    token_part = dev.layer_costs(s.tp, train, tokens / mbs)[0]
    tp_measured = dev.measured_at(s.tp) and token_part > 0
    if token_part > 0 and dev.layer_reference_params > 0:
        # the engine's measured cost of a layer's tokens (GEMMs, elementwise passes, norms; at the
        # measured tp also its collectives) at this micro-batch size, scaled by the layer's size;
        # the LM head's GEMM on top, from the primitive rate, and the call's measured per-token
        # cost beyond the reference model's head GEMM (loss, embedding; at tp their collectives)
        shard = 1 if tp_measured else s.tp
        c.compute += mbs * layers_stage * token_part * facts.layer_params / dev.layer_reference_params / shard
        c.compute += factor * 2.0 * facts.vocab * facts.hidden * tokens / s.tp / dev.matmul_flops
        head = dev.engine_value(f"{'train' if train else 'forward'}_head_token_s", s.tp)
        if head > 0:
            ref_gemm = factor * 2.0 * dev.head_reference_size / (s.tp if tp_measured else 1) / dev.matmul_flops
            c.compute += tokens * max(head - ref_gemm, 0.0) / shard
    else:
        c.compute += factor * facts.gemm_flops_fwd(tokens) / split / dev.matmul_flops
    c.compute += (factor + 0.5 * (factor > 1)) * facts.attn_flops_fwd(sum_sq) / split / dev.attention_flops
    calls = mbs * layers_stage * factor
    c.overhead += calls * (GEMMS_PER_LAYER * dev.matmul_overhead_s + dev.attention_overhead_s
                           + SMALL_OPS_PER_LAYER * dev.op_overhead_s)
    if not tp_measured:
        c.tp_comm += calls * 2 * allreduce_s(tp_link, s.tp, tokens / mbs * facts.hidden * dev.params_bytes)


def activation_bytes(facts: ModelFacts, s: ParallelStrategy, work: Work, dtype_bytes: int,
                     packed_attention: bool = True) -> float:
    """Peak transient bytes on the most loaded rank: activations, logits and (train) one fp32 copy
    of the rank's parameters (gradients or optimizer temporaries: measured on the CPU engine by
    tests/test_planner_memory.py; conservative where fused kernels avoid it); KV cache (generate,
    one wave). Without packed attention the [s, s] scores and probabilities of each layer are kept."""
    seqs_rank = max(work.seqs / s.dp, 1.0)
    layers_stage = math.ceil(facts.layers / s.pp)
    if work.kind == "generate":
        per_seq = (work.prompt_len + work.gen_len_max) * facts.kv_bytes_per_token(dtype_bytes) / (s.tp * s.pp)
        return seqs_rank / generation_waves(facts, s, work, seqs_rank, dtype_bytes) * per_seq
    tokens = seqs_rank * work.seq_len
    mb_tokens = tokens / _micro_batches(tokens, work)
    logits = mb_tokens * facts.vocab / s.tp * 4  # fp32 log-softmax over the vocab shard
    if work.kind != "train":
        return logits + mb_tokens * facts.hidden * dtype_bytes * 4
    in_flight = min(s.pp, _micro_batches(tokens, work))  # 1F1B: the first stage holds pp micro-batches
    per_layer = mb_tokens * facts.hidden * ACT_BYTES_PER_TOKEN_HIDDEN * dtype_bytes / 2 / s.tp
    if not packed_attention:
        length = max(work.seq_len_max, work.seq_len)
        per_layer += 2 * (mb_tokens / length) * facts.heads / s.tp * length ** 2 * dtype_bytes
    grads = facts.params / (s.tp * s.pp) * 4
    return in_flight * layers_stage * per_layer + logits + grads
