"""Master: runs the execution plan step by step, holding only metadata.

Per step the master (1) pulls sample metadata from the workers that loaded them,
(2) for each MFC, in topological generations, assigns samples to data-parallel
ranks, asks the holders of missing inputs to stage them in shared memory and tells
the MFC's workers to run with those handles, (3) records who now holds each output
key, and (4) reduces and logs the stats. MFCs of one generation are dispatched
together, so MFCs on disjoint worker sets run at the same time.
"""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from realflow.api.batch import SequenceBatch
from realflow.api.experiment import ExperimentSetup
from realflow.api.mfc import MFCDef, ModelInterfaceType
from realflow.base import names
from realflow.base.fault_injection import fault_point
from realflow.base.logging import get_logger
from realflow.base.output_paths import ensure_inside, output_root
from realflow.base.stats import StatsLogger, StepLog
from realflow.base.trace import Tracer, merge_traces
from realflow.comm.rpc import RemoteError
from realflow.system.dynamic_sampling import sample_until_full, split_generations
from realflow.system.holders import HolderIndex, MissingKeyError
from realflow.system.model_store import ModelStore
from realflow.system.placement import assign_to_dp_ranks
from realflow.system.plan import ExecutionPlan
from realflow.system.progress import ProgressReporter
from realflow.system.recover import RecoverPoint, RecoverPoints

logger = get_logger("master")


class MasterError(RuntimeError):
    """The run cannot continue; the message names the MFC and worker involved."""


class WorkerLost(MasterError):
    """A worker stopped sending heartbeats (dead, stopped or hung): a fault a relaunch may fix."""


@dataclass
class _Inbound:
    """What one destination worker receives before running one MFC."""

    handles: list[dict] = field(default_factory=list)  # shared-memory handles, one per staged transfer
    transfers: list[tuple[list[str], tuple[str, ...]]] = field(default_factory=list)  # (samples, keys) each carries


_NOTHING_INBOUND = _Inbound()  # (read only: for the destinations that receive nothing)


class Master:
    def __init__(self, setup: ExperimentSetup, plan: ExecutionPlan, endpoint, lost_workers=None):
        self.setup = setup
        self.lost_workers = lost_workers or (lambda: [])
        self._next_lost_check = 0.0  # monotonic time of the next heartbeat check (see _wait)
        self.plan = plan
        self.ep = endpoint
        self.workers = [names.model_worker_name(i) for i in range(setup.n_workers)]
        self.holders = HolderIndex()
        self.recover = RecoverPoints(setup)
        self.resume_from: Optional[RecoverPoint] = self.recover.resume_point()
        self.last_good: dict[str, str] = {}  # "checkpoint" / "recover point" -> where and which step
        self.nonfinite_skipped_steps = 0  # steps whose update a non-finite value skipped (on_nonfinite=skip)
        resume_step = self.resume_from.step if self.resume_from else None
        self.stats = StatsLogger(setup.run_dir, resume_step=resume_step, wandb=setup.wandb,
                                 run_name=f"{setup.experiment_name}/{setup.trial_name}",
                                 config=setup.experiment_config)
        # which samples each step trained: lineage for users, and the proof that a resumed run
        # trains no sample twice and loses none
        self.samples = StepLog(os.path.join(setup.run_dir, "samples.jsonl"), resume_step)
        self.tracer = Tracer("master", enabled=setup.trace)
        self.progress = ProgressReporter(setup.run_dir)
        self.batch_size = _batch_size(setup.mfcs)
        self.step = 0
        self.epoch = 0
        # weight version per role = number of its train steps so far (sent with hooks that copy weights)
        self.role_version: dict[str, int] = defaultdict(int)

    # ---- request helpers ------------------------------------------------------
    def _request(self, worker: int, handler: str, payload: dict, timeout: float) -> int:
        return self.ep.request(self.workers[worker], handler, payload, timeout)

    def _wait(self, rids: list[int], timeout: float) -> dict[int, Any]:
        """Wait for replies, failing fast (and by name) when a worker stops heartbeating."""
        ep = self.ep
        end = time.monotonic() + timeout
        while not ep.done(rids) and not ep.any_failed(rids):  # a failure is raised at once (by ep.wait):
            # its peers may be blocked in a collective with the failed worker and never answer
            # heartbeats arrive every second: checking a few times a second is enough, and the
            # timer spans calls (a check per call would cost every short MFC microseconds)
            now = time.monotonic()
            if now >= self._next_lost_check:
                lost = set(self.lost_workers()) & ep.workers_of(rids)
                if lost:
                    raise WorkerLost(f"worker(s) {sorted(lost)} stopped sending heartbeats; aborting the step")
                self._next_lost_check = now + 0.2
            if now >= end:
                break  # ep.wait names who did not answer
            ep.poll_once(min(1.0, end - now))
        return ep.wait(rids, timeout=max(0.01, end - time.monotonic()))

    def _all(self, handler: str, payload: dict, timeout: float, workers=None) -> dict[int, Any]:
        targets = range(self.setup.n_workers) if workers is None else workers
        reqs = {self._request(i, handler, payload, timeout): i for i in targets}
        results = self._wait(list(reqs), timeout=timeout)
        return {reqs[r]: v for r, v in results.items()}

    # ---- the run --------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        s = self.setup
        self._connect()
        logger.info(f"all {len(self.workers)} model workers connected; loading data")
        with self.tracer.span("load_data"):
            loaded = self._all("load_data", {}, s.setup_timeout_s)
        total = self._total_steps(sum(r["n_train_samples"] for r in loaded.values()))
        with self.tracer.span("setup"):
            self._all("setup", {"total_train_steps": total}, s.setup_timeout_s)
        self.progress.start(total)
        summary: dict[str, Any] = {"total_steps": total}
        train_time = 0.0
        if self.resume_from is not None:
            train_time = self._resume(self.resume_from, summary)
        else:
            summary["eval_before"] = self._evaluate()
        t_start = time.perf_counter() - train_time
        self._before_training()
        for self.step in range(self.step + 1, total + 1):
            try:
                step_stats = self._run_step()
            except RemoteError as e:
                raise self._nonfinite_stop(e) or e
            if any(v for k, v in step_stats.items() if k.endswith("/nonfinite_skipped")):
                self.nonfinite_skipped_steps += 1
                self.progress.event(f"step {self.step}: non-finite loss or gradient; the update was skipped "
                                    f"(on_nonfinite=skip, {self.nonfinite_skipped_steps} so far)")
            step_stats["nonfinite_skipped_steps"] = float(self.nonfinite_skipped_steps)
            step_stats.update(self._after_step(step_stats))
            self.stats.log(self.step, step_stats)
            self.progress.update(self.step, step_stats)
            if s.eval is not None and s.eval.freq_steps and self.step % s.eval.freq_steps == 0 and self.step < total:
                self._evaluate()
            if s.save_freq_steps and self.step % s.save_freq_steps == 0 and self.step < total:
                self._save(f"step{self.step}")
            if self.recover.due(self.step, total):  # last: the point holds everything up to here
                self._write_recover_point(summary, time.perf_counter() - t_start)
            fault_point("step")  # (tests only: realflow.base.fault_injection)
        summary["train_time_s"] = time.perf_counter() - t_start
        summary.update(self._after_training())
        summary["eval_after"] = self._evaluate()
        summary["checkpoints"] = self._save("final")
        self._all("finish", {}, 120.0)
        if s.trace:
            trace_dir = os.path.join(s.run_dir, "trace")
            self.tracer.save(os.path.join(trace_dir, "master.json"))
            files = sorted(os.path.join(trace_dir, f) for f in os.listdir(trace_dir) if f.endswith(".json"))
            summary["trace"] = str(merge_traces(files, os.path.join(s.run_dir, "trace.json")))
        self.stats.close()
        self.samples.close()
        self.progress.finish(summary)
        # finished: launching this trial again starts a new run. After the finish record, not
        # before: a worker lost in between would otherwise find the run neither finished nor
        # resumable, and the launcher would retrain it from the start (seen in a test)
        self.recover.clear()
        fault_point("finished")
        return summary

    # ---- recover points ---------------------------------------------------------
    def _recover_state(self) -> dict[str, Any]:
        """The master's part of a recover point (subclasses add theirs)."""
        return {"step": self.step, "epoch": self.epoch, "role_version": dict(self.role_version)}

    def _load_recover_state(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.role_version.update({k: int(v) for k, v in state["role_version"].items()})

    def _write_recover_point(self, summary: dict[str, Any], train_time: float) -> None:
        t0 = time.perf_counter()
        tmp = self.recover.begin(self.step)
        try:
            with self.tracer.span("recover_point", step=self.step):
                replies = self._all("save_recover", {"dir": tmp, "step": self.step}, self.setup.mfc_timeout_s)
            files = {r["file"]: {"size": r["size"], "digest": r["digest"]} for r in replies.values()}
            state = {**self._recover_state(), "train_time_s": train_time,
                     "eval_before": summary.get("eval_before")}
            path = self.recover.commit(tmp, self.step, state, files)
        except BaseException:
            self.recover.abort(tmp)
            raise
        self.last_good["recover point"] = f"{path} (step {self.step})"
        seconds = time.perf_counter() - t0
        self.stats.log(self.step, {"time/recover_point": seconds})
        logger.info(f"recover point of step {self.step} written to {path} in {seconds:.2f}s")

    def _resume(self, point: RecoverPoint, summary: dict[str, Any]) -> float:
        """Restore every worker and the master from ``point``; returns the training time it had."""
        with self.tracer.span("load_recover", step=point.step):
            self._all("load_recover", {"path": point.path, "step": point.step, "files": point.meta["files"]},
                      self.setup.mfc_timeout_s)
        state = point.meta["master"]
        self._load_recover_state(state)
        summary["eval_before"] = state.get("eval_before")
        summary["resumed_from_step"] = point.step
        self.progress.update(self.step, {})
        self.last_good["recover point"] = f"{point.path} (step {point.step})"
        msg = f"resumed from the recover point of step {point.step} ({point.path})"
        logger.info(msg)
        self.progress.event(msg)
        return float(state.get("train_time_s", 0.0))

    # ---- what an asynchronous run changes (see realflow.system.async_master) -------
    def _connect(self) -> None:
        self.ep.wait_for_workers(self.workers, timeout=self.setup.setup_timeout_s)

    def _total_steps(self, n_train: int) -> int:
        steps_per_epoch = max(1, n_train // self.batch_size)
        total = self.setup.total_train_epochs * steps_per_epoch
        if self.setup.max_train_steps is not None:
            total = min(total, self.setup.max_train_steps)
        logger.info(f"{n_train} training samples, batch {self.batch_size}: {total} steps; setting up models")
        return total

    def _before_training(self) -> None:
        """Runs once after the first evaluation, before step 1."""

    def _after_step(self, stats: dict[str, float]) -> dict[str, float]:
        """Runs after each step; returns more stats for the step."""
        return {}

    def _after_training(self) -> dict[str, Any]:
        """Runs once after the last step, before the final evaluation; returns summary entries."""
        return {}

    def _run_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.tracer.span("fetch", step=self.step):
            batch = self._fetch_batch()
        stats: dict[str, float] = {"time/fetch": time.perf_counter() - t0}
        generations = self.plan.graph.topological_generations()
        if self.setup.group_filter is not None:  # dynamic sampling: roll out until the batch is full
            rollout, generations = split_generations(generations, {m.name: m for m in self.plan.graph.mfcs},
                                                     self.setup.group_filter.key)
            t = time.perf_counter()
            with self.tracer.span("dynamic_sampling", step=self.step):
                batch = sample_until_full(self, batch, rollout, stats)
            stats["time/rollout"] = time.perf_counter() - t
        stats.update(self.run_generations(generations, batch))
        self.samples.write(self.step, {"ids": batch.ids})
        self._all("drop", {"ids": batch.ids}, 60.0)
        self.holders.drop(batch.ids)
        stats["time/step"] = time.perf_counter() - t0
        stats["epoch"] = self.epoch
        return stats

    def run_generations(self, generations: list[list[str]], batch: SequenceBatch) -> dict[str, float]:
        """Run topological ``generations`` of the graph on ``batch``; the step stats they give:
        ``<mfc>/<stat>`` and ``time/<mfc>`` (MFCs of one generation share its wall time)."""
        stats: dict[str, float] = {}
        for generation in generations:
            t = time.perf_counter()
            with self.tracer.span("generation", mfcs=",".join(generation)):
                results = self._run_generation([self.plan.graph.mfc(n) for n in generation], batch)
            for name, mfc_stats in results.items():
                stats.update({f"{name}/{k}": v for k, v in mfc_stats.items()})
                stats[f"time/{name}"] = time.perf_counter() - t
        return stats

    def drop_samples(self, ids: list[str]) -> None:
        """Forget ``ids`` everywhere (workers' data stores and the holder index)."""
        if ids:
            self._all("drop", {"ids": ids}, 60.0)
            self.holders.drop(ids)

    def call(self, worker: int, handler: str, payload: dict, timeout: float) -> Any:
        """One request to one worker; its reply."""
        rid = self._request(worker, handler, payload, timeout)
        return self._wait([rid], timeout=timeout)[rid]

    def fetch_batch(self, n: int) -> SequenceBatch:
        return self._fetch_batch(n)

    def _fetch_batch(self, n: Optional[int] = None) -> SequenceBatch:
        """Collect ``batch_size`` samples' metadata, spread evenly over the workers.

        A batch may straddle an epoch boundary: a worker whose epoch ended goes on with the
        next epoch's order, and a sample it hands out again for this very batch is skipped in
        the new epoch (it trains in this batch, at the old epoch's end). The worker then holds
        that sample once (its data store keys samples by id), so it is left there, not dropped."""
        parts: list[SequenceBatch] = []
        want = self.batch_size if n is None else n
        need = want
        taken: set[str] = set()
        done_workers: set[int] = set()
        idle_rounds = 0
        while need > 0:
            per = math.ceil(need / self.setup.n_workers)
            replies = self._all("fetch", {"n": per}, 120.0)
            before = need
            for i in sorted(replies):
                r = replies[i]
                if r["batch"] is not None:
                    b = SequenceBatch.from_wire(r["batch"])
                    new = [x for x in b.ids if x not in taken]
                    if new[need:]:  # more than we need: back to the worker
                        self._all("drop", {"ids": new[need:]}, 60.0, workers=[i])
                    if len(new) > need or len(new) < len(b):
                        b = b.select_ids(new[:need])
                    if len(b):
                        self.holders.add(b.ids, [*b.seqlens, *b.metadata], i)
                        parts.append(b)
                        taken.update(b.ids)
                        need -= len(b)
                if r["epoch_done"]:
                    done_workers.add(i)
                if need <= 0:
                    break
            idle_rounds = idle_rounds + 1 if need == before else 0
            if idle_rounds > 2:
                raise MasterError(f"batch_size={want} is larger than the data set: the workers hold "
                                  f"{want - need} distinct samples")
        if len(done_workers) == self.setup.n_workers:
            self.epoch += 1
        return SequenceBatch.gather(parts)

    def _run_generation(self, mfcs: list[MFCDef], batch: SequenceBatch) -> dict[str, dict[str, float]]:
        """Stage inputs for, then run, every MFC of one topological generation."""
        assignments, received = self._stage_inputs(mfcs, batch)
        run_reqs: dict[int, tuple[MFCDef, int]] = {}
        hook_reqs: dict[int, tuple[str, str]] = {}
        for mfc in mfcs:
            layout = self.plan.placements[mfc.name].layout
            hook_reqs.update(self._send_hooks(mfc, "pre"))
            for dp_rank, ids in assignments[mfc.name].items():
                for w in layout.dp_members(dp_rank):
                    inbound = received.get((mfc.name, w), _NOTHING_INBOUND)
                    payload = {"mfc": mfc.name, "ids": ids, "receive": inbound.handles, "step": self.step}
                    rid = self._request(w, "run_mfc", payload, self.setup.mfc_timeout_s)
                    run_reqs[rid] = (mfc, w)
                    for sids, keys in inbound.transfers:  # w now also holds what it received
                        self.holders.add(sids, keys, w)
            if mfc.interface_type == ModelInterfaceType.TRAIN_STEP:
                self.role_version[mfc.model_name] += 1
            hook_reqs.update(self._send_hooks(mfc, "post"))
        replies = self._wait(list(run_reqs) + list(hook_reqs), timeout=self.setup.mfc_timeout_s)
        return self._collect(mfcs, batch, replies, run_reqs, hook_reqs)

    def _stage_inputs(self, mfcs: list[MFCDef], batch: SequenceBatch
                      ) -> tuple[dict[str, dict[int, list[str]]], dict[tuple[str, int], _Inbound]]:
        """Assign samples to each MFC's dp ranks; have holders stage the inputs a rank's workers lack.

        Returns the assignment per MFC, and per (MFC, destination worker) that received
        anything: the shared-memory handles to receive and the (samples, keys) they carry.
        """
        assignments: dict[str, dict[int, list[str]]] = {}
        stage_reqs: dict[int, tuple[str, int]] = {}  # request id -> (mfc, destination worker)
        received: dict[tuple[str, int], _Inbound] = {}
        for mfc in mfcs:
            layout = self.plan.placements[mfc.name].layout
            parts = assign_to_dp_ranks(batch, layout, self.holders)
            assignments[mfc.name] = parts
            for dp_rank, ids in parts.items():
                for dest in layout.dp_members(dp_rank):
                    for (holder, keys), sids in self._missing(ids, mfc.input_keys, dest).items():
                        rid = self._request(holder, "stage", {"ids": sids, "keys": list(keys)}, 120.0)
                        stage_reqs[rid] = (mfc.name, dest)
                        received.setdefault((mfc.name, dest), _Inbound()).transfers.append((sids, keys))
        if stage_reqs:
            for rid, handle in self._wait(list(stage_reqs), timeout=120.0).items():
                received[stage_reqs[rid]].handles.append(handle)
        return assignments, received

    def _collect(self, mfcs: list[MFCDef], batch: SequenceBatch, replies: dict[int, Any],
                 run_reqs: dict[int, tuple[MFCDef, int]], hook_reqs: dict[int, tuple[str, str]]
                 ) -> dict[str, dict[str, float]]:
        """Record who holds the outputs, teach the batch the new keys' sizes, reduce stats and hook times.

        Runs once per MFC call on the dispatch path, so it keeps to plain dicts and one pass
        over the replies (an empty MFC's round trip is a few hundred microseconds).
        """
        stats: dict[str, list[dict]] = {}
        reported: dict[tuple[str, str], int] = {}  # (mfc, key) -> samples reported
        new_seqlens: dict[str, dict[str, list[int]]] = {}  # key -> sample -> seqlens
        for rid, (mfc, w) in run_reqs.items():
            reply = replies[rid]
            if reply.get("outputs") is not None:
                self._record_outputs(mfc, w, reply["outputs"], new_seqlens, reported)
            if reply.get("stats"):
                stats.setdefault(mfc.name, []).append(reply["stats"])
        ids = batch.ids
        for key, per_sample in new_seqlens.items():  # the batch's metadata learns the new keys
            if len(per_sample) >= len(ids) and all(map(per_sample.__contains__, ids)):
                batch.seqlens[key] = list(map(per_sample.__getitem__, ids))
                batch.data[key] = None
        results = {mfc.name: _mean_stats(stats[mfc.name]) if mfc.name in stats else {} for mfc in mfcs}
        for rid, (name, phase) in hook_reqs.items():  # the slowest participant of each MFC's pre / post hooks
            seconds = float(replies[rid]["seconds"])
            mfc_results = results[name]
            mfc_results[f"hooks_{phase}_s"] = max(mfc_results.get(f"hooks_{phase}_s", 0.0), seconds)
        for mfc in mfcs:
            if mfc.interface_type is ModelInterfaceType.TRAIN_STEP:
                continue
            for key in mfc.output_keys:
                if reported.get((mfc.name, key), 0) >= len(ids):
                    continue  # dp ranks report disjoint samples: all of them were reported
                missing = self.holders.unheld(ids, key)
                if missing:
                    raise MasterError(f"MFC '{mfc.name}' did not produce key '{key}' for {len(missing)} samples "
                                      f"(e.g. {missing[0]})")
        return results

    def _send_hooks(self, mfc: MFCDef, phase: str) -> dict[int, tuple[str, str]]:
        """Queue the MFC's pre or post hooks on the workers that take part in each.

        Requests are sent in one global order and every worker serves its requests in
        arrival order, so the collectives inside hooks line up with each other and with
        the MFCs around them; nothing waits here.
        """
        hooks = (self.plan.pre_hooks if phase == "pre" else self.plan.post_hooks).get(mfc.name, ())
        rids = {}
        for i, h in enumerate(hooks):
            src_role = getattr(h, "src_role", getattr(h, "role", mfc.model_name))
            payload = {"mfc": mfc.name, "phase": phase, "i": i, "version": self.role_version[src_role]}
            for w in ModelStore.participants(h):
                rids[self._request(w, "hook", payload, self.setup.mfc_timeout_s)] = (mfc.name, phase)
        return rids

    def _record_outputs(self, mfc: MFCDef, worker: int, wire: Any, new_seqlens: dict[str, dict[str, list[int]]],
                        reported: dict[tuple[str, str], int]) -> None:
        """Note that ``worker`` now holds the output keys it reported (metadata of its reply).

        Only ids and key names are needed here, so the reply is checked for shape rather
        than rebuilt into a SequenceBatch (this runs once per MFC per dp head, per step).
        Tensor keys' sizes go into ``new_seqlens``, the samples reported per key into ``reported``.
        """
        try:
            ids, seqlens = wire["ids"], wire["seqlens"]
            keys = [*seqlens, *wire["metadata"]]
            if set(map(type, ids)) - {str}:
                raise TypeError("non-str sample id")
        except (KeyError, TypeError) as e:
            raise MasterError(f"MFC '{mfc.name}': worker {self.workers[worker]} returned malformed "
                              f"output metadata ({e!r})") from None
        self.holders.add(ids, keys, worker)
        for key, lens in seqlens.items():  # sizes of new keys, for token balancing downstream
            per_sample = new_seqlens.get(key)
            if per_sample is None:
                new_seqlens[key] = dict(zip(ids, lens))
            else:
                per_sample.update(zip(ids, lens))
        for key in keys:
            reported[(mfc.name, key)] = reported.get((mfc.name, key), 0) + len(ids)

    def _missing(self, ids: list[str], keys, dest: int) -> dict[tuple[int, tuple[str, ...]], list[str]]:
        """Group the (sample, key) pairs ``dest`` lacks by the worker that will send them."""
        try:
            return self.holders.missing(ids, keys, dest)
        except MissingKeyError as e:
            raise MasterError(str(e)) from None

    def _evaluate(self) -> Optional[dict[str, float]]:
        if self.setup.eval is None:
            return None
        with self.tracer.span("evaluate", step=self.step):
            replies = self._all("evaluate", {}, self.setup.mfc_timeout_s)
        stats = next((r["stats"] for _, r in sorted(replies.items()) if r["stats"]), None)
        if stats:
            self.stats.log(self.step, {f"eval/{k}": v for k, v in stats.items()})
            self.progress.event(f"eval at step {self.step}: " + _fmt(stats))
        return stats

    def _save(self, tag: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for role in self.setup.train_roles():
            path = ensure_inside(os.path.join(self.setup.run_dir, "checkpoints", role, tag),
                                 output_root(self.setup.run_dir), f"checkpoint of {role!r}")
            workers = list(self.plan.role_home[role].workers)
            with self.tracer.span(f"save:{role}"):
                self._all("save", {"role": role, "path": path}, self.setup.mfc_timeout_s, workers=workers)
            out[role] = path
            self.progress.event(f"saved {role} checkpoint: {path}")
        if out:
            self.last_good["checkpoint"] = f"{', '.join(out.values())} (step {self.step})"
        return out

    def _nonfinite_stop(self, e: RemoteError) -> Optional[MasterError]:
        """A worker's non-finite train step as the run's one-line error: the step, the worker's
        words (MFC, model, micro-batch, samples) and the last good state; None for other errors."""
        lines = [ln.strip() for ln in e.remote_traceback.strip().splitlines() if ln.strip()]
        marker = "NonFiniteError: "
        if not lines or marker not in lines[-1]:
            return None
        good = "; ".join(f"last good {k}: {v}" for k, v in self.last_good.items()) or \
            "no checkpoint or recover point was written before it"
        return MasterError(f"step {self.step}: {lines[-1].split(marker, 1)[1]} ({e.worker}); nothing is saved after "
                           f"a non-finite step; {good}")


def _batch_size(mfcs: list[MFCDef]) -> int:
    sizes = {m.n_seqs for m in mfcs}
    if len(sizes) != 1:
        detail = ", ".join(f"{m.name}={m.n_seqs}" for m in mfcs)
        raise MasterError(f"all MFCs of a graph must use the same batch size (n_seqs): {detail}")
    return sizes.pop()


def _mean_stats(items: list[dict]) -> dict[str, float]:
    if not items:
        return {}
    keys = set().union(*items)
    return {k: sum(float(d[k]) for d in items if k in d) / sum(1 for d in items if k in d) for k in keys}


def _fmt(stats: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(stats.items()))
