"""The master of an asynchronous run: the same step loop, fed by a trajectory stream.

What changes from :class:`~realflow.system.master.Master`:

* a step's batch is not fetched from a data set but picked from the rollouts buffered
  in the model workers' trajectory inboxes, oldest first, under the exact staleness
  rule of :mod:`realflow.system.staleness` (the counts come from the rollout
  controller, which is an RPC worker of this master named ``rollout_controller``);
* after each step the new weights of the policy are published (shared memory, or a
  checkpoint with ``weight_sync=disk``) and the controller runs a weight-update round
  while the next step starts;
* each step logs off-policyness, buffer size, admissions, throughputs and the last
  weight-update round's time (``async/*`` stats).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from realflow.api.batch import SequenceBatch
from realflow.api.rollout import RolloutSpec
from realflow.base import names
from realflow.base.logging import get_logger
from realflow.system.master import Master, MasterError, WorkerLost
from realflow.system.staleness import Candidate, check_bound, outstanding_per_version, select_batch
from realflow.weights.version import PublishError, publish_request, writer_reply

logger = get_logger("async_master")

POLL_S = 0.02  # between looks at the buffers while a step waits for rollouts
WAIT_REPORT_S = 30.0  # a step waiting this long says what it waits for


class AsyncMaster(Master):
    def __init__(self, *args: Any, policy_role: str = "actor", **kw: Any) -> None:
        super().__init__(*args, **kw)
        assert self.setup.rollout is not None
        self.spec: RolloutSpec = self.setup.rollout
        self.policy_role = policy_role
        self.controller = names.ROLLOUT_CONTROLLER
        self.consumed: dict[int, int] = defaultdict(int)
        self._last_counts: dict[str, Any] = {}
        self._t_last = 0.0
        self._tokens_last = 0
        self._busy_last = 0.0
        self._trained = 0
        self._t_train0 = 0.0
        self._writer_host: str | None = None
        self._weight_bytes: dict | None = None  # the last publish's {"sent", "full"} (async/weight_* stats)
        self._refreshed = -1  # the version last published again for a replaced server

    # ---- hooks of Master.run ---------------------------------------------------------
    def _connect(self) -> None:
        self.ep.wait_for_workers(self.workers + [self.controller], timeout=self.setup.setup_timeout_s)

    def _total_steps(self, n_train: int) -> int:
        if self.setup.max_train_steps is None:
            raise MasterError("an asynchronous run needs max_train_steps (its data is a stream)")
        return self.setup.max_train_steps

    def _before_training(self) -> None:
        if self.resume_from is not None:  # the servers start from the initial weights: bring them up to date
            self._publish(self.role_version[self.policy_role])
        self._t_last = self._t_train0 = time.perf_counter()

    # ---- recover points: the consumed counts and the rollout side's data position ----------------
    def _recover_state(self) -> dict[str, Any]:
        state = super()._recover_state()
        state["consumed"] = {str(v): n for v, n in self.consumed.items()}
        state["rollout"] = self.ep.call(self.controller, "data_state", {}, timeout=60.0)
        return state

    def _load_recover_state(self, state: dict[str, Any]) -> None:
        super()._load_recover_state(state)
        self.consumed.update({int(v): int(n) for v, n in state["consumed"].items()})

    def _after_step(self, stats: dict[str, float]) -> dict[str, float]:
        version = self.role_version[self.policy_role]
        t0 = time.perf_counter()
        self._publish(version)
        out = {"async/publish_s": time.perf_counter() - t0, "async/version": float(version)}
        wb, self._weight_bytes = self._weight_bytes, None
        if wb and wb.get("full"):  # memory sync: the bytes this version travelled as (delta or full)
            out.update({"async/weight_sent_bytes": float(wb["sent"]), "async/weight_full_bytes": float(wb["full"]),
                        "async/weight_sent_frac": wb["sent"] / wb["full"]})
        c = self._counts()
        now = time.perf_counter()
        dt = max(now - self._t_last, 1e-9)
        self._trained += self.batch_size
        out.update({
            "async/gen_tokens_per_s": (c["tokens_generated"] - self._tokens_last) / dt,
            "async/trained_samples_per_s": self.batch_size / dt,
            # busy fractions: servers stepping their engines (from their metrics, probed every
            # health interval), and the trainer running MFCs, over the step's wall time
            "async/gen_busy_frac": (c["gen_busy_s"] - self._busy_last) / (dt * max(c["n_servers"], 1)),
            "async/train_busy_frac": sum(v for k, v in stats.items()
                                         if k.startswith("time/") and k not in ("time/step", "time/fetch")) / dt,
            "async/trained_samples_per_s_cum": self._trained / max(now - self._t_train0, 1e-9),
            "async/admitted": float(sum(c["admitted"].values())),
            "async/refused": float(c["refused"]),
            "async/filtered_groups": float(c.get("filtered", 0)),
            "async/agent_errors": float(c["agent_errors"]),
            "async/agent_timeouts": float(c.get("agent_timeouts", 0)),
            "async/running": float(c["running"]),
            "async/failovers": float(c["failovers"]),
            "async/weight_update_s": c["round_times"][-1] if c["round_times"] else 0.0,
            "async/gen_stall_s": c["stall_times"][-1] if c.get("stall_times") else 0.0,
            "async/weight_rounds": float(c["rounds"]),
        })
        self._t_last, self._tokens_last, self._busy_last = now, c["tokens_generated"], c["gen_busy_s"]
        return out

    def _after_training(self) -> dict[str, Any]:
        c = self._counts()
        self.ep.call(self.controller, "finish", {}, timeout=60.0)
        times = c["round_times"]
        return {"weight_rounds": c["rounds"], "agent_errors": c["agent_errors"],
                "rollout_data": self.ep.call(self.controller, "data_state", {}, timeout=60.0),
                "mean_weight_update_s": sum(times) / len(times) if times else None,
                "trained_samples_per_s": self._trained / max(time.perf_counter() - self._t_train0, 1e-9)}

    # ---- the trajectory stream -------------------------------------------------------
    def _counts(self) -> dict[str, Any]:
        c = self.ep.call(self.controller, "counts", {}, timeout=60.0)
        if c.get("fatal"):
            raise MasterError(f"rollout side failed: {c['fatal']}")
        for k in ("admitted", "failed", "finished"):
            c[k] = {int(v): n for v, n in c[k].items()}
        self._last_counts = c
        return c

    def _fetch_batch(self) -> SequenceBatch:
        """Wait until the staleness rule lets this step take ``batch_size`` buffered rollouts."""
        step, eta, B = self.role_version[self.policy_role], self.spec.max_head_offpolicyness, self.batch_size
        t0 = time.monotonic()
        report_at = t0 + WAIT_REPORT_S
        while True:
            self._check_lost()
            c = self._counts()
            if c.get("weights_wanted") and self._refreshed != step:  # a replaced server needs them
                self._refreshed = step
                logger.info(f"a replaced generation server joins: publishing version {step} again")
                self._publish(step)
            cands = [Candidate(r["id"], w, r["admit"], r["oldest"], r["newest"], r["seq"])
                     for w, rows in sorted(self._all("peek_trajectories", {}, 60.0).items()) for r in rows]
            outstanding = outstanding_per_version(c["admitted"], c["failed"], self.consumed)
            chosen = select_batch(cands, outstanding, step, eta, B)
            if chosen is not None:
                break
            now = time.monotonic()
            if now - t0 > self.setup.mfc_timeout_s:
                raise MasterError(self._waiting_for(step, cands, outstanding, c, now - t0))
            if now >= report_at:
                logger.warning(self._waiting_for(step, cands, outstanding, c, now - t0))
                report_at = now + WAIT_REPORT_S
            time.sleep(POLL_S)
        check_bound(chosen, step, eta)
        by_worker: dict[int, list[str]] = defaultdict(list)
        for cand in chosen:
            by_worker[cand.worker].append(cand.id)
            self.consumed[cand.admit] += 1
        self.ep.call(self.controller, "trained", {"ids": [c.id for c in chosen]}, timeout=60.0)
        parts = []
        reqs = {self._request(w, "take_trajectories", {"ids": ids}, 60.0): w for w, ids in by_worker.items()}
        for rid, reply in self._wait(list(reqs), 60.0).items():
            b = SequenceBatch.from_wire(reply["batch"])
            self.holders.add(b.ids, [*b.seqlens, *b.metadata], reqs[rid])
            parts.append(b)
        batch = SequenceBatch.gather(parts)
        self._stage_stats = {
            "async/buffer_size": float(len(cands)),
            "async/offpolicy_head_max": float(max(step - x.oldest for x in chosen)),
            "async/offpolicy_head_mean": sum(step - x.oldest for x in chosen) / len(chosen),
            "async/offpolicy_tail_mean": sum(step - x.newest for x in chosen) / len(chosen),
            "async/wait_s": time.monotonic() - t0,
        }
        return batch

    def _run_step(self) -> dict[str, float]:
        stats = super()._run_step()
        stats.update(self._stage_stats)
        return stats

    def _check_lost(self) -> None:
        lost = self.lost_workers()
        if lost:
            raise WorkerLost(f"worker(s) {sorted(lost)} stopped sending heartbeats")

    def _waiting_for(self, step: int, cands: list[Candidate], outstanding: dict[int, int], c: dict, waited: float
                     ) -> str:
        running = {w: n for w, n in outstanding.items() if n}
        return (f"step {step + 1} has waited {waited:.0f}s for rollouts: {len(cands)} buffered of "
                f"{self.batch_size} needed; outstanding per admission version {running}; {c['running']} "
                f"running on the rollout side; servers {c['servers']}")

    # ---- weights to the servers -----------------------------------------------------
    def _publish(self, version: int) -> None:
        """Have the policy's home workers export version ``version`` and the controller push it
        (:mod:`realflow.weights.version` says what travels)."""
        workers = list(self.plan.role_home[self.policy_role].workers)
        payload = publish_request(self.policy_role, version, self.spec.weight_sync, self.setup.run_dir)
        if payload["mode"] == "memory":  # shared memory for servers on the writer's host, a group for the others
            if self._writer_host is None:
                self._writer_host = self._all("describe", {}, 60.0, workers=workers[:1])[workers[0]]["host"]
            payload.update(self.ep.call(self.controller, "weight_plan", {"writer_host": self._writer_host},
                                        timeout=60.0))
            if not payload["shm"] and not payload.get("group"):  # no server up: a replacement asks later
                logger.warning(f"no generation server is up to receive version {version}; publishing it "
                               "when a replacement joins")
                return
        replies = self._all("publish_weights", payload, self.setup.mfc_timeout_s, workers=workers)
        try:
            update = writer_reply(replies, self.policy_role, version)
        except PublishError as e:
            raise MasterError(str(e)) from None
        self.ep.call(self.controller, "update_weights", {"version": version, "handle": update.handle,
                                                         "path": update.path, "broadcast": update.broadcast,
                                                         "shm_delta": update.shm_delta}, timeout=60.0)
        self._weight_bytes = update.weight_bytes
