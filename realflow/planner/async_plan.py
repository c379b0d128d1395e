"""Asynchronous PPO on a cluster: how many devices generate, in which layout, and the trainer's plan.

Generation servers decode with continuous batching, so unlike a synchronous batch they do not
wait for the longest answer: a server keeps ``concurrency`` sequences in flight (its request
slots, or as many KV caches as its free memory holds) and produces ``concurrency / step``
tokens per second, a step priced like a synchronous decode step (:mod:`.cost`). Trainers run
the experiment's trainer graph on the remaining devices, planned by :func:`.search.search`.
In steady state (staleness >= 1) the two overlap, so a step takes the longer of generating a
batch and training on one plus the weight update that interrupts the servers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from realflow.api.allocation import ParallelStrategy
from realflow.api.experiment import ExperimentSetup
from realflow.planner.cluster import ClusterSpec
from realflow.planner.cost import ModelFacts, allreduce_s, measured_decode_compute_s, p2p_s
from realflow.planner.search import NoPlanFits, SearchResult, search, short
from realflow.planner.simulate import Workload


@dataclass
class AsyncPlan:
    gen_devices: int
    gen_tp: int
    train: SearchResult
    gen_batch_s: float  # generating one training batch on all servers
    weight_update_s: float
    step_s: float
    considered: int = 0  # splits (generation devices x server tp) that were priced

    @property
    def allocation(self) -> str:
        return f"gen:{short(ParallelStrategy(dp=self.gen_devices // self.gen_tp, tp=self.gen_tp))}+" \
               f"{{{self.train.best.allocation}}}"

    def describe(self) -> str:
        return (f"{self.allocation}: step {self.step_s:.4g} s (generate a batch {self.gen_batch_s:.4g} s on "
                f"{self.gen_devices} devices; train {self.train.best.step_s:.4g} s + weight update "
                f"{self.weight_update_s:.3g} s on {self.train_devices})")

    @property
    def train_devices(self) -> int:
        return self.train.best.plan.n_workers


def server_tokens_per_s(facts: ModelFacts, tp: int, cluster: ClusterSpec, workload: Workload,
                        max_running: int) -> float:
    """Tokens a tp-wide server decodes per second with continuous batching."""
    dev = cluster.device
    weights = facts.params * dev.params_bytes / tp
    ctx = workload.prompt_len + workload.gen_len_mean / 2
    per_seq_kv = (workload.prompt_len + workload.gen_len_max) * facts.kv_bytes_per_token(dev.params_bytes) / tp
    free = 0.9 * dev.memory_bytes - weights
    if free <= per_seq_kv:
        return 0.0
    conc = max(1, min(max_running, int(free // per_seq_kv)))
    kv = conc * ctx * facts.kv_bytes_per_token(dev.params_bytes) / tp
    flops = (facts.gemm_flops_fwd(conc) + facts.attn_flops_fwd(conc * ctx * 2)) / tp
    tp_measured = dev.measured_at(tp) and dev.tp_decode_layer_overhead_s > 0
    step = max(flops / dev.matmul_flops, (weights + kv) / dev.memory_bandwidth,
               measured_decode_compute_s(facts, dev, conc, facts.layers, tp, tp_measured))
    at = tp if tp_measured else 1
    step += facts.layers * dev.engine_value("decode_layer_overhead_s", at) \
        + dev.engine_value("decode_step_overhead_s", at) + conc * dev.engine_value("decode_seq_s", at)
    if not tp_measured:  # a measured tp step includes its collectives
        step += facts.layers * 2 * allreduce_s(cluster.device.intra_node, tp, conc * facts.hidden * dev.params_bytes)
    prefill = 2.0 * facts.params * workload.prompt_len / dev.matmul_flops / tp  # per sequence
    per_token = step / conc + prefill / workload.gen_len_mean
    return 1.0 / per_token


def _sub_cluster(cluster: ClusterSpec, n: int) -> ClusterSpec:
    per_node = min(cluster.devices_per_node, n)
    return dataclasses.replace(cluster, nodes=math.ceil(n / per_node), devices_per_node=per_node)


def plan_async(trainer_setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
               workload: Workload, actor: str = "actor", max_running: int = 128,
               seqs_per_step: Optional[int] = None, max_gen_tp: int = 8) -> AsyncPlan:
    """The fastest split found (generation devices and tp <= ``max_gen_tp``, trainer plan);
    raises NoPlanFits."""
    facts = ModelFacts.from_hf(model_cfgs[actor])
    n = cluster.n_devices
    seqs = seqs_per_step or max(m.n_seqs for m in trainer_setup.mfcs)
    best: Optional[AsyncPlan] = None
    misses = []
    considered = 0
    for g in sorted({n * share // 8 for share in range(1, 8)}):  # eighths of the cluster generate
        if g < 1 or n - g < 1:
            continue
        for tp in (1, 2, 4, 8):
            if tp > max_gen_tp or g % tp or tp > cluster.devices_per_node or facts.heads % tp or facts.kv_heads % tp:
                continue
            considered += 1
            rate = server_tokens_per_s(facts, tp, cluster, workload, max_running)
            if rate <= 0:
                misses.append(f"gen tp={tp}: weights do not leave room for a KV cache")
                continue
            gen_s = seqs * workload.gen_len_mean / (rate * (g // tp))
            try:
                train = search(dataclasses.replace(trainer_setup, n_workers=n - g), _sub_cluster(cluster, n - g),
                               model_cfgs, workload)
            except NoPlanFits as e:
                misses.append(f"{n - g} training devices: {e}")
                continue
            update = p2p_s(cluster.inter_node if cluster.nodes > 1 else cluster.device.intra_node,
                           facts.params * cluster.device.params_bytes / tp)
            step = max(gen_s, train.best.step_s + update)
            if best is None or step < best.step_s:
                best = AsyncPlan(g, tp, train, gen_s, update, step)
    if best is None:
        raise NoPlanFits("no asynchronous split fits: " + "; ".join(misses[:3]))
    best.considered = considered
    return best
