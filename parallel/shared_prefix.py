"""A group's shared prompt computed once: pad-free rows with the common prefix of a run of sequences.

GRPO and its relatives train on groups of n samples of ONE prompt; agents' sessions share their
system text, tools and earlier turns. Run one by one, every sample recomputes that prefix in the
forward and the backward (up to ~45% of a step's tokens at n = 8 on the default task). Here a run
of consecutive sequences of a micro-batch whose first ``p`` tokens are identical becomes ONE
segment of the pad-free row (:mod:`parallel.packed_batch`)::

    [ P (p tokens) | R_1 | R_2 | ... | R_n ]        R_i = sequence i without its first p tokens

* positions: P takes 0..p-1 and every R_i p.. (each sample's own positions; the rotary
  frequencies are looked up per token, :class:`parallel.rotary.PositionedRotaryEmbedding`);
* attention (:class:`parallel.attention.SDPACoreAttention`): P is causal within itself, R_i sees
  all of P and causally itself -- never another sample (``PackedSeqs.trees``);
* outputs: the last stage maps the row back to the micro-batch's own token order
  (:attr:`SharedRows.expand`: sample i's token k reads P's row k for k < p, else R_i's), so the
  losses, targets and masks are those of the unshared batch. That gather's backward sums the
  gradients of P's rows over the samples that read them: the same loss and gradients as
  computing the prefix n times, up to float rounding.

Any identical token prefix can be shared (causal attention makes the prefix's hidden states
depend on the prefix alone), so no prompt lengths are needed: the common prefix is found by
comparing tokens. It is shared from :data:`MIN_SHARED_PREFIX` tokens on (shorter saves less than
the extra attention call costs). A group cut by a micro-batch
boundary computes its prefix once per micro-batch it spans; data-parallel ranks each share
within their own sequences (a group split over ranks duplicates its prefix on each: the split
itself is the caller's).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from realflow.api.model_options import SHARED_PREFIX_MODES

__all__ = ["MIN_SHARED_PREFIX", "SHARED_PREFIX_MODES", "SharedPlan", "plan_shared", "shared_row", "tree_mask",
           "resolve_shared_prefix"]

#: the shortest common prefix shared (tokens): below it the extra attention call per group and
#: layer costs about what the tokens save
MIN_SHARED_PREFIX = 4


@dataclass(frozen=True)
class SharedPlan:
    """A micro-batch's segments: ``groups[j] = (first, last_exclusive, p)`` runs of its sequences,
    ``p`` = 0 for a sequence on its own."""

    seqlens: tuple[int, ...]
    groups: tuple[tuple[int, int, int], ...]

    @property
    def computed(self) -> int:
        """Tokens of the row (before any filler)."""
        return sum(self.seqlens) - sum((b - a - 1) * p for a, b, p in self.groups)

    @property
    def shares(self) -> bool:
        return any(p > 0 for _, _, p in self.groups)


def _neighbour_prefixes(ids: torch.Tensor, seqlens: list[int]) -> list[int]:
    """``c[k]``: the common prefix length of sequences ``k`` and ``k + 1`` (one vectorised pass over
    the tokens both have, not a comparison per pair)."""
    n = len(seqlens)
    if n < 2:
        return []
    lens = torch.tensor(seqlens, dtype=torch.long)
    offs = torch.zeros(n, dtype=torch.long)
    offs[1:] = lens.cumsum(0)[:-1]
    both = torch.minimum(lens[:-1], lens[1:])  # tokens a pair can share
    pair = torch.repeat_interleave(torch.arange(n - 1), both)
    at = torch.arange(len(pair)) - torch.repeat_interleave(both.cumsum(0) - both, both)  # index in the pair
    differ = ids[offs[pair] + at] != ids[offs[pair + 1] + at]
    first = both.clone()  # no difference: the shorter one is a prefix of the other
    if bool(differ.any()):
        first.scatter_reduce_(0, pair[differ], at[differ], reduce="amin")
    return first.tolist()


def plan_shared(input_ids: torch.Tensor, seqlens: list[int], min_prefix: int = MIN_SHARED_PREFIX) -> SharedPlan:
    """Runs of consecutive sequences and the prefix ``p`` ALL members of a run share (at least
    ``min_prefix`` tokens), each run chosen to save the most tokens, ``(members - 1) * p``: a
    GRPO group whose first two samples also agree on a response token does not lose its third
    member, and a run is not stretched over the next prompt for a common first token.

    The prefix all of ``i..j`` share is the least common prefix of neighbours in between (they
    all agree up to it, and a pair that differs there differs from ``i`` on one side)."""
    seqlens = [int(n) for n in seqlens]
    near = _neighbour_prefixes(input_ids.detach().cpu(), seqlens)
    groups: list[tuple[int, int, int]] = []
    i, n = 0, len(seqlens)
    while i < n:
        best_saving, best_end, best_p = 0, i + 1, 0
        j, p = i + 1, None
        while j < n:
            p = near[j - 1] if p is None else min(p, near[j - 1])
            if p < min_prefix:
                break
            j += 1
            if (j - i - 1) * p > best_saving:
                best_saving, best_end, best_p = (j - i - 1) * p, j, p
        groups.append((i, best_end, best_p))
        i = best_end
    return SharedPlan(tuple(seqlens), tuple(groups))


@dataclass
class SharedRows:
    """What :func:`shared_row` adds to a pad-free row: the row's segments as ``trees`` (``()``
    for a plain segment, ``(p, r_1, ..., r_n)`` for a shared one) and ``expand``: for each token of
    the micro-batch in its own order, the row position whose output it reads."""

    trees: tuple[tuple[int, ...], ...]
    expand: torch.Tensor  # [sum(seqlens)] long


def shared_row(input_ids: torch.Tensor, plan: SharedPlan
               ) -> tuple[torch.Tensor, torch.Tensor, list[int], SharedRows]:
    """``(row tokens [computed], positions [computed], segment lengths, SharedRows)``."""
    offs = [0]
    for n in plan.seqlens:
        offs.append(offs[-1] + n)
    src: list[int] = []  # the micro-batch token each row position holds
    positions: list[int] = []
    expand: list[int] = []
    segments, trees = [], []
    at = 0  # row position of the next segment
    for a, b, p in plan.groups:
        if p == 0:
            n = plan.seqlens[a]
            src.extend(range(offs[a], offs[a + 1]))
            positions.extend(range(n))
            expand.extend(range(at, at + n))
            segments.append(n)
            trees.append(())
            at += n
            continue
        src.extend(range(offs[a], offs[a] + p))
        positions.extend(range(p))
        rest, branch_at = [], at + p
        for i in range(a, b):
            r = plan.seqlens[i] - p
            src.extend(range(offs[i] + p, offs[i + 1]))
            positions.extend(range(p, p + r))
            expand.extend(range(at, at + p))
            expand.extend(range(branch_at, branch_at + r))
            rest.append(r)
            branch_at += r
        segments.append(p + sum(rest))
        trees.append((p, *rest))
        at = branch_at
    row = input_ids[torch.tensor(src, dtype=torch.long, device=input_ids.device)]
    pos = torch.tensor(positions, dtype=torch.long)
    return row, pos, segments, SharedRows(tuple(trees), torch.tensor(expand, dtype=torch.long))


@functools.lru_cache(maxsize=1024)  # every layer of a forward asks for the same masks
def tree_mask(tree: tuple[int, ...], device: Optional[torch.device] = None) -> tuple[torch.Tensor, ...]:
    """Per branch of a shared segment ``(p, r_1..r_n)``: the ``[r_i, p + r_i]`` bool mask of what
    its tokens may NOT see (megatron's convention, True = masked): nothing of P is masked, its
    own tokens causally."""
    p, *rest = tree
    masks = []
    for r in rest:
        own = torch.ones(r, r, dtype=torch.bool, device=device).triu(1)
        masks.append(torch.cat([torch.zeros(r, p, dtype=torch.bool, device=device), own], dim=1))
    return tuple(masks)


def resolve_shared_prefix(mode: str, *, pad_free: bool, module: torch.nn.Module, moe: Optional[object],
                          vision: Optional[object]) -> str:
    """``training.shared_prefix`` -> the runner's mode (``off`` where the model cannot take it).

    Needs pad-free rows, a dense text model (an MoE model's load-balancing loss counts tokens,
    which sharing changes; a VL prefix may hold different images behind the same tokens) and
    plain RoPE. ``on`` where unsupported: a one-line ValueError naming why."""
    if mode not in SHARED_PREFIX_MODES:
        raise ValueError(f"training.shared_prefix={mode!r} must be one of {', '.join(SHARED_PREFIX_MODES)}")
    if mode == "off":
        return "off"
    from parallel.rotary import use_positioned_rotary

    reason = ("training.pad_free is off or unsupported here" if not pad_free else
              "an MoE model (its load-balancing loss counts tokens)" if moe is not None else
              "a vision-language model" if vision is not None else
              "" if use_positioned_rotary(module) else "the model's position embedding is not plain RoPE")
    if reason and mode == "on":
        raise ValueError(f"training.shared_prefix=on is not supported here: {reason}; use "
                         f"training.shared_prefix=auto or off")
    return "off" if reason else mode
