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
    """What rows of a step need beyond greedy decoding (cached until the running set changes)."""

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
