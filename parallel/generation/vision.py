"""Images in the built-in generation engine (Qwen2.5-VL / Qwen2-VL): vision tower, M-RoPE, tower weights.

Why a module of its own: a text-only engine never touches any of this (its decode loop runs
exactly as before); a vision-language engine holds an :class:`EngineVision`, which

* checks a request's images against its prompt once, when it is added (:meth:`EngineVision.prepare`:
  the placeholders must be each image's expanded ``image_token_id`` run) and keeps the prompt's
  ``[3, L]`` M-RoPE positions and its ``delta`` (:func:`parallel.vision.mrope_positions`);
* at prefill, runs the tower on the joining requests' images (one call for all of them) and
  gives the decoder the placeholder rows to overwrite with the features and per-token cos/sin
  built exactly as transformers' ``Qwen2_5_VLRotaryEmbedding`` does (channel chunks of
  ``mrope_section`` take the temporal, height and width positions in turn, both halves alike);
* at decode, nothing but a shifted position: a generated token's three positions are equal
  (``cache index + delta``), which is plain RoPE at that position.

Generated tokens are never images: a re-prefill (after a retraction or a weight update) takes
the prompt's positions and continues them ``arange + delta`` over the output so far, exactly as
``generate`` would have, even if the model emitted an image placeholder id.

The tower's parameters keep HF's ``visual.*`` names in every weight update (HF or megatron
format): :func:`split_vision` separates them from the language model's, :class:`VisionWeights`
checks and writes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from parallel.hf_io import CheckpointError, read_hf_tensors
from parallel.vision import VISION_PREFIX, VisionArch, build_vision_tower, mrope_positions, vision_features
from realflow.api.images import ImageInputs, image_token_counts

__all__ = ["SeqImages", "EngineVision", "VisionWeights", "split_vision", "load_vision_tower"]


@dataclass
class SeqImages:
    """One request's images and the M-RoPE facts of its prompt (shared by its ``n`` samples)."""

    images: Optional[ImageInputs]  # None: a text prompt of a VL model
    positions: torch.Tensor  # [3, len(prompt)] long
    delta: int  # a token at cache index i has rotary position i + delta (after the prompt)
    rows: torch.Tensor  # prompt indices of the placeholder tokens, in order (the features' rows)


def split_vision(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(language model's tensors, the tower's ``visual.*`` tensors) of a weight update."""
    text, vis = {}, {}
    for k, v in tensors.items():
        (vis if k.startswith(VISION_PREFIX) else text)[k] = v
    return text, vis


def load_vision_tower(path: str, hf_config: Any, dtype: torch.dtype,
                      device: Optional[torch.device] = None) -> torch.nn.Module:
    """The tower of an HF checkpoint directory (its ``visual.*`` tensors), in eval mode."""
    tower = build_vision_tower(hf_config, dtype=dtype)
    names = [VISION_PREFIX + n for n in tower.state_dict()]
    try:
        hf = read_hf_tensors(path, names)
    except KeyError as e:
        raise CheckpointError(f"vision tower tensor {e.args[0]} missing from checkpoint {path}") from None
    VisionWeights(tower).copy_(hf)
    return tower.to(device=device).eval() if device is not None else tower.eval()


class VisionWeights:
    """The tower's parameters by their ``visual.*`` names: checked, copied, staged, swapped, digested."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.tower = tower
        self.params = {VISION_PREFIX + n: p for n, p in tower.named_parameters()}

    def check(self, update: Mapping[str, torch.Tensor]) -> None:
        for name, t in update.items():
            p = self.params.get(name)
            if p is None:
                raise CheckpointError(f"weight update: unknown vision tower parameter {name!r}")
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"weight update: {name} has shape {list(t.shape)}, expected {list(p.shape)}")

    @torch.no_grad()
    def copy_(self, update: Mapping[str, torch.Tensor]) -> None:
        """In place (the tower may be the trainer's own module: a colocated generator shares it)."""
        self.check(update)
        for name, t in update.items():
            p = self.params[name]
            if t.data_ptr() != p.data_ptr():
                p.copy_(t)

    @torch.no_grad()
    def staged(self, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fresh tensors of the whole tower: the update's where it names them, else the current ones."""
        self.check(update)
        return {name: update.get(name, p).detach().to(device=p.device, dtype=p.dtype).clone()
                for name, p in self.params.items()}

    def swap(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Point the parameters at staged tensors (no copy)."""
        for name, p in self.params.items():
            p.data = staged[name]

    def named(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}


def _rotary_axes(section: Sequence[int], head_dim: int, device: torch.device) -> torch.Tensor:
    """The position axis (0 t, 1 h, 2 w) each of the ``head_dim`` rotary channels rotates by."""
    half = [i % 3 for i, s in enumerate(section) for _ in range(s)]
    if 2 * len(half) != head_dim:
        raise ValueError(f"mrope_section {list(section)} does not cover head_dim={head_dim}")
    return torch.tensor(half + half, dtype=torch.long, device=device)


class EngineVision:
    """What a VL engine adds to the text one (see the module docstring)."""

    def __init__(self, arch: VisionArch, tower: torch.nn.Module, head_dim: int, device: torch.device) -> None:
        self.arch = arch
        self.tower = tower  # not .eval(): it may be the trainer's module (it has no dropout)
        self.weights = VisionWeights(tower)
        self.axes = _rotary_axes(arch.mrope_section, head_dim, device)
        self._channels = torch.arange(head_dim, device=device)

    @property
    def image_token_id(self) -> int:
        return self.arch.image_token_id

    @property
    def merge_size(self) -> int:
        return self.arch.spatial_merge_size

    def prepare(self, prompt: list[int], images: Optional[ImageInputs]) -> SeqImages:
        """Check a prompt (expanded placeholders) against its images; raise ValueError on a mismatch."""
        ids = torch.tensor(prompt, dtype=torch.long)
        rows = (ids == self.arch.image_token_id).nonzero().flatten()
        if images is not None and images.num_images == 0:
            images = None
        if images is None:
            if rows.numel():
                raise ValueError(f"input_ids hold {rows.numel()} image placeholder token(s) "
                                 f"(image_token_id={self.arch.image_token_id}) but no images were given")
            return SeqImages(None, torch.arange(len(prompt))[None, :].expand(3, -1).clone(), 0, rows)
        if not isinstance(images, ImageInputs):
            raise ValueError(f"images must be ImageInputs, got {type(images).__name__}")
        grid = images.grid_thw
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"images.grid_thw must be [images, 3], got {list(grid.shape)}")
        patches = int(grid.prod(-1).sum())
        if images.pixel_values.dim() != 2 or images.pixel_values.shape[0] != patches:
            raise ValueError(f"images.pixel_values has shape {list(images.pixel_values.shape)}; the grids "
                             f"{grid.tolist()} need {patches} patch rows")
        counts = image_token_counts(grid, self.merge_size)
        if rows.numel() != sum(counts):
            raise ValueError(f"input_ids hold {rows.numel()} image placeholder token(s) (image_token_id="
                             f"{self.arch.image_token_id}) but the {len(counts)} image(s) need {sum(counts)} "
                             f"({'+'.join(map(str, counts))}): expand each image's placeholder to its tokens")
        pos, delta = mrope_positions(ids, grid, self.arch)  # ValueError on a broken placeholder run
        return SeqImages(images, pos, delta, rows)

    def prefill_inputs(self, seqs: Sequence[tuple[SeqImages, int]], P: int, cos_table: torch.Tensor,
                       sin_table: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                         Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Per-row cos/sin ``[J, P, hd]`` and the image rows ``(row, position, features)`` of a prefill.

        ``seqs``: each joining sequence's :class:`SeqImages` and its tokens beyond the prompt
        (the output so far, re-prefilled after a retraction).
        """
        dev = cos_table.device
        J = len(seqs)
        pos = torch.empty((J, 3, P), dtype=torch.long)
        for j, (si, n_out) in enumerate(seqs):
            Lp = si.positions.shape[1]
            pos[j, :, :Lp] = si.positions
            # output (and padding) continue the prompt: i + delta on every axis
            pos[j, :, Lp:] = torch.arange(Lp, P) + si.delta
        pos = pos.clamp_(0, cos_table.shape[0] - 1).to(dev)
        idx = pos[:, self.axes, :].transpose(1, 2)  # [J, P, hd]: each channel's position
        cos, sin = cos_table[idx, self._channels], sin_table[idx, self._channels]
        with_images = [(j, si) for j, (si, _) in enumerate(seqs) if si.images is not None]
        if not with_images:
            return (cos, sin), None
        pixels = torch.cat([si.images.pixel_values for _, si in with_images]).to(dev)
        grids = torch.cat([si.images.grid_thw for _, si in with_images]).to(dev)
        feats = vision_features(self.tower, pixels, grids)
        rows_j = torch.cat([torch.full((si.rows.numel(),), j, dtype=torch.long) for j, si in with_images]).to(dev)
        rows_p = torch.cat([si.rows for _, si in with_images]).to(dev)
        if feats.shape[0] != rows_p.numel():
            raise RuntimeError(f"vision tower gave {feats.shape[0]} features for {rows_p.numel()} placeholders")
        return (cos, sin), (rows_j, rows_p, feats)


def shared_tower(engine: Any) -> Optional[torch.nn.Module]:
    """The tower a trainer engine's first pipeline stage holds (``module.visual``), shared, or None."""
    module = getattr(engine, "module", None)
    for m in (module, getattr(module, "module", None)):
        tower = getattr(m, "visual", None) if m is not None else None
        if tower is not None:
            return tower
    return None


def vision_tower_for(hf_config: Any, path: Optional[str], dtype: torch.dtype,
                     device: Optional[torch.device]) -> Optional[torch.nn.Module]:
    """The tower of a VL checkpoint (None for a text model)."""
    from parallel.vision import vision_arch

    if vision_arch(hf_config) is None or path is None:
        return None
    return load_vision_tower(path, hf_config, dtype, device)
