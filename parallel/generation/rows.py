"""The running rows of the generation engine: their slot state, sampling, finishing, removal.

Row ``i`` of a decode step is ``_running[i]``; its sampling settings, budget, stop ids, block
table and next token live in row ``i`` of the engine's slot tensors, set when it joins
(:meth:`RowsMixin._set_slots`), so a step tests every row at once instead of looping over
requests in Python. Rows that finish leave at the end of the step and the last rows move into
their places (:meth:`RowsMixin._remove_rows`), keeping the batch compact.
"""
from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Any, Optional

import torch

from parallel.generation.sampler import SampleBatch, counter_uniform, sample, split_seed
from parallel.generation.sequence import RowFlags, Seq
from realflow.api.generation import GenerationResult

__all__ = ["RowsMixin"]


class RowsMixin:
    """Needs the engine's slot tensors, ``_running``, ``_flags``, ``_ids``, ``pager``, ``cache``,
    ``tokenizer``, ``version`` and counters (:mod:`parallel.generation.engine`)."""

    def _set_slots(self, row0: int, joined: list[Seq]) -> None:
        """Write the joining requests' settings into their slots' rows."""
        J, dev = len(joined), self._pos.device
        rows = slice(row0, row0 + J)
        # two tensors built from one nested list each (a tensor per setting cost ~0.1 ms more each)
        floats, longs = [], []
        for s in joined:
            p, (lo, hi) = s.params, split_seed(s.seed)
            floats.append((p.temperature if p.temperature > 0 else 1.0, p.top_p, p.min_p))
            longs.append((p.top_k, p.logprob_mode != "raw", lo, hi, len(s.out),
                          min(p.max_new_tokens, self._max_context - len(s.prompt)) - len(s.out)))
        f = torch.tensor(floats, dtype=torch.float32).to(dev).unbind(1)
        n = torch.tensor(longs, dtype=torch.long).to(dev).unbind(1)
        self._temp[rows], self._top_p[rows], self._min_p[rows] = f
        self._top_k[rows], self._lp_sampling[rows] = n[0], n[1].bool()
        self._seed_lo[rows], self._seed_hi[rows], self._draws[rows], self._budget[rows] = n[2:]
        self._hash_ahead(rows)
        width = max(len(s.stop_ids) for s in joined)
        if width > self._stops.shape[1]:
            with torch.inference_mode(False):  # engine state: a normal tensor, writable anywhere
                grown = torch.full((self._stops.shape[0], width), -1, dtype=torch.long, device=dev)
                grown[:, : self._stops.shape[1]] = self._stops
            self._stops = grown
        width = self._stops.shape[1]  # one tensor from one nested list: no op per row
        table = [sorted(s.stop_ids) + [-1] * (width - len(s.stop_ids)) for s in joined]
        self._stops[rows] = torch.tensor(table, dtype=torch.long).to(dev)

    def _slot_tensors(self) -> tuple[torch.Tensor, ...]:
        state = (self._last, self._pos, self._temp, self._top_k, self._top_p, self._min_p, self._lp_sampling,
                 self._budget, self._stops, self._tables, self._seed_lo, self._seed_hi, self._draws,
                 self._uniforms, self._ubase)
        return state if self._delta is None else state + (self._delta,)

    def _row_flags(self, row0: int, B: int) -> "RowFlags":
        """What rows ``row0..row0+B-1`` need beyond greedy decoding; cached until the running
        set changes (a steady decode step then loops over no request in Python)."""
        key = (row0, B)
        flags = self._flags.get(key)
        if flags is None and row0 == 0:  # the rows that joined last step after the ones before
            for r0, b in list(self._flags):
                head = self._flags.get((0, r0))
                if r0 and r0 + b == B and head is not None:
                    flags = self._flags[key] = head.then(self._flags[(r0, b)], r0, self._pos.device)
                    break
        if flags is None:
            seqs = self._running[row0:row0 + B]
            sampled = [i for i, s in enumerate(seqs) if s.samples]
            rows = None
            if sampled and len(sampled) < B:
                rows = torch.tensor(sampled, device=self._pos.device)
            flags = RowFlags(sampled, rows, any(seqs[i].truncates for i in sampled),
                             any(seqs[i].params.temperature != 1.0 for i in sampled),
                             any(s.params.logprob_mode != "raw" for s in seqs),
                             any(s.stop_ids for s in seqs),
                             [i for i, s in enumerate(seqs) if s.params.stop],
                             [s.out for s in seqs], [s.logprobs for s in seqs], [s.versions for s in seqs])
            self._flags[key] = flags
        return flags

    def _hash_ahead(self, rows: slice) -> None:
        """Hash the next ``_uniforms.shape[1]`` uniforms of the streams of slots ``rows``, from
        their current draw on (the values counter_uniform gives draw by draw, computed at once)."""
        ahead = self._uniforms.shape[1]
        draws = self._draws[rows]
        t = draws[:, None] + torch.arange(ahead, device=draws.device)[None, :]
        self._uniforms[rows] = counter_uniform(self._seed_lo[rows, None].expand_as(t),
                                               self._seed_hi[rows, None].expand_as(t), t)
        self._ubase[rows] = draws

    def _uniform(self, rows: slice) -> torch.Tensor:
        """This step's uniform of every slot in ``rows`` (draw ``_draws``), from the hashed-ahead table."""
        col = self._draws[rows] - self._ubase[rows]
        if int(col.max()) >= self._uniforms.shape[1]:  # some row used its table up: refill them all
            self._hash_ahead(rows)
            col = self._draws[rows] - self._ubase[rows]
        return self._uniforms[rows].gather(1, col[:, None]).squeeze(1)

    def _sample_batch(self, row0: int, seqs: list[Seq], flags: "RowFlags") -> Optional[SampleBatch]:
        if not flags.sampled:
            return None
        sl = slice(row0, row0 + len(seqs))
        uniform = self._uniform(sl)
        temp, top_k, top_p, min_p = self._temp[sl], self._top_k[sl], self._top_p[sl], self._min_p[sl]
        if flags.rows is not None:
            temp, top_k, top_p, min_p = temp[flags.rows], top_k[flags.rows], top_p[flags.rows], min_p[flags.rows]
            uniform = uniform[flags.rows]
        return SampleBatch(flags.rows, temp, top_k, top_p, min_p, uniform, truncate=flags.truncate,
                           tempered=flags.tempered, sampling_logprobs=flags.lp_sampling)

    def _accept(self, row0: int, logits: torch.Tensor, finished: dict[int, dict[str, Any]],
                decode: bool) -> None:
        """Sample rows ``row0..row0+B-1``, append to their sequences, find the finished ones.

        Stop ids and length limits are tested for all rows at once on the
        per-slot tensors; only rows that may have finished (and rows with stop
        strings, which need the tokenizer) go through :meth:`_finish_reason`.
        """
        B = logits.shape[0]
        sl = slice(row0, row0 + B)
        seqs = self._running[sl]
        flags = self._row_flags(row0, B)
        # a NaN/inf row would sample garbage: that request fails. A row's sum is non-finite when
        # one of its logits is (or, finite, they overflow fp32: a diverged model too); 10x cheaper
        # than isfinite(logits).all(-1) on CPU
        finite = torch.isfinite(logits.sum(-1))
        bad_rows = [] if bool(finite.all()) else (~finite).nonzero().flatten().tolist()
        if bad_rows:
            logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        tokens, raw, proc = sample(logits, self._sample_batch(row0, seqs, flags))
        logprobs = torch.where(self._lp_sampling[sl], proc, raw) if flags.lp_sampling else raw
        self._last[sl] = tokens
        self._draws[sl] += self._one
        if decode:  # the fed token now sits in the cache
            self._pos[sl] += self._one
        maybe_done = self._budget[sl].sub_(self._one) <= self._zero
        if flags.stop_ids:
            maybe_done |= (tokens[:, None] == self._stops[sl]).any(-1)
        toks, lps, version = tokens.tolist(), logprobs.tolist(), self.version
        for i in bad_rows:  # the request fails now; nothing sampled from these logits is kept
            finished[row0 + i] = {"type": "error", "message": f"non-finite logits at output token "
                                  f"{len(seqs[i].out)} of request {seqs[i].request_rid or seqs[i].rid} "
                                  f"(weight version {version})", "weight_version": version}
            self.nonfinite_requests += 1
        skip = set(bad_rows)
        if skip:
            for i, (seq, tok, lp) in enumerate(zip(seqs, toks, lps)):
                if i not in skip:
                    seq.out.append(tok)
                    seq.logprobs.append(lp)
                    seq.versions.append(version)
        else:  # the common case: C loops (~10x faster than a Python loop over 500 rows)
            deque(map(list.append, flags.outs, toks), maxlen=0)
            deque(map(list.append, flags.logprobs, lps), maxlen=0)
            deque(map(list.append, flags.versions, repeat(version)), maxlen=0)
        self.tokens_generated += B - len(bad_rows)
        check = flags.stop_strings
        if bool(maybe_done.any()):
            check = sorted(set(check).union(maybe_done.nonzero().flatten().tolist()))
        for i in check:
            if i in skip:
                continue
            reason = self._finish_reason(seqs[i], toks[i])
            if reason is not None:
                finished[row0 + i] = reason

    def _finish_reason(self, seq: Seq, tok: int) -> Optional[dict[str, Any]]:
        if tok in seq.stop_ids:
            return {"type": "stop", "matched": tok}
        if seq.params.stop:
            text = self.tokenizer.decode(seq.out[-seq.stop_window:])
            for s in seq.params.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(seq.out) >= seq.params.max_new_tokens:
            return {"type": "length", "length": len(seq.out)}
        if len(seq.prompt) + len(seq.out) >= self._max_context:
            return {"type": "length", "length": len(seq.out)}
        return None

    @torch.inference_mode()
    def _remove_rows(self, finished: dict[int, dict[str, Any]]) -> list[tuple[int, GenerationResult]]:
        """Remove rows, moving the last surviving rows into the holes (a compact batch); all
        the moves are one indexed copy per tensor, whatever the number of rows."""
        if not finished:
            return []
        n = len(self._running)
        n_new = n - len(finished)
        flags = self._row_flags(0, n) if n_new else None
        self._flags.clear()
        out = []
        for row in sorted(finished):
            seq = self._running[row]
            self.pager.release(seq)
            self._ids.discard(seq.rid)
            out.append((row, seq.result(finished[row])))
        holes = [r for r in sorted(finished) if r < n_new]
        movers = [r for r in range(n_new, n) if r not in finished]
        if holes:
            dev = self._pos.device
            src, dst = torch.tensor(movers, device=dev), torch.tensor(holes, device=dev)
            if self.cache is not None:
                self.cache.move_rows(src, dst, int(self._pos[src].max()))
            for t in self._slot_tensors():
                t[dst] = t[src]
            for h, m in zip(holes, movers):
                self._running[h] = self._running[m]
        del self._running[n_new:]
        new_flags = None if flags is None else flags.without(n_new, holes, movers)
        if new_flags is not None:
            self._flags[(0, n_new)] = new_flags
        return out
