"""One sequence of the generation engine, and what a step's rows need beyond greedy decoding."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from parallel.generation.routing import RoutingBuffer
from parallel.generation.vision import SeqImages
from realflow.api.generation import GenerationResult, SamplingParams

__all__ = ["Seq", "RowFlags"]


class Seq:
    """A request's sample: its tokens so far, what it reports, and where its keys and values are.

    ``blocks``: its block table (:mod:`parallel.generation.blocks`), covering its first
    ``computed`` tokens (plus room for the next); ``digests``: the prefix-cache digests of its
    full blocks, in order; ``cow``: its last block may be read by other sequences (a group's
    shared prompt), so its first write must copy it first.
    """

    __slots__ = ("rid", "request_rid", "index", "prompt", "out", "logprobs", "versions", "params",
                 "seed", "stop_ids", "stop_window", "samples", "truncates", "routed", "images",
                 "blocks", "computed", "digests", "cow")

    def __init__(self, rid: str, request_rid: str, index: int, prompt: list[int],
                 params: SamplingParams, seed: int, stop_ids: frozenset[int]) -> None:
        self.rid, self.request_rid, self.index = rid, request_rid, index
        self.prompt = prompt
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.params = params
        self.seed = seed  # draw t of its sampling stream: parallel.generation.sampler.counter_uniform(seed, t)
        self.stop_ids = stop_ids
        # tokens to decode when looking for a stop string (a token is >= 1 byte, a char <= 4)
        self.stop_window = 4 * max((len(s) for s in params.stop), default=0) + 8
        self.samples = not params.greedy
        self.truncates = self.samples and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0)
        self.routed: Optional[RoutingBuffer] = None  # MoE routing record (parallel.generation.routing)
        self.images: Optional[SeqImages] = None  # VL models: the prompt's images and M-RoPE positions
        self.blocks: list[int] = []
        self.computed = 0
        self.digests: list[bytes] = []
        self.cow = False

    def tokens(self) -> list[int]:
        """Prompt and output so far (what a (re-)prefill runs)."""
        return self.prompt + self.out if self.out else self.prompt

    def token(self, t: int) -> int:
        """The token at position ``t``."""
        n = len(self.prompt)
        return self.prompt[t] if t < n else self.out[t - n]

    def result(self, reason: dict[str, Any]) -> GenerationResult:
        routed = None if self.routed is None or self.routed.n == 0 else self.routed.array()  # 0: never ran
        return GenerationResult(self.rid, self.prompt, self.out, self.logprobs, self.versions,
                                reason, self.request_rid, self.index, routed)


@dataclass
class RowFlags:
    """What rows of a step need beyond greedy decoding (cached until the running set changes).

    When rows leave or join, the new set's flags are derived from the cached ones
    (:meth:`without`, :meth:`then`) at C speed, without a Python pass over the rows: a
    decode step at a few hundred rows otherwise spends ~0.5 ms rebuilding them, and
    rows finish at almost every step of an RL rollout. The booleans of a derived
    set may be True where no row needs them any more: each only turns on a slower,
    equally exact path (a temperature division by 1, warpers no row has, a stop-id
    test no row matches), so they are kept rather than recomputed.
    """

    sampled: list[int]  # rows (relative) that sample rather than take the argmax
    rows: Optional[torch.Tensor]  # the same as a tensor, None when all or none sample
    truncate: bool  # some sampled row has top-k / top-p / min-p
    tempered: bool  # some sampled row's temperature is not 1
    lp_sampling: bool  # some row wants logprob_mode="sampling"
    stop_ids: bool  # some row has stop token ids
    stop_strings: list[int]  # rows with stop strings
    # the rows' output lists, for appending a step's tokens, logprobs and versions with map()
    # (a C loop) rather than a Python loop over the rows
    outs: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]

    def without(self, n_new: int, holes: list[int], movers: list[int]) -> Optional["RowFlags"]:
        """The flags after rows leave: rows ``0..n_new-1`` stay, ``movers[i]`` moves into
        ``holes[i]``. None (recompute) when only some rows sample or some have stop strings."""
        n = len(self.outs)
        if (self.sampled and len(self.sampled) != n) or self.stop_strings:
            return None
        lists = []
        for old in (self.outs, self.logprobs, self.versions):
            new = old[:n_new]
            for h, m in zip(holes, movers):
                new[h] = old[m]
            lists.append(new)
        sampled = list(range(n_new)) if self.sampled else []
        return RowFlags(sampled, None, self.truncate, self.tempered, self.lp_sampling, self.stop_ids, [], *lists)

    def then(self, tail: "RowFlags", offset: int, device: torch.device) -> "RowFlags":
        """The flags of these rows followed by ``tail``'s (rows from ``offset`` on)."""
        n = offset + len(tail.outs)
        sampled = self.sampled + [offset + i for i in tail.sampled]
        rows = torch.tensor(sampled, device=device) if sampled and len(sampled) < n else None
        return RowFlags(sampled, rows, self.truncate or tail.truncate, self.tempered or tail.tempered,
                        self.lp_sampling or tail.lp_sampling, self.stop_ids or tail.stop_ids,
                        self.stop_strings + [offset + i for i in tail.stop_strings],
                        self.outs + tail.outs, self.logprobs + tail.logprobs, self.versions + tail.versions)
