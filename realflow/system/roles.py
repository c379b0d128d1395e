"""The trainer's processes: what the master and each model worker run once started.

    python -m realflow.apps.worker --role master|model_worker --index I \
        --experiment NAME [--import MODULE ...] -- key=value ...

(:mod:`realflow.apps.worker` is the one process entry point of every role.) Each process rebuilds the experiment from the same command line (nothing is
pickled between processes), finds its peers through name resolution, and talks to
them over authenticated ZMQ sockets (secret from the file named by ``REALFLOW_SECRET_FILE``).
"""
from __future__ import annotations

import threading

from realflow.api.experiment import ExperimentSetup, experiment_registry
from realflow.base import names
from realflow.base.logging import get_logger
from realflow.base.name_resolve import make_name_resolver
from realflow.config.cli import parse_overrides
from realflow.system.plan import compile_plan

logger = get_logger("worker_main")


def build_setup(experiment: str, overrides: list[str]) -> tuple[object, ExperimentSetup]:
    cls = experiment_registry.get(experiment)
    cfg = parse_overrides(cls, overrides)
    return cfg, cfg.setup()


def resolver_for(setup: ExperimentSetup):
    return make_name_resolver(setup.name_resolve_config())


def run_master(setup: ExperimentSetup, secret: bytes) -> int:
    from realflow.comm.heartbeat import HeartbeatMonitor
    from realflow.comm.rpc import MasterEndpoint
    from realflow.system.async_master import AsyncMaster
    from realflow.system.master import Master

    plan = compile_plan(setup)
    resolver = resolver_for(setup)
    endpoint = MasterEndpoint(secret)
    monitor = HeartbeatMonitor(secret, timeout=setup.heartbeat_timeout_s)
    key = names.master_address(setup.experiment_name, setup.trial_name)
    resolver.add(key, endpoint.address, replace=True)
    resolver.add(names.heartbeat_address(setup.experiment_name, setup.trial_name), monitor.address, replace=True)
    cls = Master if setup.rollout is None else AsyncMaster
    if setup.rollout is not None:  # the rollout side's long-lived processes must keep beating
        monitor.expect([names.ROLLOUT_CONTROLLER])
    master = cls(setup, plan, endpoint, lost_workers=monitor.lost_workers)
    try:
        summary = master.run()
        logger.info(f"run finished: {summary}")
        return 0
    except Exception as e:  # report one line naming the culprit, keep the traceback in the log
        logger.exception("run failed")
        master.progress.error(one_line_error(e), fault=is_fault(e))
        try:  # flushed, and a W&B run marked failed before a relaunch resumes it
            master.stats.close(failed=True)
        except Exception:
            logger.exception("closing the stats sinks failed")
        return 1
    finally:
        monitor.close()
        endpoint.close()


def is_fault(e: BaseException) -> bool:
    """A lost, unreachable or unresponsive process (a relaunch may fix it), not an error that
    the experiment's code would raise again."""
    from realflow.comm.rpc.common import RequestTimeout, WorkersMissing, WorkerUnreachable
    from realflow.system.master import WorkerLost

    return isinstance(e, (WorkerLost, WorkerUnreachable, RequestTimeout, WorkersMissing))


def one_line_error(e: BaseException) -> str:
    """The culprit of a failed run in one line (a worker's traceback is left to the logs)."""
    from realflow.comm.rpc import RemoteError

    if isinstance(e, RemoteError):
        lines = [ln for ln in e.remote_traceback.strip().splitlines() if ln.strip()]
        return f"{e.worker} failed in '{e.handler}': {lines[-1].strip() if lines else 'unknown error'}"
    return f"{type(e).__name__}: {e}".splitlines()[0]


def run_model_worker(setup: ExperimentSetup, index: int, secret: bytes) -> int:
    from realflow.comm.heartbeat import Heartbeater
    from realflow.comm.rpc import WorkerEndpoint
    from realflow.system.model_worker import ModelWorker

    plan = compile_plan(setup)
    resolver = resolver_for(setup)
    name = names.model_worker_name(index)
    exp, trial = setup.experiment_name, setup.trial_name
    master_addr = resolver.wait(names.master_address(exp, trial), timeout=setup.setup_timeout_s)
    hb_addr = resolver.wait(names.heartbeat_address(exp, trial), timeout=setup.setup_timeout_s)
    beat = Heartbeater(name, hb_addr, secret, setup.heartbeat_interval_s).start()
    endpoint = WorkerEndpoint(name, master_addr, secret)
    stop = threading.Event()
    worker = ModelWorker(setup, plan, index, resolver, on_finish=stop.set, secret=secret)
    try:
        endpoint.serve(worker.handlers(), stop)
        return 0
    finally:
        beat.stop()
        endpoint.close()
