"""Model worker: holds model shards and sample tensors, runs MFCs on request.

A worker is a plain request handler. The master tells it what to do (fetch data,
stage tensors for a peer, run an MFC, evaluate, save); it never decides on its own,
which keeps every collective in the same order on every worker: requests are served
one at a time, in arrival order, and the master sends them in one global order.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from realflow.api.backend import NonFiniteError
from realflow.api.batch import SequenceBatch
from realflow.api.engine import has_adapters
from realflow.data.source import load_dataset_shard
from realflow.api.experiment import ExperimentSetup
from realflow.api.interface import make_interface
from realflow.api.mfc import MFCDef, ModelInterfaceType
from realflow.base import names
from realflow.base.devices import distributed_backend, select_device
from realflow.base.fault_injection import fault_point
from realflow.base.logging import get_logger
from realflow.base.network import host_address, interface_of
from realflow.base.output_paths import ensure_inside, output_root
from realflow.base.seeding import get_rng_state_plain, set_rng_state_plain, set_seed
from realflow.base.trace import Tracer
from realflow.comm import shm
from realflow.comm.rpc import ReplyThen
from realflow.comm.tcp_store import host_tcp_store
from realflow.system.data_manager import DataManager
from realflow.system import recover
from realflow.system.data_stream import ShardStream
from realflow.system.model_store import ModelStore
from realflow.system.plan import ExecutionPlan
from realflow.system.mismatch_dumper import MismatchDumper
from realflow.system.sample_log import TrainSampleLog, samples_dir
from realflow.system.trajectory_inbox import TrajectoryInbox
from realflow.weights.publisher import WeightPublisher

logger = get_logger("model_worker")


@dataclass
class _MFCCall:
    """What running one MFC on this worker needs, resolved once (not per call: dispatch is latency-bound)."""

    mfc: MFCDef
    model: Any
    iface: Any
    fn: Any  # the bound generate/inference method (None for train_step)
    is_train: bool
    is_head: bool  # this worker reports the dp rank's outputs
    type_name: str  # interface type, for the trace
    layout: str = ""  # the MFC's parallel layout, e.g. d2t1p1 (for the mismatch dump)
    is_first_head: bool = False  # the head of data-parallel rank 0


class ModelWorker:
    def __init__(self, setup: ExperimentSetup, plan: ExecutionPlan, index: int, resolver, on_finish=None,
                 secret: bytes | None = None):
        self.setup = setup
        self.plan = plan
        self.index = index
        self.name = names.model_worker_name(index)
        self.resolver = resolver
        self.data = DataManager(self.name, shm.segment_prefix(setup.experiment_name, setup.trial_name))
        self.store = ModelStore(setup, plan, index)
        self.interfaces: dict[str, Any] = {}
        self.train_stream: ShardStream | None = None
        self.eval_batch: SequenceBatch | None = None
        self.tracer = Tracer(self.name, enabled=setup.trace)
        self.sample_log = TrainSampleLog(samples_dir(setup.run_dir), setup.log_samples, self._tokenizer_of) \
            if setup.log_samples else None
        self.mismatch_dumper = MismatchDumper(setup, setup.mismatch_dump_every, setup.mismatch_dump_samples) \
            if setup.mismatch_dump_every else None
        self.on_finish = on_finish
        self._calls: dict[str, _MFCCall] = {}  # per MFC name, filled on its first run
        self.inbox: TrajectoryInbox | None = None
        self._publisher: WeightPublisher | None = None  # for publish_weights (asynchronous runs)
        self._store_socket: socket.socket | None = None  # worker 0: the rendezvous store's listener
        if setup.rollout is not None:  # asynchronous PPO: rollouts arrive here, not from a data set
            if secret is None:
                raise ValueError("an asynchronous run's model worker needs the experiment secret")
            self.inbox = TrajectoryInbox(self.name, secret)
            resolver.add(names.trajectory_inbox_address(setup.experiment_name, setup.trial_name, index),
                         self.inbox.address, replace=True)

    # ---- handlers ---------------------------------------------------------------
    def handlers(self) -> dict[str, Any]:
        return {
            "load_data": self.load_data,
            "setup": self.setup_models,
            "fetch": self.fetch,
            "stage": self.stage,
            "run_mfc": self.run_mfc,
            "hook": self.hook,
            "evaluate": self.evaluate,
            "save": self.save,
            "save_recover": self.save_recover,
            "load_recover": self.load_recover,
            "drop": self.drop,
            "spread": self.spread,
            "finish": self.finish,
            "peek_trajectories": self.peek_trajectories,
            "take_trajectories": self.take_trajectories,
            "publish_weights": self.publish_weights,
            "describe": lambda payload: {"host": socket.gethostname(), "worker": self.name},
            "ping": lambda payload: {"worker": self.name},
        }

    def load_data(self, payload: dict) -> dict:
        """Tokenize this worker's shard of the training data (and of the eval data)."""
        return {"worker": self.name, "n_train_samples": self._load_data()}

    def setup_models(self, payload: dict) -> dict:
        """Join the world group, create every layout's groups, build this worker's models.

        ``payload["total_train_steps"]`` is known only once the master has counted the
        data, and sizes the learning-rate schedule of every trained model.
        """
        t0 = time.perf_counter()
        self._init_distributed()
        set_seed(self.setup.seed, self.index)
        self.store.build(int(payload["total_train_steps"]), _load_tokenizer)
        for mfc in self.setup.mfcs:
            self.interfaces[mfc.name] = make_interface(mfc.interface_impl, **mfc.interface_args)
        if self.setup.eval is not None:
            ev = self.setup.eval
            self.interfaces["__eval__"] = make_interface(ev.interface_impl, **ev.interface_args)
        held = sorted(f"{r}@{lay.short()}" for r, lay in self.store.models)
        logger.info(f"{self.name} ready in {time.perf_counter() - t0:.1f}s: models={held}")
        return {"worker": self.name}

    def fetch(self, payload: dict) -> dict:
        """Take the next ``n`` samples of this worker's shard; keep tensors, return metadata."""
        assert self.train_stream is not None
        batch, epoch_done = self.train_stream.next(int(payload["n"]))
        if batch is None:
            return {"batch": None, "epoch_done": epoch_done}
        self.data.put(batch)
        return {"batch": batch.meta().to_wire(), "epoch_done": epoch_done}

    def peek_trajectories(self, payload: dict) -> list[dict]:
        """The rollouts waiting in this worker's inbox (ids and versions; asynchronous runs)."""
        return [] if self.inbox is None else self.inbox.peek()

    def take_trajectories(self, payload: dict) -> dict:
        """Move the master's pick from the inbox into the data manager; return their metadata."""
        assert self.inbox is not None, "not an asynchronous run"
        batch = self.inbox.take(payload["ids"])
        self.data.put(batch)
        return {"batch": batch.meta().to_wire()}

    def publish_weights(self, payload: dict) -> dict:
        """Export the role's full weights for the generation servers (collective over its home ranks).

        ``mode="memory"``: HF-named tensors in one shared-memory segment, whose handle the
        controller hands to the servers on this host (released after the round; ``shm:
        false`` when there are none), and, when ``group`` names receivers (servers on
        other hosts), a torch.distributed broadcast to them (:mod:`realflow.weights.publisher`);
        ``"disk"``: an HF checkpoint at ``path``. Only the writer (dp 0, tp 0, pp 0) returns
        something. A LoRA model publishes (and saves) its adapters only; servers merge them."""
        role = payload["role"]
        model = self.store.home_model(role)
        with self.tracer.span(f"publish:{role}", version=payload["version"]):
            if payload["mode"] == "disk":
                self._saving_interface(role).save(model, payload["path"])
                return {"path": payload["path"] if self._is_writer(role) else None}
            engine = model.module
            state = engine.adapter_state() if has_adapters(engine) else engine.full_hf_state()
            if state is None:
                return {"handle": None}
            if self._publisher is None:
                self._publisher = WeightPublisher(
                    shm.segment_prefix(self.setup.experiment_name, self.setup.trial_name), host_address())
            return self._publisher.publish(state, payload["version"], payload.get("group"),
                                           payload.get("shm", True), payload.get("delta"))

    def _saving_interface(self, role: str) -> Any:
        """``role``'s train-step interface saves it (not e.g. a LoRA run's reference on the same model)."""
        mfcs = sorted((m for m in self.setup.mfcs if m.model_name == role),
                      key=lambda m: m.interface_type != ModelInterfaceType.TRAIN_STEP)
        return self.interfaces[mfcs[0].name]

    def _is_writer(self, role: str) -> bool:
        return self.plan.role_home[role].workers[0] == self.index

    def stage(self, payload: dict) -> dict:
        with self.tracer.span("stage", n=len(payload["ids"])):
            return self.data.stage(payload["ids"], payload["keys"])

    def run_mfc(self, payload: dict) -> dict:
        call = self._calls.get(payload["mfc"]) or self._prepare_call(payload["mfc"])
        mfc = call.mfc
        handles = payload.get("receive")
        if handles:
            with self.tracer.span(f"receive:{mfc.name}"):
                for handle in handles:
                    self.data.receive(handle)
        batch = self.data.get(payload["ids"], mfc.input_keys)
        batch = batch.remap_keys(mfc.input_key_remap) if mfc.input_key_remap else batch
        step = int(payload.get("step", call.model.version))
        if call.is_train and self.mismatch_dumper is not None and self.mismatch_dumper.wanted(step, batch):
            with self.tracer.span(f"mismatch_dump:{mfc.name}"):  # before the update changes the weights
                self.mismatch_dumper.dump(call, step, batch, writes_samples=call.is_first_head)
        if self.tracer.enabled:
            with self.tracer.span(mfc.name, type=call.type_name, n=len(batch)):
                out = self._call_interface(call, batch)
        else:  # (no span to build: dispatch of short MFCs is latency-bound)
            out = self._call_interface(call, batch)
        if call.is_train:
            if self.sample_log is not None and call.is_head:
                self.sample_log.write(mfc.name, mfc.model_name, step, batch)
            fault_point("train_step")  # (tests only: realflow.base.fault_injection)
            return {"stats": out if call.is_head else None, "outputs": None}
        if out is None:  # tensor/pipeline ranks other than the dp head may return nothing
            if call.is_head:
                raise RuntimeError(f"MFC '{mfc.name}': interface '{mfc.interface_impl}' returned no outputs "
                                   f"on the data-parallel head (worker {self.index})")
            return {"stats": None, "outputs": None}
        if mfc.output_key_remap:
            out = out.remap_keys(mfc.output_key_remap)
        produced = [k for k in mfc.output_keys if k in out.seqlens or k in out.metadata]
        if len(produced) != len(out.seqlens) + len(out.metadata):  # drop what the graph does not ask for
            out = out.select_keys(produced)
        # the reply needs only the outputs' metadata: store them while it travels
        return ReplyThen({"stats": None, "outputs": out.meta_wire() if call.is_head else None},
                         lambda: self.data.put(out))

    @staticmethod
    def _call_interface(call: "_MFCCall", batch: SequenceBatch) -> Any:
        """The interface's outputs (generate/inference) or stats (train_step)."""
        if call.is_train:
            try:
                stats = call.iface.train_step(call.model, batch, call.mfc.mb_spec)
            except NonFiniteError as e:  # the engine knows the micro-batch; this, the MFC and model
                raise NonFiniteError(f"MFC '{call.mfc.name}' of model '{call.mfc.model_name}': {e}") from None
            call.model.version += 1
            return stats
        return call.fn(call.model, batch, call.mfc.mb_spec)

    def _prepare_call(self, name: str) -> "_MFCCall":
        """Resolve once what every call of MFC ``name`` on this worker needs (models exist after setup)."""
        mfc = self.plan.graph.mfc(name)
        layout = self.plan.placements[name].layout
        iface = self.interfaces[name]
        is_train = mfc.interface_type == ModelInterfaceType.TRAIN_STEP
        fn = None if is_train else (iface.generate if mfc.interface_type == ModelInterfaceType.GENERATE
                                    else iface.inference)
        call = _MFCCall(mfc=mfc, model=self.store.model(mfc.model_name, layout), iface=iface, fn=fn,
                        is_train=is_train, is_head=layout.dp_head(layout.coords(self.index)[0]) == self.index,
                        type_name=mfc.interface_type.name, layout=str(layout.strategy),
                        is_first_head=layout.dp_head(0) == self.index)
        self._calls[name] = call
        return call

    def hook(self, payload: dict) -> dict:
        """Run the ``i``-th pre/post hook of an MFC (see :mod:`realflow.system.model_store`)."""
        hooks = (self.plan.pre_hooks if payload["phase"] == "pre" else self.plan.post_hooks)[payload["mfc"]]
        h = hooks[int(payload["i"])]
        with self.tracer.span(f"hook:{payload['phase']}:{payload['mfc']}", hook=str(h)):
            return self.store.run_hook(h, int(payload.get("version", 0)))

    def evaluate(self, payload: dict) -> dict:
        ev = self.setup.eval
        model = None if ev is None else self.store.home_model(ev.role)
        if model is None:
            return {"stats": None}
        self.store.ensure_resident(ev.role, self.plan.role_home[ev.role])
        with self.tracer.span("evaluate"):
            stats = self.interfaces["__eval__"].evaluate(model, self.eval_batch)
        return {"stats": stats}

    def spread(self, payload: dict) -> dict:
        """Per sample, max - min of its values of ``payload["key"]`` (dynamic sampling: 0 = all equal)."""
        batch = self.data.get(payload["ids"], [payload["key"]])
        out = {}
        for i, sid in enumerate(batch.ids):
            vals = torch.cat([t.reshape(-1).float() for t in batch.sequences(payload["key"], i)])
            out[sid] = float(vals.max() - vals.min()) if vals.numel() else 0.0
        return {"spread": out}

    def save(self, payload: dict) -> dict:
        role = payload["role"]
        model = self.store.home_model(role)
        if model is None:
            return {"path": None}
        path = ensure_inside(payload["path"], output_root(self.setup.run_dir), f"checkpoint of {role!r}")
        with self.tracer.span(f"save:{role}"):
            self._saving_interface(role).save(model, path)
        return {"path": path}

    def save_recover(self, payload: dict) -> dict:
        """Write this worker's part of a recover point into ``payload["dir"]``; reply its size and digest.

        Collective-free: every worker writes what it holds (its shards in its own layout).
        The file is written under a temporary name and renamed, then hashed by its writer.
        """
        index = self.index
        name = recover.worker_file_name(index)
        state = {"format": recover.FORMAT, "worker": index, "rng": get_rng_state_plain(),
                 "stream": self.train_stream.state() if self.train_stream is not None else None,
                 "models": self.store.local_state(),
                 "interfaces": {k: iface.state_dict() for k, iface in sorted(self.interfaces.items())}}
        path = ensure_inside(os.path.join(payload["dir"], name), output_root(self.setup.run_dir), "recover point")
        with self.tracer.span("save_recover"):
            torch.save(state, path + ".tmp")
            with open(path + ".tmp", "rb") as f:
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        return {"file": name, "size": os.path.getsize(path), "digest": recover.file_digest(path)}

    def load_recover(self, payload: dict) -> dict:
        """Restore this worker from its file of the recover point (digest checked first)."""
        point = recover.RecoverPoint(payload["path"], int(payload["step"]), {"files": payload["files"]})
        path = recover.RecoverPoints.verify_file(point, self.index)
        with self.tracer.span("load_recover"):
            state = torch.load(path, map_location="cpu", weights_only=True)
            if state.get("worker") != self.index:
                raise recover.RecoverError(f"{path} was written by worker {state.get('worker')}, not {self.index}")
            self.store.load_local_state(state["models"])
            for k, iface_state in state["interfaces"].items():
                if k in self.interfaces:
                    self.interfaces[k].load_state_dict(iface_state)
            if state["stream"] is not None and self.train_stream is not None:
                self.train_stream.load_state(state["stream"])
            set_rng_state_plain(state["rng"])
        return {"worker": self.name}

    def drop(self, payload: dict) -> dict:
        return {"dropped": self.data.drop(payload["ids"])}

    def finish(self, payload: dict) -> dict:
        self.tracer.save(os.path.join(self.setup.run_dir, "trace", f"{self.index}.json"))
        self.data.close()
        if self.inbox is not None:
            self.inbox.close()
        if self._publisher is not None:
            self._publisher.close()
        if self.on_finish is not None:  # stop serving once this reply is sent
            self.on_finish()
        return {"worker": self.name}

    # ---- internals --------------------------------------------------------------
    def _init_distributed(self) -> None:
        """Join the world of all model workers; worker 0 publishes the rendezvous.

        gloo on CPU; on GPUs this worker is bound to its device first and the groups
        carry NCCL for CUDA tensors beside gloo for host ones (realflow.base.devices).
        """
        if dist.is_initialized():
            return
        select_device(self.index)
        key = names.distributed_address(self.setup.experiment_name, self.setup.trial_name)
        timeout = datetime.timedelta(seconds=self.setup.setup_timeout_s)
        if self.index == 0:
            # the rendezvous store listens on our address only, not on every interface
            store, self._store_socket = host_tcp_store(host_address(), self.setup.n_workers, timeout)
            host, port = self._store_socket.getsockname()[:2]
            self.resolver.add(key, f"{host}:{port}", replace=True)
        else:
            host, port = self.resolver.wait(key, timeout=self.setup.setup_timeout_s).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), self.setup.n_workers, False, timeout=timeout)
        if "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo's sockets on our address, not the host name's
            iface = interface_of(host_address())
            if iface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        dist.init_process_group(backend=distributed_backend(), store=store, rank=self.index,
                                world_size=self.setup.n_workers, timeout=timeout)

    def _load_data(self) -> int:
        roles = self.plan.role_home
        spec = next(iter(self.setup.models.values()))
        tokenizer = _load_tokenizer(spec.tokenizer_path or spec.path)
        samples = []
        if self.setup.rollout is None:  # (asynchronous runs train on the rollouts' stream instead)
            samples = load_dataset_shard(self.setup.dataset, tokenizer, self.index, self.setup.n_workers)
            self.train_stream = ShardStream(samples, seed=self.setup.seed + self.index)
        ev = self.setup.eval
        if ev is not None and self.index in roles[ev.role].workers:
            layout = roles[ev.role]
            dp_rank = layout.coords(self.index)[0]
            self.eval_batch = SequenceBatch.gather(
                load_dataset_shard(ev.dataset, tokenizer, dp_rank, layout.strategy.dp)
            )
        return len(samples)


    def _tokenizer_of(self, model_name: str):
        """The model's tokenizer for the sample log's text, or None (the ids are logged regardless)."""
        spec = self.setup.models.get(model_name)
        try:
            return None if spec is None else _load_tokenizer(spec.tokenizer_path or spec.path)
        except Exception as e:  # noqa: BLE001 - a log never stops a run
            logger.warning(f"log_samples: no tokenizer for model {model_name!r} ({e}); logging token ids only")
            return None


def _load_tokenizer(path: str):
    from realflow.base.tokenizer_loading import load_tokenizer

    return load_tokenizer(path)
