"""What an agent session recorded, and how it becomes training samples.

An agent that talks to the policy through the OpenAI-compatible proxy
(:mod:`realflow.rollout.openai_proxy`) runs as one *session*: every completion the
proxy serves in it is recorded here with the exact prompt and output token ids,
the behaviour log-prob and weight version of every generated token, and (when the
proxy could prove it) the earlier completion whose prompt + output is the start of
this one's prompt (``parent``). Text never goes back through the tokenizer on its way
to the trainer: training uses these token ids.

Two ways to turn a session into trajectories (``ExportConfig.mode``):

* ``completion``: one trajectory per completion (its prompt, then its output). The
  session's returned reward goes to the last completion; rewards set per completion
  through the proxy are added to theirs; then returns are propagated backwards over
  the turns, ``R_k = r_k + turn_discount * R_{k+1}``, so earlier turns share the credit.
* ``conversation``: one trajectory per conversation: the longest chains of
  completions that extend each other. Every completion's tokens are marked generated
  at their exact positions; what the environment added between turns (user
  feedback, tool results, the chat template's markup) is in the sequence but masked
  from the loss. Its reward is the session's reward plus the per-completion rewards
  along the chain.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from realflow.api.rollout import RolloutError, Trajectory

__all__ = ["RecordedCompletion", "ExportConfig", "EXPORT_MODES", "session_trajectories"]

EXPORT_MODES = ("completion", "conversation")


@dataclass
class RecordedCompletion:
    """One completion served in a session (one choice of one request)."""

    id: str  # the response id the agent saw (chatcmpl-... / cmpl-...)
    choice: int  # its index among the response's choices
    order: int  # creation order in the session
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop | length | abort | tool_calls
    parent: Optional[int] = None  # order of the completion this prompt extends exactly
    reward: Optional[float] = None  # set by the agent through the proxy
    info: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None  # MoE policy: [prompt + output - 1, layers, topk] (realflow.api.routing)
    images: Any = None  # VL policy: ImageInputs of the images in prompt_ids (realflow.api.images)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class ExportConfig:
    """How sessions become samples (``rollout.agent_args.export`` / ``turn_discount``)."""

    mode: str = "completion"
    turn_discount: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in EXPORT_MODES:
            raise ValueError(f"export={self.mode!r}: expected one of {EXPORT_MODES}")
        if not 0.0 <= float(self.turn_discount) <= 1.0:
            raise ValueError(f"turn_discount={self.turn_discount!r}: must be in [0, 1]")


def _completion_mode(recs: Sequence[RecordedCompletion], reward: Optional[float], gamma: float) -> list[Trajectory]:
    own = [float(r.reward or 0.0) for r in recs]
    if reward is not None:
        own[-1] += float(reward)
    ret, out = 0.0, []
    for k in range(len(recs) - 1, -1, -1):
        ret = own[k] + gamma * ret
        out.append(ret)
    out.reverse()
    trajs = []
    for r, R in zip(recs, out):
        t = Trajectory.single_turn(r.prompt_ids, r.output_ids, r.logprobs, r.versions, R, truncated=r.truncated,
                                   routed_experts=r.routed_experts, images=r.images)
        t.info = {"completion": r.id, "choice": r.choice, "turn": r.order}
        trajs.append(t)
    return trajs


def _conversation_mode(recs: Sequence[RecordedCompletion], by_order: dict[int, RecordedCompletion],
                       reward: Optional[float]) -> list[Trajectory]:
    parents = {r.parent for r in recs if r.parent is not None}
    trajs = []
    for leaf in recs:
        if leaf.order in parents:
            continue
        chain = [leaf]
        while chain[-1].parent is not None:
            chain.append(by_order[chain[-1].parent])
        chain.reverse()
        ids = list(leaf.prompt_ids) + list(leaf.output_ids)
        gen, lps, vers = [False] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        for c in chain:
            if not c.output_ids:
                continue
            start = len(c.prompt_ids)
            if ids[start:start + len(c.output_ids)] != list(c.output_ids):
                raise RolloutError(f"completion {c.id}: its tokens are not where its successor's prompt has them")
            for j in range(len(c.output_ids)):
                gen[start + j], lps[start + j], vers[start + j] = True, float(c.logprobs[j]), int(c.versions[j])
        total = (0.0 if reward is None else float(reward)) + sum(float(c.reward or 0.0) for c in chain)
        # the leaf's prompt is the whole conversation before its output: its routing covers every token
        t = Trajectory(ids, gen, lps, vers, total, truncated=leaf.truncated,
                       info={"completions": [c.id for c in chain], "turns": len(chain)},
                       routed_experts=leaf.routed_experts, images=leaf.images)
        trajs.append(t)
    return trajs


def session_trajectories(recs: Sequence[RecordedCompletion], reward: Optional[float],
                         cfg: ExportConfig) -> list[Trajectory]:
    """The trajectories of one session (none if it made no completion with output)."""
    everything = {r.order: r for r in recs}
    recs = sorted((r for r in recs if r.output_ids), key=lambda r: r.order)
    if not recs:
        return []
    if cfg.mode == "completion":
        return _completion_mode(recs, reward, float(cfg.turn_discount))
    return _conversation_mode(recs, everything, reward)
