"""One step of the generation engine on the paged KV pool: admit, prefill, decode.

A step (:meth:`SteppingMixin._step`):

1. gives every running row the block its next token goes into -- a new block at a block
   boundary, a private copy of a group's shared last block (copy-on-write); when the pool is
   full the newest rows are preempted (back to the queue head, re-prefilled later);
2. admits queued sequences within ``max_prefill_tokens``: a sample whose request's leader joins
   in the same step shares the leader's prompt blocks instead of prefilling them (its first
   token is sampled from the leader's logits with its own seed); a prompt starting with cached
   blocks prefills only the rest; a prompt longer than the budget is prefilled in chunks over
   several steps (``_partial``) while the others keep decoding;
3. decodes one token for every row that was running before the step.

Vision-language prompts are never chunked nor looked up in the cache (the tower runs on the
whole prompt at once), but their groups share a prompt like text ones.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from parallel.generation.blocks import OutOfBlocks
from parallel.generation.routing import record_decode, record_prefill
from parallel.generation.sequence import Seq
from realflow.api.generation import GenerationResult

__all__ = ["SteppingMixin"]


class SteppingMixin:
    """Needs the engine's queues, slot tensors, ``pager``, ``pool``, ``cache``, ``graphs``, ``decoder``, ``vision``,
    ``_accept``, ``_set_slots`` and ``_remove_rows`` (:mod:`parallel.generation.engine`)."""

    def _step(self) -> list[GenerationResult]:
        t0 = time.perf_counter()
        done, self._done = self._done, []
        n_old = self._prepare_decode()
        finished: dict[int, dict[str, Any]] = {}
        jobs, joined = self._admit()
        if jobs:
            self._prefill(n_old, jobs, joined, finished)
        if n_old:
            self._decode(n_old, finished)
        done += [r for _, r in self._remove_rows(finished)]
        self.steps += 1
        self.busy_seconds += time.perf_counter() - t0
        return done

    # ------------------------------------------------------------ blocks for decode

    def _prepare_decode(self) -> int:
        """Blocks for every running row's next write; returns the rows left after preemption."""
        B = len(self._running)
        if not B:
            return 0
        bs = self.pager.bs
        pos = self._pos[:B]
        rows = (pos % bs == 0).nonzero().flatten().tolist()
        if any(s.cow for s in self._running):
            rows = sorted(set(rows).union(i for i, s in enumerate(self._running) if s.cow))
        changes: list[tuple[int, int, int]] = []  # (row, table column, block): one indexed write
        for i in rows:
            while i < len(self._running):
                seq = self._running[i]
                p = len(seq.prompt) + len(seq.out) - 1  # the fed token's position
                try:  # contiguous decode writes whole blocks from the slot later: no copy needed now
                    block, changed = self.pager.write_block(seq, p, copy=self.cache is None)
                except OutOfBlocks:
                    self._preempt_last()
                    continue
                if changed:
                    changes.append((i, p // bs, block))
                break
        n = len(self._running)
        changes = [c for c in changes if c[0] < n]  # a row preempted after its block was set: gone
        if changes:
            r, c, b = torch.tensor(changes, dtype=torch.long, device=self._tables.device).unbind(1)
            self._tables[r, c] = b
        return n

    def _preempt_last(self) -> None:
        """A prompt being prefilled in chunks, else the newest running row, goes back to the head
        of the queue, its blocks freed."""
        if self._partial is not None:
            self._unpartial()
            self.preempted += 1
            return
        if len(self._running) <= 1:
            raise RuntimeError(f"generation KV pool: {self.pager.alloc.num_blocks} blocks do not hold one "
                               f"sequence's next token; raise kv_blocks or gpu_memory_utilization")
        seq = self._running.pop()
        self.pager.release(seq)
        self._waiting.appendleft(seq)
        self._flags.clear()
        self.preempted += 1

    # ------------------------------------------------------------ admission

    def _admit(self) -> tuple[list[tuple[Seq, int, int]], list[tuple[Seq, int]]]:
        """``(jobs, joined)``: prefill jobs ``(seq, start, end)`` (token range to run) and the
        sequences that start decoding, each with the job whose logits give its first token."""
        jobs: list[tuple[Seq, int, int]] = []
        joined: list[tuple[Seq, int]] = []
        budget = self.config.max_prefill_tokens
        chunking = self.vision is None
        if self._partial is not None:  # a chunked prompt goes on first
            seq = self._partial
            n = len(seq.prompt) + len(seq.out)
            end = min(n, seq.computed + budget)
            if not self._take_blocks(seq, end):
                return jobs, joined
            jobs.append((seq, seq.computed, end))
            budget -= end - seq.computed
            if end < n:
                return jobs, joined
            self._partial = None
            joined.append((seq, 0))
        leaders: dict[str, int] = {}  # request -> its leader's job, fresh samples only
        if joined and not joined[0][0].out:
            leaders[joined[0][0].request_rid] = 0
        slots = self.config.max_running_requests
        while self._waiting and len(self._running) + len(joined) < slots:
            seq = self._waiting[0]
            lead = leaders.get(seq.request_rid) if not seq.out and self.pager.sharing else None
            if lead is not None:
                self._waiting.popleft()
                joined.append((seq, lead))
                continue
            n = len(seq.prompt) + len(seq.out)
            start = self.pager.cached_prefix(seq)
            need = n - start
            if jobs and need > budget:
                self.pager.release(seq)
                break
            end = n if need <= budget or not chunking else start + budget
            if not self._take_blocks(seq, end):
                self.pager.release(seq)
                break
            self._waiting.popleft()
            self.prefix_shared_tokens += start
            jobs.append((seq, start, end))
            budget -= end - start
            if end < n:  # the rest in later steps
                self._partial = seq
                break
            joined.append((seq, len(jobs) - 1))
            if not seq.out:
                leaders[seq.request_rid] = len(jobs) - 1
        return jobs, joined  # (rows join after the running ones: the cached RowFlags stay true)

    def _take_blocks(self, seq: Seq, end: int) -> bool:
        try:
            self.pager.grow(seq, end)
            return True
        except OutOfBlocks:
            return False

    # ------------------------------------------------------------ prefill

    def _prefill(self, row0: int, jobs: list[tuple[Seq, int, int]], joined: list[tuple[Seq, int]],
                 finished: dict[int, dict[str, Any]]) -> None:
        seqs = [j[0] for j in jobs]
        starts, ends = [j[1] for j in jobs], [j[2] for j in jobs]
        lens = [b - a for a, b in zip(starts, ends)]
        P, dev = max(lens), self._pos.device
        ids = torch.tensor([s.tokens()[a:b] + [0] * (P - b + a) for s, a, b in jobs], dtype=torch.long)
        write_rows = self.pager.rows(seqs, starts, ends, P)
        # the blocks of tokens 0..max(ends)-1 when some row starts past 0
        ctx_tables = self.pager.block_tables(seqs, -(-max(ends) // self.pager.bs)) if any(starts) else None
        rope = images = None
        if self.vision is not None:  # VL rows always start at 0 (never chunked nor cached)
            rope, images = self.vision.prefill_inputs([(s.images, len(s.out)) for s in seqs], P,
                                                      self.decoder.cos, self.decoder.sin)
        sources = [j for _, j in joined]
        src = torch.tensor(sources, dtype=torch.long, device=dev)
        # the job whose keys fill each joined row's slot: `n` when each job fills the next n slots
        # (one broadcast copy), else by index
        n = len(sources) // len(jobs)
        slot_src: torch.Tensor | int = n if n and sources == [i // n for i in range(n * len(jobs))] else src
        fill = None  # contiguous decode: the joined rows' slots straight from the prefill's keys and
        if self.cache is not None and joined and ctx_tables is None:  # values, else from the pool (_fill_slots)
            fill = (self.cache, row0, slot_src)
        logits = self.decoder.extend(ids.to(dev), torch.tensor(starts, device=dev), torch.tensor(lens, device=dev),
                                     self.pool, write_rows, ctx_tables, rope, images, fill)
        if self.decoder.routing is not None:
            record_prefill([s.routed for s in seqs], self.decoder.routing, lens, starts)
        self.prefill_tokens += sum(lens)
        for s, b in zip(seqs, ends):
            s.computed = b
            self.pager.register(s, b)
        if not joined:
            return
        for seq, j in joined:
            if seq is not seqs[j]:  # a sample sharing its leader's prompt
                leader = seqs[j]
                self.pager.fork(leader, seq)
                self.prefix_shared_tokens += leader.computed
                if seq.routed is not None and leader.routed is not None:
                    seq.routed.write(0, leader.routed.buf[: leader.routed.n])
        new = [s for s, _ in joined]
        self._running += new
        self._set_slots(row0, new)
        J = len(new)
        self._tables[row0:row0 + J] = self.pager.block_tables(new, self._tables.shape[1])
        if self.vision is not None:
            self._delta[row0:row0 + J] = torch.tensor([s.images.delta for s in new], dtype=torch.long)
        n_tok = torch.tensor([s.computed for s in new], dtype=torch.long, device=dev)
        if self.cache is not None and fill is None:
            self._fill_slots(row0, seqs, slot_src, int(n_tok.max()))
        self._pos[row0:row0 + J] = n_tok
        self._accept(row0, logits.index_select(0, src), finished, decode=False)

    def _fill_slots(self, row0: int, seqs: list[Seq], src: torch.Tensor | int, length: int) -> None:
        """The joined rows' contiguous copies (slots ``row0..``): each prefill job's context
        ``0..length-1`` read from the pool once, then copied to every row that joined from it
        (``src``: the job of each, or ``n``: each job fills the next n slots), so a group of n
        samples reads its prompt once, not n times. Past a row's own end the copy holds padding
        that decode masks."""
        tables = self.pager.block_tables(seqs, -(-length // self.pager.bs))  # the blocks of 0..length-1
        for li in range(self.spec.num_layers):
            k, v = self.pool.read_blocks(li, tables)  # [jobs, W * bs, ng, hd], whole blocks
            # copied into the slots as views
            self.cache.fill_from_jobs(li, row0, k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2), src)

    # ------------------------------------------------------------ decode

    def _decode(self, B: int, finished: dict[int, dict[str, Any]]) -> None:
        bs = self.pager.bs
        pos = self._pos[:B]
        rope = None if self._delta is None else pos + self._delta[:B]
        if self.cache is not None:  # contiguous: the slots hold the context; the pool gets full blocks below
            logits = self.decoder.decode(self._last[:B], pos, self.cache, rope)
        else:
            pool_rows = self.pool.rows_at(self._tables[:B], pos[:, None]).squeeze(1)
            if self.graphs is not None:  # replayed from static buffers (parallel.generation.cuda_graphs)
                logits = self.graphs.run(self._last[:B], pos, self._tables[:B], pool_rows)
            else:  # each row's tokens 0..pos through its block table
                tables = self._tables[:B, : int(pos.max()) // bs + 1]
                logits = self.decoder.decode(self._last[:B], pos, None, rope, self.pool, pool_rows, tables)
        olds = self._running[:B]
        if self.decoder.routing is not None:  # the fed token sits at len(prompt) + len(out) - 1
            record_decode([s.routed for s in olds], self.decoder.routing,
                          [len(s.prompt) + len(s.out) - 1 for s in olds])
        if self.pager.sharing:  # blocks this token filled go into the prefix cache
            full = [(i, s, len(s.prompt) + len(s.out)) for i in ((pos + 1) % bs == 0).nonzero().flatten().tolist()
                    if self.pager.cacheable(s := olds[i])]
            if full and self.cache is not None:  # the blocks' keys and values, from the rows' slots
                self._blocks_from_slots([i for i, _, _ in full], [s.blocks[n // bs - 1] for _, s, n in full],
                                        [n - bs for _, _, n in full])
            for _, s, n in full:
                self.pager.register(s, n)
        self._accept(0, logits, finished, decode=True)

    def _blocks_from_slots(self, rows: list[int], blocks: list[int], starts: list[int]) -> None:
        """Copy positions ``starts[j] .. starts[j]+bs-1`` of running row ``rows[j]``'s contiguous
        slot into pool block ``blocks[j]`` (every layer; one indexed copy for all the rows: a
        group's samples fill their blocks on the same step): contiguous decode writes the pool
        only per full block."""
        bs = self.pager.bs
        k, v = self.cache.read_spans(rows, starts, bs)
        offsets = torch.arange(bs, device=self._pos.device)
        dst = (torch.tensor(blocks, device=self._pos.device)[:, None] * bs + offsets).flatten()  # [R*bs]
        self.pool.k.index_copy_(1, dst, k)
        self.pool.v.index_copy_(1, dst, v)
