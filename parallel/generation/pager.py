"""The engine's sequences on the paged KV pool: block tables, sharing, copy-on-write, caching.

The engine asks this class for the blocks a sequence needs before its tokens are written, and
gives them back when the sequence finishes, is aborted or retracted. What it decides:

* a prompt whose leading full blocks are cached (an earlier turn of an agent session, a
  retracted request coming back under the same weights) starts from them
  (:meth:`Pager.cached_prefix`); only full blocks are shared this way, and never all of a
  prompt (its last token must run to give the first logits);
* the n samples of a request share the blocks of the prompt their leader prefilled
  (:meth:`Pager.fork`), last partial block included; each sample's first write into that block
  copies it (copy-on-write, :meth:`Pager.write_block`);
* a block filled under the current weights is registered in the prefix cache
  (:meth:`Pager.register`), salted with the weight version, so stale keys are never reused.

Sequences with images or an MoE routing record are not looked up in the cache (the cache does
not keep images or routing), but a group of them still shares its prompt.
"""
from __future__ import annotations

from typing import Sequence

import torch

from parallel.generation.blocks import BlockAllocator, OutOfBlocks, block_hash, blocks_for
from parallel.generation.paged_cache import PagedKVCache
from parallel.generation.sequence import Seq

__all__ = ["Pager", "OutOfBlocks"]


class Pager:
    """Block tables of the engine's sequences over one allocator and one pool."""

    def __init__(self, allocator: BlockAllocator, pool: PagedKVCache, prefix_sharing: bool) -> None:
        self.alloc, self.pool = allocator, pool
        self.bs = allocator.block_size
        self.sharing = prefix_sharing
        self._salt = b"v0"

    def set_version(self, version: int) -> None:
        """New weights: cached blocks are stale (dropped) and new digests carry ``version``."""
        self.alloc.clear_cache()
        self._salt = f"v{version}".encode()

    @staticmethod
    def cacheable(seq: Seq) -> bool:
        return seq.images is None and seq.routed is None

    # ------------------------------------------------------------ admission

    def cached_prefix(self, seq: Seq) -> int:
        """Take the cached blocks ``seq``'s tokens start with; returns the tokens they cover."""
        if not (self.sharing and self.cacheable(seq)) or seq.blocks:
            return seq.computed
        n = len(seq.prompt) + len(seq.out)
        parent = b""
        for i in range((n - 1) // self.bs):
            digest = block_hash(parent, [seq.token(t) for t in range(i * self.bs, (i + 1) * self.bs)], self._salt)
            b = self.alloc.lookup(digest)
            if b is None:
                break
            seq.blocks.append(b)
            seq.digests.append(digest)
            parent = digest
        seq.computed = len(seq.blocks) * self.bs
        return seq.computed

    def grow(self, seq: Seq, tokens: int) -> None:
        """Blocks for ``seq``'s first ``tokens`` tokens (OutOfBlocks: nothing taken)."""
        need = blocks_for(tokens, self.bs) - len(seq.blocks)
        if need > 0:
            seq.blocks += self.alloc.allocate(need)

    def fork(self, leader: Seq, follower: Seq) -> None:
        """``follower`` reads ``leader``'s blocks (its tokens equal the leader's, all computed)."""
        self.alloc.share(leader.blocks)
        follower.blocks = list(leader.blocks)
        follower.digests = list(leader.digests)
        follower.computed = leader.computed
        if leader.computed % self.bs:  # a partial last block: whoever writes into it first copies it
            leader.cow = follower.cow = True

    def release(self, seq: Seq) -> None:
        """``seq`` holds no blocks any more (finished, aborted, retracted, preempted)."""
        if seq.blocks:
            self.alloc.release(seq.blocks)
        seq.blocks, seq.digests, seq.computed, seq.cow = [], [], 0, False

    # ------------------------------------------------------------ writes

    def write_block(self, seq: Seq, pos: int, copy: bool = True) -> tuple[int, bool]:
        """The block ``seq`` writes position ``pos`` into -- a new one at a block boundary, a copy
        of a shared one (copy-on-write; ``copy=False``: a private block whose contents the caller
        writes whole) -- and whether its table changed. OutOfBlocks when the pool is full."""
        i = pos // self.bs
        if i == len(seq.blocks):
            seq.blocks += self.alloc.allocate(1)
            seq.cow = False
            return seq.blocks[i], True
        if seq.cow:
            seq.cow = False
            old = seq.blocks[i]
            new = self.alloc.writable_copy(old)
            if new is not None:
                if copy:
                    self.pool.copy_block(old, new)
                seq.blocks[i] = new
                return new, True
        return seq.blocks[i], False

    def register(self, seq: Seq, upto: int) -> None:
        """Register ``seq``'s full blocks within its first ``upto`` computed tokens."""
        if not (self.sharing and self.cacheable(seq)):
            return
        parent = seq.digests[-1] if seq.digests else b""
        for i in range(len(seq.digests), upto // self.bs):
            digest = block_hash(parent, [seq.token(t) for t in range(i * self.bs, (i + 1) * self.bs)], self._salt)
            self.alloc.register(seq.blocks[i], digest)
            seq.digests.append(digest)
            parent = digest

    # ------------------------------------------------------------ tensors

    def block_tables(self, seqs: Sequence[Seq], width: int) -> torch.Tensor:
        """``[len(seqs), width]`` block tables: each sequence's first ``width`` blocks, padded with
        block 0 (whose contents readers mask)."""
        tables = [s.blocks[:width] for s in seqs]
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.pool.device)

    def rows(self, seqs: Sequence[Seq], starts: Sequence[int], ends: Sequence[int], width: int) -> torch.Tensor:
        """Pool rows of each sequence's tokens ``start..end-1`` (scratch row after)."""
        return self.pool.index([s.blocks for s in seqs], starts, ends, width)
