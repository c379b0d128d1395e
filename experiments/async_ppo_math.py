"""Asynchronous GRPO on math prompts: ``python -m realflow.apps.main_async_ppo``.

Generation servers keep generating while the trainer trains: rollout
workers run the ``math`` agent (a group of ``n_samples`` answers per prompt, scored by a
rule reward), the rollout controller admits rollouts only while the staleness bound
``max_head_offpolicyness`` can hold, and after every train step the new weights reach
the servers in memory (``weight_sync=memory``: shared memory on the trainer's host, a
torch.distributed broadcast to servers on other hosts; ``disk`` writes a checkpoint instead).

Default: worked multi-step arithmetic (``dataset.task=worked_arithmetic``: answers of
16 tokens at the median and 81 at p99, the long tail that makes synchronous generation
wait), starting from that task's careless SFT checkpoint
(``fileroot/sft/worked_arithmetic_careless``: 30% of its demonstrations slip, so RL has
something to remove; trained first if absent), one CPU generation server and one CPU trainer
(``allocation="gen:d1+train:d1"``). ``dataset.task=arithmetic ppo.max_new_tokens=16``
runs the short-answer task of the synchronous default instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from experiments.ppo_math import (EVAL_REWARD_HELP, REWARD_ARGS_HELP, PPOHyperConfig, RLDataConfig, RLModelConfig,
                                  _RLBase)

from graphs.async_ppo import AsyncPPOGraphConfig
from graphs.ppo import ACTOR, REF
from realflow.api.agent import agent_registry
from realflow.api.allocation import ALLOCATION_GRAMMAR, AllocationError, parse_strategy
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.experiment import (DatasetSpec, ExperimentSetup, ModelSpec, OptimizerConfig,
                                     register_experiment)
from realflow.api.generation import GenServerLimits, check_inference_memory
from realflow.api.reward import REWARD_FUNCTIONS
from realflow.api.rollout import RolloutError, RolloutSpec


@dataclass
class AsyncRolloutConfig:
    max_head_offpolicyness: int = field(default=4, metadata={
        "help": "eta: trainer version - oldest token version <= eta for every trained rollout (0 = on-policy)"})
    weight_sync: str = field(default="memory", metadata={
        "help": "memory (shared memory to servers on the trainer's host, torch.distributed broadcast to the "
                "others) | broadcast (broadcast to every server) | disk (checkpoint)"})
    weight_sync_delta: str = field(default="auto", metadata={
        "help": "auto (memory/broadcast sync to builtin servers: after the first version, send only the 1 MiB "
                "blocks whose bytes changed, digest-checked; full when that saves nothing or a server missed a "
                "version) | off (every version whole); see docs/async.md"})
    weight_broadcast_timeout_s: float = field(default=120.0, metadata={
        "help": "a weight group forms, or a broadcast finishes, within this (else the round names the servers)"})
    interrupt_mode: str = field(default="abort", metadata={
        "help": "requests running during a weight update: abort (resubmitted with their prefix) | "
                "recompute (kept; KV cache recomputed under the new weights)"})
    n_rollout_workers: int = field(default=1, metadata={"help": "rollout worker processes (asyncio)"})
    max_concurrent_rollouts: int = field(default=64, metadata={"help": "rollouts in flight per rollout worker"})
    agent: str = field(default="math", metadata={"help": "registered agent (realflow.api.agent registry)"})
    agent_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "extra agent arguments (JSON); the math agent also gets n_samples, max_new_tokens, the ppo "
                "sampling keys (temperature, top_p, top_k, min_p, stop, stop_token_ids), reward and reward_args "
                "from the ppo/reward fields"})
    reward_timeout_s: float = field(default=10.0, metadata={"help": "per reward call, in the reward process pool"})
    reward_processes: int = field(default=1, metadata={"help": "reward process pool size per rollout worker"})
    agent_timeout_s: float = field(default=600.0, metadata={
        "help": "an agent that does not return a rollout within this fails it (logged, counted as a timeout)"})
    max_running_requests: int = field(default=128, metadata={"help": "KV-cache slots per generation server"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of a generation server's free device memory its KV cache may take, in (0, 1] "
                "(SGLang: mem_fraction_static)"})
    max_model_len: Optional[int] = field(default=None, metadata={
        "help": "prompt + new tokens of one sequence on a generation server, the length of each KV-cache slot "
                "(None = the model's context; SGLang: context_length)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "GPU: generation servers decode without CUDA graphs (on by default: captured per batch size)"})
    kv_block_size: int = field(default=16, metadata={
        "help": "tokens per KV block of a generation server's paged cache (a power of two)"})
    prefix_sharing: bool = field(default=True, metadata={
        "help": "a group's samples prefill their prompt once and share its KV blocks; prompts that start "
                "with cached blocks (an agent's earlier turns) reuse them"})
    backend: str = field(default="builtin", metadata={"help": "generation backend: builtin | sglang"})
    precision: str = field(default="auto", metadata={
        "help": "the generation servers' weights and compute: auto (the actor's precision) | fp32 | bf16; a "
                "bf16 rollout of an fp32 trainer is cheaper and off by a measurable gap (actor_train/mismatch/*; "
                "ppo.mismatch_correction corrects for it)"})
    server_limits: GenServerLimits = field(default_factory=GenServerLimits, metadata={
        "help": "what each generation server accepts (bounds -> 400/413, a full queue -> 429 + Retry-After)"})

    def __post_init__(self) -> None:
        # the model's context is checked in setup(), once its checkpoint is known
        check_inference_memory(self.gpu_memory_utilization, self.max_model_len, prefix="rollout.")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"rollout.precision={self.precision!r} must be auto, fp32 or bf16")
        b = self.kv_block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"rollout.kv_block_size={b!r} must be a power of two (tokens per KV block; 16 is usual)")


@dataclass
class _AsyncBase(_RLBase):
    _graph = "async_ppo"

    def _split_allocation(self) -> tuple[Any, str]:
        """``gen:<strategy>+<trainer allocation>`` -> (generation strategy, trainer allocation).
        ``auto`` -> (one server, ``auto``): the launcher's planner replaces both before any worker
        starts, splitting ``n_workers`` devices between the servers and the trainer."""
        alloc = self.allocation or "gen:d1+train:d1"
        if alloc == "auto":
            return parse_strategy("d1"), "auto"
        terms = [t.strip() for t in alloc.split("+")]
        gen = [t for t in terms if t.startswith("gen:")]
        rest = [t for t in terms if not t.startswith("gen:")]
        if len(gen) != 1 or len(rest) != 1:
            raise AllocationError(
                f"allocation={alloc!r}: an asynchronous run needs one 'gen:<strategy>' term for the generation "
                f"servers and one term for the trainer, e.g. 'gen:d1+train:d1' or 'gen:d4t2+train:d2p2'\n"
                + ALLOCATION_GRAMMAR)
        try:
            strategy = parse_strategy(gen[0][4:])
        except AllocationError as e:
            raise AllocationError(f"allocation={alloc!r}, generation part: {e}") from None
        if strategy.pp != 1:
            raise AllocationError(f"allocation={alloc!r}: generation servers do not pipeline (pp must be 1)")
        if strategy.tp != 1 and self.rollout.backend == "builtin":
            raise AllocationError(f"allocation={alloc!r}: the builtin generation server runs one process per "
                                  f"server (tp=1); tensor-parallel servers need rollout.backend=sglang")
        train = rest[0]
        return strategy, train[6:] if train.startswith("train:") and "," not in train else train

    def _check_gen_fits(self, tp: int, actor: str) -> None:
        cfg_path = os.path.join(actor, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                hf = json.load(f)
        else:  # the SFT start prepare() will train, if that is where the actor comes from
            hf = self.planned_actor_config() or {}
        ctx = hf.get("max_position_embeddings")
        check_inference_memory(self.rollout.gpu_memory_utilization, self.rollout.max_model_len,
                               int(ctx) if ctx else None, prefix="rollout.")
        if tp == 1 or not os.path.isfile(cfg_path):
            return
        heads = int(hf.get("num_attention_heads", 0))
        kv = int(hf.get("num_key_value_heads", heads))
        if heads % tp or kv % tp:
            raise AllocationError(f"generation tp={tp} does not divide the model's {heads} attention heads / "
                                  f"{kv} key-value heads ({cfg_path})")

    def _server_limits(self, tok: str, data_args: dict[str, Any]) -> GenServerLimits:
        """``rollout.server_limits``, with a VL actor's pixel budget set to the data set's: the servers
        process each prompt's images themselves and must cut them into as many patches as the
        trainer's copy (dataset.min_pixels / max_pixels, else the model's preprocessor_config.json)."""
        limits = self.rollout.server_limits
        if not data_args.get("image_inputs"):
            return limits
        from realflow.api.images import ImageProcessing

        budget = ImageProcessing.from_pretrained_dir(tok if os.path.isdir(tok) else None,
                                                     min_pixels=data_args.get("min_pixels") or None,
                                                     max_pixels=data_args.get("max_pixels") or None)
        return dataclasses.replace(limits, min_pixels=budget.min_pixels, max_pixels=budget.max_pixels)

    def setup(self) -> ExperimentSetup:
        actor, tok, train, test = self._paths()
        h, r = self.ppo, self.rollout
        gen, train_alloc = self._split_allocation()
        self._check_gen_fits(gen.tp, actor)
        agent_registry.get(r.agent)  # an unknown agent fails here, naming the close ones
        REWARD_FUNCTIONS.get(self.reward)
        train_workers = self.n_workers if train_alloc == "auto" else self.n_train_workers(train_alloc)
        if h.estimator == "gae":
            raise ValueError("ppo.estimator=gae needs a critic, and an asynchronous run trains none "
                             "(use an outcome estimator: grpo | rloo | reinforce++)")
        lora = self.model.lora
        planned = self.planned_actor_config()
        gcfg = AsyncPPOGraphConfig(
            batch_size=self.batch_size, use_ref=h.kl_coef > 0, ref_from_actor_base=lora.enabled,
            routing_replay=self.routing_replay(actor, planned), images=self.actor_sees_images(),
            inf_mb=MicroBatchSpec(max_tokens_per_mb=self.max_tokens_per_mb),
            train_mb=MicroBatchSpec(max_tokens_per_mb=self.max_tokens_per_mb),
            actor_args={**h.actor_args(), "seed": self.seed})
        mfcs = graph_registry.get("async_ppo")(gcfg)
        self._check_generator_len(actor, planned)
        models = {ACTOR: ModelSpec(role=ACTOR, path=actor, tokenizer_path=tok, optimizer=self.actor_optimizer,
                                   expected_config=planned, lora=lora, training=self.training, moe=self.moe,
                                   freeze_vision=self.model.freeze_vision)}
        if gcfg.use_ref and not lora.enabled:
            models[REF] = ModelSpec(role=REF, path=actor, tokenizer_path=tok, expected_config=planned)
        data_args = self.data_args()
        agent_args = dict(r.agent_args)
        if r.agent == "math":
            agent_args = {"n_samples": h.n_samples, "max_new_tokens": h.max_new_tokens,
                          **h.sampling_args(), "reward": self.reward,
                          "reward_args": dict(self.reward_args), **agent_args}
        try:
            spec = RolloutSpec(
                model_path=actor, tokenizer_path=tok, dataset_path=train, dataset_format=self.dataset.format,
                dataset_args=data_args, n_servers=gen.dp, server_tp=gen.tp, backend=r.backend,
                lora=_served_lora(models[ACTOR]),
                max_running_requests=r.max_running_requests, n_rollout_workers=r.n_rollout_workers,
                gpu_memory_utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len, precision=r.precision,
                enforce_eager=r.enforce_eager, kv_block_size=r.kv_block_size, prefix_sharing=r.prefix_sharing,
                max_concurrent_rollouts=r.max_concurrent_rollouts, agent=r.agent, agent_args=agent_args,
                max_head_offpolicyness=r.max_head_offpolicyness, train_batch_size=self.batch_size,
                weight_sync=r.weight_sync, weight_broadcast_timeout_s=r.weight_broadcast_timeout_s,
                weight_sync_delta=r.weight_sync_delta,
                interrupt_mode=r.interrupt_mode, reward_timeout_s=r.reward_timeout_s,
                agent_timeout_s=r.agent_timeout_s,
                reward_processes=r.reward_processes, server_limits=self._server_limits(tok, data_args),
                seed=self.seed,
                dynamic_sampling=h.dynamic_sampling)
        except RolloutError as e:
            raise RolloutError(f"rollout.{e}") from None
        return ExperimentSetup(
            experiment_name=self.experiment_name or self._name, trial_name=self.trial_name, mfcs=mfcs,
            models=models, dataset=DatasetSpec(format=self.dataset.format, path=train, args=data_args),
            n_workers=train_workers, allocation=train_alloc, run_dir=self.run_dir(self._name),
            total_train_epochs=self.total_train_epochs, max_train_steps=self.max_train_steps,
            save_freq_steps=self.save_freq_steps,
            eval=self._eval_spec(test, data_args),
            **self.runtime_fields(), rollout=spec)

    @staticmethod
    def n_train_workers(train_alloc: str) -> int:
        """Workers of the trainer part: the d*t*p of its strategy (or the highest explicit worker + 1)."""
        entries = [e.split(":", 1)[-1] for e in train_alloc.strip("{}").split(",")]
        sizes = []
        for e in entries:
            strat, _, workers = e.partition("@")
            if not workers:
                sizes.append(parse_strategy(strat).world_size)
        if not sizes:
            raise AllocationError(f"trainer allocation {train_alloc!r} needs an entry without '@'")
        return max(sizes)


def _served_lora(actor: ModelSpec) -> Optional[dict[str, Any]]:
    """What generation servers need of a LoRA actor (r, alpha, targets; a starting adapter's own)."""
    from parallel.lora_checks import resolved_lora

    lora = resolved_lora(actor)
    return None if lora is None else lora.as_dict()


@register_experiment("async-grpo-math")
@dataclass
class AsyncGRPOMathConfig(_AsyncBase):
    """Asynchronous GRPO on math prompts (see experiments.async_ppo_math)."""

    model: RLModelConfig = field(default_factory=RLModelConfig)
    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="worked_arithmetic"))
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=8,
                                                                       max_new_tokens=96))
    rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=2e-5, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))
    reward: str = field(default="arithmetic", metadata={"help": "reward function (reward registry)"})
    reward_args: dict[str, Any] = field(default_factory=dict, metadata={"help": REWARD_ARGS_HELP})
    eval_reward: str = field(default="", metadata={"help": EVAL_REWARD_HELP})
    batch_size: int = field(default=32, metadata={"help": "rollouts (prompts, each a group) per train step"})
    max_tokens_per_mb: int = field(default=8192, metadata={"help": "micro-batch token budget per worker"})
    total_train_epochs: int = field(default=1, metadata={"help": "(unused: the data is a stream)"})
    max_train_steps: Optional[int] = field(default=100, metadata={
        "help": "train steps (100: from the careless worked_arithmetic start the training reward rises from ~0.57 "
                "and levels off near 0.82 by step ~50; held-out pass@1 0.54-0.56 -> 0.84-0.85, seeds 1-3; 200 steps "
                "added +0.01 for twice the time)"})
    save_freq_steps: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    eval_freq_steps: int = field(default=0, metadata={"help": "evaluate every N steps (0 = before and after)"})
    eval_n_samples: int = field(default=8, metadata={
        "help": "held-out samples per prompt at the training temperature for sampled_accuracy (pass@1)"})

    _name = "async-grpo-math"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout.max_head_offpolicyness < 0:
            raise ValueError(f"rollout.max_head_offpolicyness={self.rollout.max_head_offpolicyness} "
                             "must be >= 0 (0 = on-policy)")
