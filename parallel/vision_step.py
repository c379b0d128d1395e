"""A vision-language micro-batch through megatron's GPT: M-RoPE positions and image features.

Why around megatron's forward rather than inside it: megatron's GPT embeds token ids and
rotates by the positions it is given. Two things differ for a VL model and both are inputs:

* positions are ``[3, B, S]`` (temporal, height, width; :func:`parallel.vision.mrope_positions`
  per sequence), computed on every pipeline stage (each rotates its own layers);
* on the first stage the embeddings of the image placeholder tokens are replaced by the
  vision tower's features before the decoder sees them. The model is built with
  ``scatter_embedding_sequence_parallel=False`` so the whole sequence is here; the split
  into the tp ranks' sequence-parallel chunks happens after the replacement (its backward
  gathers the gradient, so every tp rank's tower receives the same, full gradient and the
  replicated towers stay identical without an extra all-reduce).

A pad-free micro-batch (:mod:`parallel.packed_batch`, one ``[1, T]`` row of back-to-back
sequences) is the same with the sequences as segments of the row: each segment's M-RoPE
positions start at 0, and megatron's THD rotary path slices the ``[T]`` frequencies by
``cu_seqlens`` at their offsets, i.e. applies each token its own positions.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from realflow.api.images import ImageInputs
from parallel.packing import PaddedBatch
from parallel.vision import VisionArch, image_layout, vision_features

__all__ = ["VisionStep"]


class VisionStep:
    """Builds the inputs of one micro-batch of a VL model, padded or pad-free (``module``: the unwrapped
    GPTModel)."""

    def __init__(self, module: torch.nn.Module, arch: VisionArch, sequence_parallel: bool,
                 tp_group: Any = None) -> None:
        self.module = module
        self.arch = arch
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def layout(self, pb: PaddedBatch, images: Optional[Sequence[Optional[ImageInputs]]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[3, B, S]`` M-RoPE positions (0 on padding) and ``[B, S]``: the tokens taking image features
        (``B = 1`` and ``S = T`` pad-free)."""
        B, S = pb.input_ids.shape
        out = torch.zeros((3, B, S), dtype=torch.long)
        mask = torch.zeros((B, S), dtype=torch.bool)
        ids, valid = pb.input_ids.cpu(), pb.valid.cpu()
        # (row, start, length) of each sequence: a padded row each, or the segments of a pad-free row
        # (each sequence's positions restart at 0 either way; the filler keeps 0s)
        if pb.packed is not None:
            spans, start = [], 0
            for n in pb.packed.segments:
                if bool(valid[0, start]):
                    spans.append((0, start, n))
                start += n
        else:
            spans = [(row, 0, int(valid[row].sum())) for row in range(B)]
            spans = [sp for sp in spans if sp[2] > 0]
        for i, (row, start, n) in enumerate(spans):
            img = images[i] if images is not None and i < len(images) else None
            grid = None if img is None or img.num_images == 0 else img.grid_thw
            pos, _, slots = image_layout(ids[row, start:start + n], grid, self.arch)
            out[:, row, start:start + n] = pos
            mask[row, start:start + n] = slots
        return out.to(pb.input_ids.device), mask.to(pb.input_ids.device)

    def embeddings(self, pb: PaddedBatch, images: Optional[Sequence[Optional[ImageInputs]]],
                   mask: torch.Tensor) -> torch.Tensor:
        """``[S(/tp), B, h]`` decoder input: token embeddings with the image slots (``mask``
        ``[B, S]``) replaced by features."""
        emb = self.module.embedding(input_ids=pb.input_ids, position_ids=None)  # [S, B, h], whole sequence
        given = [img for img in (images or []) if img is not None and img.num_images > 0]
        n_slots = int(mask.sum())
        if given or n_slots:
            batch = ImageInputs.concat(given)
            feats = vision_features(self.module.visual, batch.pixel_values.to(emb.device),
                                    batch.grid_thw.to(emb.device))
            if feats.shape[0] != n_slots:
                raise ValueError(f"micro-batch has {n_slots} image placeholder tokens but its "
                                 f"{batch.num_images} image(s) give {feats.shape[0]} features")
            # rows in batch-major order (sequence by sequence), as the images are
            emb = emb.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), feats.to(emb.dtype)).transpose(0, 1)
        emb = emb.contiguous()
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb, group=self.tp_group)
        return emb

    def forward(self, model: Any, pb: PaddedBatch, images: Optional[Sequence[Optional[ImageInputs]]]) -> Any:
        """``model`` (possibly DDP-wrapped) on this micro-batch; the first stage embeds."""
        pos, mask = self.layout(pb, images)
        dec = self.embeddings(pb, images, mask) if getattr(self.module, "pre_process", True) else None
        return model(pb.input_ids, pos, None, decoder_input=dec, packed_seq_params=pb.packed)
