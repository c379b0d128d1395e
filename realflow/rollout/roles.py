"""The rollout side's processes (asynchronous PPO): what each role runs once started.

    python -m realflow.apps.worker --role gen_server|rollout_controller|rollout_worker \
        --index I --experiment NAME [--import MODULE ...] -- key=value ...

(:mod:`realflow.apps.worker` is the one process entry point of every role.) Like the
trainer's processes (:mod:`realflow.system.roles`), each rebuilds the
experiment from the same command line, finds its peers through name resolution and
authenticates with the experiment secret (a 0600 file named by ``REALFLOW_SECRET_FILE``): HTTP services check a
bearer token derived from it, ZMQ messages are signed with it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Optional

from realflow.api.experiment import ExperimentSetup, experiment_registry
from realflow.base import names
from realflow.base.name_resolve import NameNotFound, make_name_resolver
from realflow.base.network import host_address
from realflow.comm.auth import http_token
from realflow.config.cli import parse_overrides
from realflow.plugins import load_plugins

logger = logging.getLogger("realflow.rollout.main")  # the name its log lines always had

ROLES = ("gen_server", "rollout_controller", "rollout_worker")


SERVER_REJOIN_WAIT_S = 120.0  # while no server is up, wait this long for the launcher's replacement


def rollout_setup(experiment: str, overrides: list[str]) -> ExperimentSetup:
    cfg = parse_overrides(experiment_registry.get(experiment), overrides)
    setup = cfg.setup()
    if setup.rollout is None:
        raise ValueError(f"experiment {experiment!r} has no rollout side (it is not asynchronous)")
    return setup


def run_gen_server(setup: ExperimentSetup, index: int, secret: bytes) -> int:
    from realflow.api.generation import BackendConfig, generation_backends
    from realflow.base.devices import resolve_precision, select_device
    from realflow.rollout.gen_server import GenServer, build_app, serve
    from realflow.rollout.request_log import RequestLog
    from realflow.system.sample_log import samples_dir

    spec = setup.rollout
    assert spec is not None
    load_plugins(spec.backend_imports, kinds=("generation",))
    # on one GPU host the model workers take GPUs 0..n_workers-1, the servers the ones after
    # (LOCAL_RANK / SLURM_LOCALID, where a scheduler sets them, win)
    select_device(setup.n_workers + index)
    precision = resolve_precision(setup.generation_precision())
    cfg = BackendConfig(model_path=spec.model_path, tokenizer_path=spec.tokenizer_path,
                        max_running_requests=spec.max_running_requests, seed=spec.seed * 1000 + index,
                        max_model_len=spec.max_model_len, gpu_memory_utilization=spec.gpu_memory_utilization,
                        enforce_eager=spec.enforce_eager, kv_block_size=spec.kv_block_size,
                        prefix_sharing=spec.prefix_sharing,
                        dtype="bfloat16" if precision == "bf16" else "float32", lora=spec.lora)
    backend = generation_backends.get(spec.backend)(cfg)
    resolver = make_name_resolver(setup.name_resolve_config())
    key = names.gen_server_address(setup.experiment_name, setup.trial_name, index)
    server = GenServer(backend, spec.model_path, spec.server_limits)
    log = None
    if setup.log_samples:  # beside the trainer's (realflow.system.sample_log): the same ids, compared
        log = RequestLog(os.path.join(samples_dir(setup.run_dir), f"gen_server_{index}.jsonl"), setup.log_samples,
                         backend.decode)
    host = host_address()
    asyncio.run(serve(build_app(server, http_token(secret), bind_host=host, request_log=log), host, 0,
                      on_ready=lambda url: resolver.add(key, url, replace=True)))
    return 0


def _resume_state(setup: ExperimentSetup) -> Optional[dict]:
    """The rollout part of the recover point the master resumes from (the same one: the master
    writes the next point only after rollouts from this controller were trained)."""
    from realflow.system.recover import RecoverPoints

    point = RecoverPoints(setup).resume_point()
    if point is None:
        return None
    master = point.meta["master"]
    logger.info("resuming the rollout side from the recover point of step %d: %d prompts handed out, %d "
                "of them to hand out again", point.step, master["rollout"]["next_index"],
                len(master["rollout"]["pending"]))
    return {**master["rollout"], "consumed": master["consumed"]}


def _wait_servers(setup: ExperimentSetup, resolver: Any) -> list[str]:
    spec = setup.rollout
    assert spec is not None
    urls = []
    for i in range(spec.n_servers):
        key = names.gen_server_address(setup.experiment_name, setup.trial_name, i)
        try:
            urls.append(resolver.wait(key, timeout=setup.setup_timeout_s))
        except TimeoutError:
            raise TimeoutError(f"gen_server/{i} did not publish its address within {setup.setup_timeout_s:.0f}s "
                               f"(see its log)") from None
    return urls


def run_controller(setup: ExperimentSetup, secret: bytes) -> int:
    from aiohttp import web

    from realflow.comm.heartbeat import Heartbeater
    from realflow.comm.rpc import WorkerEndpoint
    from realflow.rollout.controller import RolloutController, build_controller_app, master_handlers

    spec = setup.rollout
    assert spec is not None
    resolver = make_name_resolver(setup.name_resolve_config())
    exp, trial = setup.experiment_name, setup.trial_name
    urls = _wait_servers(setup, resolver)
    token = http_token(secret)
    stop = threading.Event()

    async def main() -> None:
        async def lookup_server(i: int) -> Optional[str]:
            key = names.gen_server_address(exp, trial, i)
            try:
                return await asyncio.to_thread(resolver.get, key)
            except NameNotFound:
                return None

        restarts = setup.recover.mode == "auto" and setup.recover.retries > 0  # see launch.worker_requests
        ctl = RolloutController(spec, urls, token, resume=_resume_state(setup), lookup_server=lookup_server,
                                rejoin_wait_s=SERVER_REJOIN_WAIT_S if restarts else 0.0)
        await ctl.start()
        runner = web.AppRunner(build_controller_app(ctl, token), access_log=None)
        await runner.setup()
        host = host_address()  # loopback unless a cluster job (REALFLOW_CLUSTER=1)
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        resolver.add(names.rollout_controller_address(exp, trial), f"http://{host}:{port}", replace=True)
        logger.info("rollout controller serving on port %d for %d gen servers", port, len(urls))
        loop = asyncio.get_running_loop()
        master = await asyncio.to_thread(resolver.wait, names.master_address(exp, trial),
                                         timeout=setup.setup_timeout_s)
        hb = await asyncio.to_thread(resolver.wait, names.heartbeat_address(exp, trial),
                                     timeout=setup.setup_timeout_s)
        beat = Heartbeater(names.ROLLOUT_CONTROLLER, hb, secret, setup.heartbeat_interval_s).start()
        endpoint = WorkerEndpoint(names.ROLLOUT_CONTROLLER, master, secret)
        rpc = threading.Thread(target=endpoint.serve, args=(master_handlers(ctl, loop), stop),
                               name="master-rpc", daemon=True)
        rpc.start()
        try:
            while not stop.is_set():  # until SIGTERM from the launcher (a service)
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.to_thread(rpc.join, 5.0)
            beat.stop()
            endpoint.close()
            await runner.cleanup()
            await ctl.close()

    asyncio.run(main())
    return 0


def run_rollout_worker(setup: ExperimentSetup, index: int, secret: bytes, imports: list[str]) -> int:
    from realflow.base.tokenizer_loading import load_tokenizer
    from realflow.comm.heartbeat import Heartbeater
    from realflow.rollout.rollout_worker import RolloutWorker

    spec = setup.rollout
    assert spec is not None
    resolver = make_name_resolver(setup.name_resolve_config())
    exp, trial = setup.experiment_name, setup.trial_name
    ctl_url = resolver.wait(names.rollout_controller_address(exp, trial), timeout=setup.setup_timeout_s)
    inboxes = {w: resolver.wait(names.trajectory_inbox_address(exp, trial, w), timeout=setup.setup_timeout_s)
               for w in range(setup.n_workers)}
    hb = resolver.wait(names.heartbeat_address(exp, trial), timeout=setup.setup_timeout_s)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    name = names.rollout_worker_name(index)
    beat = Heartbeater(name, hb, secret, setup.heartbeat_interval_s).start()
    try:
        worker = RolloutWorker(setup, index, secret, ctl_url, inboxes, http_token(secret), tokenizer,
                               imports=imports)
        asyncio.run(worker.run())
        logger.info("%s: %d rollouts pushed, %d failed", name, worker.n_ok, worker.n_failed)
    finally:
        beat.stop()
    return 0
