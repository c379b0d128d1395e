"""Inference on :class:`parallel.engine.MegatronEngine`: forward outputs, log-probs, values,
greedy decoding and the colocated generator, over packed sequences cut into micro-batches.

Every method takes packed ``input_ids`` with their ``seqlens`` (the same on every rank of a dp
replica) and returns host tensors in the caller's order, on every rank.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel.engine_generator import colocated_generator
from parallel.outputs import TokenOutputs
from parallel.pipeline import MicroBatch, next_token_targets, split_packed
from parallel.packing import check_packed
from parallel.vision import image_layout
from realflow.api.engine import BatchGenerator
from realflow.api.padded_partition import padded_partition
from realflow.base.devices import to_host

__all__ = ["EngineInferenceMixin"]


class EngineInferenceMixin:
    """Needs the engine's ``groups``, ``model``, ``module``, ``device``, ``_runner``, ``hf_config`` and
    helpers (:mod:`parallel.engine`)."""

    def _infer(self, input_ids: torch.Tensor, seqlens: list[int], max_tokens_per_mb: Optional[int],
               fn: Callable[[TokenOutputs, MicroBatch], Any], routes: Optional[torch.Tensor] = None,
               images: Optional[list[Any]] = None) -> list[Any]:
        """Forward-only schedule over contiguous micro-batches; ``fn`` per micro-batch on the
        last stage ([] elsewhere)."""
        mbs = split_packed(input_ids, seqlens, max_tokens_per_mb, routes, images)
        self.model.eval()
        return self._runner.run(self.model, mbs,
                                lambda mb, valid, out: fn(self._token_outputs(valid, out), mb),
                                forward_only=True, device=self.device)

    @torch.no_grad()
    def _infer_tokens(self, input_ids: torch.Tensor, seqlens: list[int], max_tokens_per_mb: Optional[int],
                      fn: Callable[[TokenOutputs, MicroBatch], Any], routes: Optional[torch.Tensor] = None,
                      images: Optional[list[Any]] = None) -> Any:
        """Forward-only, ``fn`` returning per-token tensors (or a tuple of them): the packed
        result in the input's order, on output ranks (None elsewhere).

        Under a budget, sequences of similar length share a micro-batch (each runs padded
        to its longest; see realflow.api.padded_partition), and the outputs are put back
        in the input's order; pad-free, contiguous runs of sequences fill the budget.
        """
        seqlens = [int(n) for n in seqlens]
        if self.pad_free:  # cost = real tokens: contiguous runs under the budget, no reordering
            return self._packed_result(self._infer(input_ids, seqlens, max_tokens_per_mb, fn, routes, images))
        parts = [list(range(len(seqlens)))] if max_tokens_per_mb is None or not seqlens else \
            padded_partition([[n] for n in seqlens], 1, max_tokens_per_mb)
        if len(parts) == 1:
            return self._packed_result(self._infer(input_ids, seqlens, None, fn, routes, images))
        check_packed(input_ids, seqlens)
        offs = [0]
        for n in seqlens:
            offs.append(offs[-1] + n)
        mbs = [MicroBatch(torch.cat([input_ids[offs[i]:offs[i + 1]] for i in p]), [seqlens[i] for i in p],
                          routes=None if routes is None else torch.cat([routes[offs[i]:offs[i + 1]] for i in p]),
                          images=None if images is None else [images[i] for i in p])
               for p in parts]
        self.model.eval()
        outs = self._runner.run(self.model, mbs, lambda mb, valid, out: fn(self._token_outputs(valid, out), mb),
                                forward_only=True, device=self.device)
        result = self._packed_result(outs)
        if result is None:
            return None
        where = torch.cat([torch.arange(offs[i], offs[i + 1]) for p in parts for i in p])

        def unpermute(t: torch.Tensor) -> torch.Tensor:
            back = torch.empty_like(t)
            back[where.to(t.device)] = t
            return back
        return tuple(unpermute(t) for t in result) if isinstance(result, tuple) else unpermute(result)

    def _packed_result(self, parts: list[Any]) -> Any:
        if not self.is_output_rank:
            return None
        if parts and isinstance(parts[0], tuple):
            return tuple(to_host(torch.cat(p)) for p in zip(*parts))
        return to_host(torch.cat(parts))

    # ------------------------------------------------------------------ inference

    def forward(self, input_ids: torch.Tensor, seqlens: list[int],
                max_tokens_per_mb: Optional[int] = None, *,
                routed_experts: Optional[torch.Tensor] = None,
                images: Optional[list[Any]] = None) -> Optional[torch.Tensor]:
        """Packed fp32 logits ``[sum(seqlens), vocab_size]`` (HF vocab) on output ranks.

        Gathers the full vocabulary over tp: for log-probs use :meth:`logprobs`.
        A critic returns its values ``[sum(seqlens), 1]``.  ``routed_experts``, ``images``: see
        :meth:`logprobs`.
        """
        def fn(out: TokenOutputs, mb: MicroBatch) -> torch.Tensor:
            return out.values()[:, None] if self.critic else out.logits()

        return self._infer_tokens(input_ids, seqlens, max_tokens_per_mb, fn, self._routes(routed_experts),
                                  self._images(images, seqlens, input_ids))

    def _images(self, images: Optional[list[Any]], seqlens: list[int],
                input_ids: Optional[torch.Tensor] = None) -> Optional[list[Any]]:
        """Per-sequence images of a VL model, checked against ``input_ids``' placeholders here, before
        any collective (a mismatch found inside one rank's forward would leave its peers waiting in
        the gradient all-reduce); images given to a text-only model are refused."""
        if images is None:
            return None
        if self.vision_step is None:
            if any(img is not None and img.num_images for img in images):
                raise ValueError(f"images given to a text-only model (model_type={self.arch.model_type!r}); "
                                 f"use a vision-language model such as Qwen2.5-VL")
            return None
        if len(images) != len(seqlens):
            raise ValueError(f"images: {len(images)} entries for {len(seqlens)} sequences")
        if input_ids is not None:
            off = 0
            for i, (n, img) in enumerate(zip(seqlens, images)):
                grid = None if img is None or img.num_images == 0 else img.grid_thw
                try:
                    image_layout(input_ids[off:off + int(n)].cpu(), grid, self.arch.vision)
                except ValueError as e:
                    raise ValueError(f"sequence {i}: {e}") from None
                off += int(n)
        return list(images)

    def _routes(self, routed_experts: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Replayed experts for an MoE model with replay on (else ignored: a dense model has none)."""
        if routed_experts is None or self.moe_step is None or not self.moe_step.replay:
            return None
        return routed_experts

    def logprobs(self, input_ids: torch.Tensor, seqlens: list[int],
                 max_tokens_per_mb: Optional[int] = None, *, temperature: float = 1.0,
                 with_entropy: bool = False, routed_experts: Optional[torch.Tensor] = None,
                 images: Optional[list[Any]] = None) -> Any:
        """Log-prob of each next token, packed fp32 ``[sum(seqlens)]``, on output ranks.

        ``out[t] = log p(input_ids[t + 1] | input_ids[..t])`` within each sequence; the
        last position of every sequence has no next token and holds 0.  Computed on
        the vocab shards (no full-vocab gather).  ``with_entropy=True`` returns
        ``(logprobs, entropy)``, entropy of the next-token distribution at every
        position.  Logits are divided by ``temperature`` first.  ``routed_experts`` (MoE,
        routing replay): packed ``[sum(seqlens), layers, k]`` expert ids the generator chose per
        token (``-1`` rows: the router's own choice), used instead of the router's top-k.
        ``images`` (VL models): one :class:`realflow.api.images.ImageInputs` (or None) per
        sequence, whose placeholders (already expanded) in ``input_ids`` get the tower's features.
        """
        if self.critic:
            raise TypeError("logprobs() on a critic engine (use values())")

        def fn(out: TokenOutputs, mb: MicroBatch) -> Any:
            targets, valid = next_token_targets(mb.input_ids.to(self.device), mb.seqlens)
            lp, ent = out.logprobs_and_entropy(targets, temperature) if with_entropy else \
                (out.logprobs(targets, temperature), None)
            lp = torch.where(valid, lp, torch.zeros_like(lp))
            return (lp, ent) if with_entropy else lp

        return self._infer_tokens(input_ids, seqlens, max_tokens_per_mb, fn, self._routes(routed_experts),
                                  self._images(images, seqlens, input_ids))

    def values(self, input_ids: torch.Tensor, seqlens: list[int],
               max_tokens_per_mb: Optional[int] = None, *,
               images: Optional[list[Any]] = None) -> Optional[torch.Tensor]:
        """Critic values per token, packed fp32 ``[sum(seqlens)]``, on output ranks."""
        if not self.critic:
            raise TypeError("values() on an LM engine (build it with critic=True)")
        return self._infer_tokens(input_ids, seqlens, max_tokens_per_mb, lambda out, mb: out.values(),
                                  images=self._images(images, seqlens, input_ids))

    @torch.no_grad()
    def greedy_generate(self, prompts: list[list[int]], max_new_tokens: int,
                        eos_token_id: Optional[int] = None,
                        max_tokens_per_mb: Optional[int] = None, *,
                        images: Optional[list[Any]] = None) -> list[list[int]]:
        """Greedy continuation of each prompt (batched, no KV cache), on every rank of
        the replica.  Returns the NEW tokens of each prompt, ending with
        ``eos_token_id`` when it was generated.  ``images``: one ImageInputs (or None) per prompt."""
        if self.critic:
            raise TypeError("greedy_generate() on a critic engine")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("greedy_generate: empty prompt")
        seqs = [list(map(int, p)) for p in prompts]
        images = self._images(images, [len(p) for p in prompts])
        new: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not active:
                break
            lens = [len(seqs[i]) for i in active]
            ids = torch.tensor([t for i in active for t in seqs[i]], dtype=torch.long)

            def last_argmax(out: TokenOutputs, mb: MicroBatch) -> torch.Tensor:
                ends = torch.tensor(mb.seqlens).cumsum(0) - 1
                return out.argmax()[ends]

            parts = self._infer(ids, lens, max_tokens_per_mb, last_argmax,
                                images=None if images is None else [images[i] for i in active])
            nxt = to_host(torch.cat(parts)) if parts else torch.empty(len(active), dtype=torch.long)
            if self.groups.strategy.pp > 1:  # the last stage tells the others
                src = self.groups.rank_at(dp=self.groups.dp_rank, tp=self.groups.tp_rank,
                                          pp=self.groups.strategy.pp - 1)
                dist.broadcast(nxt, src=src, group=self.groups.pp_group)
            still = []
            for i, tok in zip(active, nxt.tolist()):
                seqs[i].append(tok)
                new[i].append(tok)
                if eos_token_id is None or tok != eos_token_id:
                    still.append(i)
            active = still
        return new

    def generator(self, context: int, *, version: int, tokenizer: Any = None, max_running: int = 256,
                  gpu_memory_utilization: Optional[float] = None, max_model_len: Optional[int] = None,
                  enforce_eager: Optional[bool] = None, kv_block_size: Optional[int] = None,
                  prefix_sharing: Optional[bool] = None) -> BatchGenerator:
        """The generation engine over this engine's parameters (built once, then reused; pp = 1, LM only).

        ``context``: the longest prompt + new tokens the caller needs; a later call that needs
        more frees the old KV cache and builds a larger one. ``version``: the model's weight
        version; when it differs from the generator's, the weights moved in place since the
        last call (an optimizer step, a reallocation) and the generator refreshes what it
        derives from them. ``tokenizer`` (for stop strings) is taken when the generator is built.
        ``gpu_memory_utilization`` / ``max_model_len`` size its KV cache, ``enforce_eager``,
        ``kv_block_size`` and ``prefix_sharing`` set its engine (``ppo.*`` keys; see
        :mod:`parallel.engine_generator` for the defaults).
        """
        return colocated_generator(self, context, version=version, tokenizer=tokenizer, max_running=max_running,
                                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                   enforce_eager=enforce_eager, kv_block_size=kv_block_size,
                                   prefix_sharing=prefix_sharing)
