"""KV blocks: a fixed pool of ``block_size``-token blocks, reference-counted and shareable.

Why blocks: a sequence's keys and values live in blocks listed by its block table, so memory
is taken as a sequence grows (not ``max_model_len`` per slot up front), freed the moment it
finishes, and a prefix common to several sequences -- the prompt of a GRPO group's n samples,
the earlier turns of an agent session -- is stored once and read by all of them.

* ``allocate`` / ``release``: a block is in use while its reference count is > 0.
* ``share``: another sequence reads the same blocks (count + 1). A sequence about to WRITE into
  a block that others read first takes a private copy (copy-on-write, :meth:`BlockAllocator.
  writable_copy`; the engine copies the contents).
* Prefix caching: a FULL block can be registered under a hash of its tokens and of everything
  before it (:func:`block_hash`, which includes the weight version and any image digest). A
  later prompt that starts with the same tokens finds its blocks with :meth:`lookup`. Released
  registered blocks stay cached (least recently used first out) until a new allocation needs
  them; :meth:`clear_cache` drops every registration (a weight update makes them stale).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

__all__ = ["BlockAllocator", "OutOfBlocks", "block_hash", "blocks_for"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the engine preempts or waits)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def block_hash(parent: bytes, tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """Digest of one full block given its predecessor's digest (so equal digests mean equal
    prefixes, not only equal blocks); ``salt`` carries the weight version and image digests."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(salt)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockAllocator:
    """Reference counts, a free list and the prefix cache of ``num_blocks`` blocks (no tensors:
    the engine's :class:`parallel.generation.paged_cache.PagedKVCache` holds the contents)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._hash_of: dict[int, bytes] = {}  # registered block -> digest
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, count 0 (oldest first)
        self.hits = 0  # blocks found by lookup (prefix-cache hits)

    # ------------------------------------------------------------ counts

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take now (free, or cached and unused)."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.free_blocks

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with count 1; OutOfBlocks (nothing taken) when fewer are free."""
        if n > self.free_blocks:
            raise OutOfBlocks(f"{n} KV blocks asked, {self.free_blocks} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # the least recently used cached block goes
                b, _ = self._evictable.popitem(last=False)
                self._unregister(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Another reader of ``blocks`` (each in use)."""
        for b in blocks:
            if self.refs[b] < 1:
                raise RuntimeError(f"KV block {b} is shared but not in use")
            self.refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One reader fewer; a block nobody reads is free (or cached, if registered)."""
        for b in blocks:
            r = self.refs[b]
            if r < 1:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.refs[b] = r - 1
            if r == 1:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def writable_copy(self, block: int) -> Optional[int]:
        """Before writing into ``block``: None when the caller is its only reader (write in place),
        else a fresh block the caller must copy ``block`` into and use instead (copy-on-write).
        A registered block is never written in place (its digest would lie): it is copied too."""
        if self.refs[block] == 1 and block not in self._hash_of:
            return None
        new = self.allocate(1)[0]
        self.release([block])
        return new

    # ------------------------------------------------------------ prefix cache

    def register(self, block: int, digest: bytes) -> None:
        """``block`` (full, in use) holds the prefix ``digest`` names; the first block registered
        under a digest keeps it."""
        if digest in self._by_hash or block in self._hash_of:
            return
        self._hash_of[block] = digest
        self._by_hash[digest] = block

    def lookup(self, digest: bytes) -> Optional[int]:
        """The block registered under ``digest``, now with one more reader; None when absent."""
        b = self._by_hash.get(digest)
        if b is None:
            return None
        if self.refs[b] == 0:
            del self._evictable[b]
        self.refs[b] += 1
        self.hits += 1
        return b

    def clear_cache(self) -> None:
        """Forget every registration: unused cached blocks become free (weights changed)."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._hash_of.clear()
        self._by_hash.clear()

    def _unregister(self, b: int) -> None:
        digest = self._hash_of.pop(b, None)
        if digest is not None:
            self._by_hash.pop(digest, None)

    def check(self) -> None:
        """Invariants (tests): every block is exactly one of in use, free, cached-unused."""
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & cached
        for b, r in enumerate(self.refs):
            assert r >= 0
            assert (r == 0) == (b in free or b in cached), (b, r)
