"""Training FLOPs of a step, counted both ways: on the tokens that matter and on the rows computed.

``useful``: every sequence of the batch once, whole (its own prompt included) -- what the step
needs; ``computed``: the rows the layers actually ran (padding, the sp / pp filler, and a shared
prefix once instead of once per sample). Their ratio is the work realflow's pad-free rows and
shared prefixes remove. Standard dense-transformer counting, the same as the planner's
(:mod:`realflow.planner.cost`): ``2 * matmul parameters`` per token for the linear layers and
the LM head, ``4 * heads * head_dim`` per causal (query, key) pair for the attention scores and
their mix; a train step is 3x its forward (the backward costs two forwards).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["TokenFlops", "causal_pairs", "row_pairs"]


def causal_pairs(n: int) -> int:
    """(query, key) pairs of one causal sequence of ``n`` tokens."""
    return n * (n + 1) // 2


def row_pairs(segments: Sequence[int], trees: Sequence[tuple[int, ...]] = ()) -> int:
    """Pairs a pad-free row's attention computes: per segment causal, or for a shared-prefix
    segment ``(p, r_1..r_n)`` the prefix causally plus each branch over the prefix and itself."""
    total = 0
    for i, n in enumerate(segments):
        tree = trees[i] if i < len(trees) else ()
        if tree:
            p, *rest = tree
            total += causal_pairs(p) + sum(r * p + causal_pairs(r) for r in rest)
        else:
            total += causal_pairs(int(n))
    return total


@dataclass(frozen=True)
class TokenFlops:
    """Forward FLOPs per token (linear layers and LM head) and per causal attention pair."""

    per_token: float
    per_pair: float

    @classmethod
    def from_hf(cls, cfg: Any) -> "TokenFlops":
        text = getattr(cfg, "text_config", None) or cfg  # VL configs keep the LM's fields there
        hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        if getattr(text, "num_experts_per_tok", None) and getattr(text, "moe_intermediate_size", None):
            ffn = int(text.moe_intermediate_size) * int(text.num_experts_per_tok)  # the experts a token uses
        else:
            ffn = int(text.intermediate_size)
        attn = (heads + 2 * kv) * head_dim * hidden + heads * head_dim * hidden
        per_layer = attn + 3 * ffn * hidden
        return cls(per_token=2.0 * (layers * per_layer + int(text.vocab_size) * hidden),
                   per_pair=4.0 * layers * heads * head_dim)

    def train(self, tokens: float, pairs: float) -> float:
        """FLOPs of forward + backward over ``tokens`` rows and ``pairs`` attention pairs."""
        return 3.0 * (self.per_token * tokens + self.per_pair * pairs)
