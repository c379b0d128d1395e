"""How a :class:`parallel.generation.engine.GenerationEngine` takes new weights.

In place (``update_weights_from_tensors``, ``update_weights_from_disk``), or staged beside the
weights in use and swapped in later (``stage_weights_from_tensors`` + ``commit_staged_weights``);
from HF-named full tensors, this rank's megatron-named tensors, a checkpoint directory, or a
LoRA run's adapters (merged into the base: :mod:`parallel.generation.adapters`). A mixin so the
engine's own file keeps to requests and stepping.

A vision-language model's updates may carry its tower's parameters under their HF names
(``visual.*``, in either format): they go to the tower (:class:`parallel.generation.vision.VisionWeights`),
checked with the rest before anything is written, staged and swapped with the rest.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Optional

import torch

from parallel.generation.adapters import is_adapter_update
from parallel.generation.vision import split_vision
from parallel.generation.weights import DecoderWeights, load_hf_weights, mcore_from_hf_tensors
from parallel.hf_io import CheckpointError, param_table, read_hf_tensors

__all__ = ["WeightUpdatesMixin"]


class WeightUpdatesMixin:
    """Needs the engine's ``weights``, ``spec``, ``hf_config``, ``decoder``, ``version``, ``adapters``,
    ``adapter_scaling``, ``vision``, ``_staged``, ``_retract`` and ``_new_weights``."""

    weights: DecoderWeights
    vision: Any
    _staged: Optional[tuple[int, DecoderWeights, Optional[dict]]]

    def update_weights_from_tensors(self, tensors: Mapping[str, torch.Tensor], fmt: str = "hf",
                                    version: Optional[int] = None) -> int:
        """In-place update from HF-named FULL tensors (``fmt="hf"``, any subset of whole
        entries) or this rank's megatron-named local tensors (``fmt="megatron"``).
        Validated completely before anything is written.  Returns the new version."""
        tensors, vis = self._split(tensors)
        local = self._to_local(tensors, fmt)
        self.weights.check_update(local)
        if vis:
            self.vision.weights.check(vis)
        self.weights.copy_(local)
        if vis:
            self.vision.weights.copy_(vis)
        return self.weights_updated(version)

    def _split(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], dict]:
        """(language model's tensors, the tower's ``visual.*``); text models keep every name (and
        refuse unknown ones as before)."""
        if self.vision is None:
            return tensors, {}
        return split_vision(tensors)

    def stage_weights_from_tensors(self, tensors: Mapping[str, torch.Tensor], fmt: str = "hf",
                                   version: Optional[int] = None) -> int:
        """Build the next weights BESIDE the ones in use; :meth:`commit_staged_weights` swaps them in.

        Why: an in-place update stops generation for the whole conversion, copy and
        (on CPU) re-transposition of every weight -- ~0.4 s for a 100M model on one
        thread.  Staging does that work while the engine keeps stepping on the old
        weights (from another thread: it only reads the update and ``spec``), so the
        pause of a weight-update round shrinks to a pointer swap.  Costs one more copy
        of the weights until the commit.  ``tensors`` may alias shared memory: they
        are copied (the staged weights own their memory).  A partial update keeps the
        current values of the entries it does not name.  Returns the staged version.
        """
        tensors, vis = self._split(tensors)
        local = self._to_local(tensors, fmt)
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise ValueError(f"weight_version={version!r}: must be an integer")
        self.weights.check_update(local)
        staged_vision = None if self.vision is None else self.vision.weights.staged(vis)
        # copy what still aliases the update (or the weights in use); fused entries are fresh already
        borrowed = {t.untyped_storage().data_ptr() for t in tensors.values()}
        borrowed |= {t.untyped_storage().data_ptr() for t in self.weights.tensors.values()}
        fresh: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, cur in self.weights.tensors.items():
                t = local.get(name, cur).to(device=self.weights.device, dtype=self.weights.dtype)
                if t.untyped_storage().data_ptr() in borrowed or not t.is_contiguous():
                    t = t.clone(memory_format=torch.contiguous_format)
                fresh[name] = t
        staged = DecoderWeights(self.spec, fresh)
        v = self.version + 1 if version is None else int(version)
        self._staged = (v, staged, staged_vision)
        return v

    def commit_staged_weights(self, version: Optional[int] = None) -> int:
        """Swap in the weights staged by :meth:`stage_weights_from_tensors` (of ``version``,
        if given): running requests are retracted as for any update."""
        if self._staged is None:
            raise ValueError("commit_staged_weights: nothing is staged")
        v, staged, staged_vision = self._staged
        if version is not None and version != v:
            raise ValueError(f"commit_staged_weights: version {v} is staged, not {version}")
        self._staged = None
        self.weights = staged
        self.decoder.w = staged
        if staged_vision is not None:
            self.vision.weights.swap(staged_vision)
        self._retract()
        self.version = v
        self._new_weights(v)
        return v

    def merged_adapter_update(self, adapters: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
        """HF tensors of an adapter-only (LoRA) update merged into the base this engine was loaded
        from (:mod:`parallel.generation.adapters`); stage or apply them as any HF update."""
        return self.adapters.merged(adapters, float(scaling))

    def hf_weight_groups(self) -> list[list[str]]:
        """HF names that convert together (a fused entry needs all of its HF tensors in one
        update): a delta update that changed one of them hands the engine its partners too."""
        groups = [list(e.hf_names) for e in param_table(self.hf_config, self.spec.arch, vision=False)]
        return groups + ([] if self.vision is None else [[n] for n in self.vision.weights.params])

    def weights_digest(self) -> str:
        """BLAKE2b of the weights in use (names sorted): equal digests, bit-identical weights."""
        h = hashlib.blake2b(digest_size=16)
        named = dict(self.weights.tensors)
        if self.vision is not None:
            named.update(self.vision.weights.named())
        for name in sorted(named):
            t = named[name].detach().cpu().contiguous()
            h.update(name.encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return h.hexdigest()

    def _to_local(self, tensors: Mapping[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
        if fmt == "hf" and is_adapter_update(tensors):  # a LoRA run's update: its adapters only
            if self.adapter_scaling is None:
                raise CheckpointError("weight update: LoRA adapters sent to a server not started for LoRA "
                                      "(start it with --lora-r and --lora-alpha, or send full weights)")
            tensors = self.merged_adapter_update(tensors, self.adapter_scaling)
        if fmt == "hf":
            return mcore_from_hf_tensors(self.spec, self.hf_config, tensors, partial=True)
        if fmt == "megatron":
            return dict(tensors)
        raise ValueError(f"weight format {fmt!r}: expected 'hf' or 'megatron'")

    def update_weights_from_disk(self, model_path: str, version: Optional[int] = None) -> int:
        """In-place update from an HF checkpoint directory (same architecture), or from a PEFT
        adapter directory of the model this engine was loaded with (merged into that base)."""
        from parallel.lora_io import is_peft_adapter, read_adapter_config, read_adapter_tensors

        if is_peft_adapter(model_path):
            cfg = read_adapter_config(model_path)
            return self.update_weights_from_tensors(
                self.merged_adapter_update(read_adapter_tensors(model_path), cfg.scaling), "hf", version)
        local = load_hf_weights(model_path, self.hf_config, self.spec, self.weights.dtype)
        vis = {}
        if self.vision is not None:
            try:
                vis = read_hf_tensors(model_path, list(self.vision.weights.params))
            except KeyError as e:
                raise CheckpointError(f"tensor {e.args[0]} missing from checkpoint {model_path}") from None
            self.vision.weights.check(vis)
        self.weights.copy_(local)
        if vis:
            self.vision.weights.copy_(vis)
        return self.weights_updated(version)

    def weights_updated(self, version: Optional[int] = None) -> int:
        """Call after writing the (shared) weight tensors in place: running requests
        are retracted so no token mixes KV of two versions; the version moves on."""
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise ValueError(f"weight_version={version!r}: must be an integer")
        self._retract()
        self.weights.refresh()
        self.version = self.version + 1 if version is None else int(version)
        self._new_weights(self.version)
        return self.version

