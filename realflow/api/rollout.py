"""The contract between the rollout side (asynchronous PPO) and the trainer.

The rollout side (``realflow/rollout``: gen servers, the rollout controller,
rollout workers running agents) and the trainer (``realflow/system``: master and
model workers) are separate systems that share only what is written here:

* :class:`RolloutSpec`: everything the rollout side needs to run (servers,
  agent, staleness bound, weight sync), part of an :class:`ExperimentSetup`;
* :class:`Trajectory` and :func:`rollout_to_batch`: what an agent returns and the
  one-sample :class:`SequenceBatch` it becomes on the wire, with the keys the PPO
  graph reads and the weight version of every generated token;
* the metadata keys the trainer reads to bound staleness exactly.

Token alignment follows :mod:`mfc.rl_batch`: per-token keys are aligned with
``packed_input_ids`` and entry ``t`` belongs to the action of predicting token
``t + 1`` (so the behaviour log-prob of generated token ``j`` sits at ``j - 1``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.generation import GenServerLimits, check_inference_memory
from realflow.api.images import IMAGE_GRID, IMAGE_PIXELS, ImageInputs
from realflow.api.keys import INPUT_IDS, LOGPROBS, NO_EOS, PROMPT_MASK, REWARDS, ROUTED_EXPERTS, VERSIONS
from realflow.api.routing import routed_experts_tensor

__all__ = ["RolloutSpec", "Trajectory", "rollout_to_batch", "TRAJECTORY_KEYS", "OPTIONAL_TRAJECTORY_KEYS", "VERSION_ADMIT",
           "VERSION_OLDEST", "VERSION_NEWEST", "WEIGHT_SYNC_MODES", "INTERRUPT_MODES", "RolloutError",
           "LORA_ADAPTER_NAME"]

#: tensor keys of every trajectory sample (the async graph's source keys)
TRAJECTORY_KEYS = (INPUT_IDS, PROMPT_MASK, LOGPROBS, NO_EOS, REWARDS, VERSIONS)
#: tensor keys of the trajectories of some models only: an MoE policy's routed experts (R3), a VL
#: policy's prompt images (one sequence per sample, shared by its group: realflow.api.images)
OPTIONAL_TRAJECTORY_KEYS = (ROUTED_EXPERTS, IMAGE_PIXELS, IMAGE_GRID)
#: metadata: the weight version when the rollout was admitted, and of its oldest / newest token
VERSION_ADMIT, VERSION_OLDEST, VERSION_NEWEST = "version_admit", "version_oldest", "version_newest"
WEIGHT_SYNC_MODES = ("memory", "broadcast", "disk")
WEIGHT_SYNC_DELTA_MODES = ("auto", "off")
INTERRUPT_MODES = ("abort", "recompute")


class RolloutError(ValueError):
    """A bad rollout configuration or trajectory; the message names the field or the agent."""


#: the name a LoRA policy's adapter is served under by servers that keep adapters apart (SGLang)
LORA_ADAPTER_NAME = "policy"


@dataclass
class RolloutSpec:
    """What the rollout side of an asynchronous run needs (built by the experiment config).

    ``train_batch_size`` counts rollouts (one agent episode on one data row, i.e. one
    sample of the trainer's batch, holding the episode's group of trajectories).
    """

    model_path: str
    tokenizer_path: str
    dataset_path: str
    dataset_format: str = "prompt_answer"
    dataset_args: dict[str, Any] = field(default_factory=dict)
    n_servers: int = 1
    server_tp: int = 1
    backend: str = "builtin"
    backend_imports: list[str] = field(default_factory=list)  # beside the built-in generation plugins (realflow.plugins)
    max_running_requests: int = 64
    gpu_memory_utilization: float = 0.9  # per server: see realflow.api.generation.check_inference_memory
    max_model_len: Optional[int] = None  # per server: prompt + new tokens per sequence (None = the model's context)
    enforce_eager: bool = False  # per server, GPU: decode without CUDA graphs
    kv_block_size: int = 16  # per server: tokens per KV block
    prefix_sharing: bool = True  # per server: a group's samples prefill their prompt once
    precision: str = "auto"  # the servers' weights: auto (the served model's precision) | fp32 | bf16
    n_rollout_workers: int = 1
    max_concurrent_rollouts: int = 32  # per rollout worker
    agent: str = "math"
    agent_args: dict[str, Any] = field(default_factory=dict)
    agent_imports: list[str] = field(default_factory=list)
    max_head_offpolicyness: int = 4
    train_batch_size: int = 16
    weight_sync: str = "memory"
    interrupt_mode: str = "abort"
    reward_timeout_s: float = 10.0
    agent_timeout_s: float = 600.0  # one rollout (agent.run on a row), else failed and counted
    reward_processes: int = 1
    request_timeout_s: float = 600.0
    health_interval_s: float = 1.0
    weight_broadcast_timeout_s: float = 120.0
    weight_sync_delta: str = "auto"  # auto | off: see delta_sync_on
    lora: Optional[dict[str, Any]] = None  # the actor trains LoRA: updates carry its adapters (BackendConfig.lora)
    server_limits: GenServerLimits = field(default_factory=GenServerLimits)
    seed: int = 1
    dynamic_sampling: bool = False  # groups whose rewards are all equal are dropped at the rollout side

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> RolloutError:
            return RolloutError(f"{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_head_offpolicyness, int) or self.max_head_offpolicyness < 0:
            raise bad("max_head_offpolicyness", "must be an integer >= 0 (0 = on-policy)")
        for name in ("n_servers", "server_tp", "n_rollout_workers", "max_concurrent_rollouts",
                     "train_batch_size", "max_running_requests", "reward_processes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "must be an integer >= 1")
        try:
            check_inference_memory(self.gpu_memory_utilization, self.max_model_len)
        except ValueError as e:
            raise RolloutError(str(e)) from None
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise bad("weight_sync", f"expected one of {WEIGHT_SYNC_MODES}")
        if self.weight_sync_delta not in WEIGHT_SYNC_DELTA_MODES:
            raise bad("weight_sync_delta", f"expected one of {WEIGHT_SYNC_DELTA_MODES}")
        if self.lora is not None and self.backend == "sglang" and self.weight_sync != "disk":
            raise bad("weight_sync", "a LoRA policy on SGLang servers needs weight_sync=disk (SGLang loads "
                                     "adapters from a directory with /load_lora_adapter)")
        if self.interrupt_mode not in INTERRUPT_MODES:
            raise bad("interrupt_mode", f"expected one of {INTERRUPT_MODES}")
        for name in ("reward_timeout_s", "agent_timeout_s", "request_timeout_s", "health_interval_s",
                     "weight_broadcast_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0 seconds")
        try:
            self.server_limits.validate()
        except ValueError as e:
            raise RolloutError(f"server_limits.{e}") from None

    def delta_sync_on(self) -> bool:
        """``weight_sync_delta=auto``: versions after the first go as deltas (the bytes that changed,
        with digests) for shared-memory and broadcast sync to the builtin backend's servers -- the
        writer sends a full update instead whenever the delta would not save bytes (over 90% of
        the model changed), a receiver is not at the delta's base, or the model's tensors changed.
        Off for disk sync (a checkpoint is whole) and for other backends (SGLang does not know
        the manifest), and with LoRA, whose updates are the adapters already."""
        return (self.weight_sync_delta == "auto" and self.weight_sync in ("memory", "broadcast")
                and self.backend == "builtin" and self.lora is None)  # LoRA: the adapters are the delta

    def admission_limit(self, version: int) -> int:
        """Rollouts that may have been admitted in total while the weights are at ``version``.

        The trainer consumes ``train_batch_size`` rollouts per step and step ``k`` trains
        weights of version ``k``; a rollout admitted at ``version`` must be trained by step
        ``version + eta``, so at most ``(version + eta + 1) * B`` rollouts may exist by then.
        """
        return (version + self.max_head_offpolicyness + 1) * self.train_batch_size


@dataclass
class Trajectory:
    """One token sequence of an episode and its reward.

    ``input_ids`` is the whole sequence (prompt, generated tokens and, for multi-turn
    agents, environment tokens in between); ``generated[j]`` says whether token ``j``
    was produced by the policy, in which case ``logprobs[j]`` is its behaviour
    log-prob and ``versions[j]`` the weight version that produced it.

    ``routed_experts`` (MoE policies, routing replay): expert ids ``[len(input_ids) - 1, layers,
    topk]`` as the generator returned them for the whole sequence (a multi-turn trajectory takes
    its last completion's, which covers every earlier token), or ``[len(input_ids), ...]``.

    ``images`` (vision-language policies): the :class:`realflow.api.images.ImageInputs` of the
    images in ``input_ids``, in order (their placeholders expanded in ``input_ids``); every
    trajectory of a rollout shows the same images. They become the sample's ``pixel_values`` /
    ``image_grid_thw`` (:func:`rollout_to_batch`).
    """

    input_ids: list[int]
    generated: list[bool]
    logprobs: list[float]
    versions: list[int]
    reward: float
    truncated: bool = False  # ended by the length limit, not by EOS / a stop
    info: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None  # numpy [len(input_ids) - 1, layers, topk] (see the class docstring)
    images: Any = None  # ImageInputs of the images in input_ids (see the class docstring)

    @classmethod
    def single_turn(cls, prompt_ids: Sequence[int], output_ids: Sequence[int], logprobs: Sequence[float],
                    versions: Sequence[int], reward: float, truncated: bool = False,
                    routed_experts: Any = None, images: Any = None) -> "Trajectory":
        n_p, n_o = len(prompt_ids), len(output_ids)
        return cls(list(prompt_ids) + list(output_ids), [False] * n_p + [True] * n_o,
                   [0.0] * n_p + list(logprobs), [-1] * n_p + list(versions), float(reward), truncated,
                   routed_experts=routed_experts, images=images)

    def check(self, where: str) -> None:
        n = len(self.input_ids)
        for name in ("generated", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise RolloutError(f"{where}: trajectory.{name} has {len(getattr(self, name))} entries "
                                   f"for {n} tokens")
        if not any(self.generated):
            raise RolloutError(f"{where}: trajectory has no generated token (nothing to train on)")
        if self.generated[0]:
            raise RolloutError(f"{where}: trajectory starts with a generated token (it needs a prompt)")
        if any(v < 0 for v, g in zip(self.versions, self.generated) if g):
            raise RolloutError(f"{where}: a generated token has no weight version")
        r = self.routed_experts
        if r is not None and (getattr(r, "ndim", 0) != 3 or r.shape[0] not in (n - 1, n)):
            raise RolloutError(f"{where}: trajectory.routed_experts has shape {list(getattr(r, 'shape', []))} "
                               f"for {n} tokens (expected [{n - 1}, layers, topk])")


def rollout_to_batch(sample_id: str, trajectories: Sequence[Trajectory], version_admit: int,
                     answer: Optional[str] = None, images: Optional[ImageInputs] = None) -> SequenceBatch:
    """One episode's trajectories as a one-sample batch (a group of sequences). ``images``: the
    prompt's images (a VL data set's sample), one ``pixel_values`` / ``image_grid_thw`` sequence
    shared by every trajectory of the group."""
    if not trajectories:
        raise RolloutError(f"rollout {sample_id}: the agent returned no trajectory")
    ids, pmask, lps, no_eos, rewards, vers, routed = [], [], [], [], [], [], []
    oldest, newest = None, None
    with_routing = sum(t.routed_experts is not None for t in trajectories)
    if with_routing not in (0, len(trajectories)):
        raise RolloutError(f"rollout {sample_id}: {with_routing} of {len(trajectories)} trajectories carry "
                           f"routed experts (an MoE policy's trajectories all do)")
    for j, t in enumerate(trajectories):
        t.check(f"rollout {sample_id}, trajectory {j}")
        if with_routing:
            routed.append(routed_experts_tensor(t.routed_experts, len(t.input_ids)))
        n = len(t.input_ids)
        ids.append(torch.tensor(t.input_ids, dtype=torch.long))
        pmask.append(torch.tensor([not g for g in t.generated], dtype=torch.bool))
        lp = torch.zeros(n, dtype=torch.float32)
        ver = torch.full((n,), -1, dtype=torch.int32)
        gen = torch.tensor(t.generated, dtype=torch.bool)
        lp[:-1] = torch.tensor(t.logprobs[1:], dtype=torch.float32) * gen[1:]
        ver[:-1] = torch.where(gen[1:], torch.tensor(t.versions[1:], dtype=torch.int32), ver[:-1])
        lps.append(lp)
        vers.append(ver)
        no_eos.append(torch.tensor([float(t.truncated)]))
        rewards.append(torch.tensor([float(t.reward)]))
        gv = [v for v, g in zip(t.versions, t.generated) if g]
        oldest = min(gv) if oldest is None else min(oldest, min(gv))
        newest = max(gv) if newest is None else max(newest, max(gv))
    if oldest is not None and oldest < version_admit:
        raise RolloutError(f"rollout {sample_id}: a token of version {oldest} predates its admission at "
                           f"version {version_admit}")
    meta: dict[str, list[Any]] = {VERSION_ADMIT: [int(version_admit)], VERSION_OLDEST: [int(oldest)],
                                  VERSION_NEWEST: [int(newest)]}
    if answer is not None:
        meta["answer"] = [str(answer)]
    data = {INPUT_IDS: [ids], PROMPT_MASK: [pmask], LOGPROBS: [lps], NO_EOS: [no_eos], REWARDS: [rewards],
            VERSIONS: [vers]}
    if with_routing:
        data[ROUTED_EXPERTS] = [routed]
    if images is None:  # an agent's own images (e.g. through the proxy), when the data set gave none
        images = _rollout_images(sample_id, trajectories)
    if images is not None:
        data[IMAGE_PIXELS] = [images.pixel_values.to(torch.float32)]
        data[IMAGE_GRID] = [images.grid_thw.to(torch.int64)]
    return SequenceBatch.from_samples([sample_id], data, metadata=meta)


def _rollout_images(sample_id: str, trajectories: Sequence[Trajectory]) -> Any:
    """The images every trajectory of a rollout shows (one sequence per sample), or None."""
    with_images = [t.images for t in trajectories if t.images is not None and t.images.num_images]
    if not with_images:
        return None
    first = with_images[0]
    if len(with_images) != len(trajectories) or any(
            not torch.equal(im.grid_thw, first.grid_thw) for im in with_images[1:]):
        raise RolloutError(f"rollout {sample_id}: {len(with_images)} of {len(trajectories)} trajectories carry "
                           f"images, not all the same (a rollout's trajectories share its prompt's images)")
    return first
