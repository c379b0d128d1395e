"""What the runtime needs to know about an experiment, independent of which one it is.

An experiment config (a dataclass in ``experiments/``, with user-facing fields and
defaults) turns itself into an :class:`ExperimentSetup` — the graph, the models, the
data and the allocation. Every process (launcher, master, model workers) rebuilds the
same setup from the same command line, so nothing is pickled and no process needs the
config object of another. The setup must therefore be a pure function of the config.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from realflow.api.deploy import DeploySpec, RayConfig, RecoverSpec, SlurmConfig
from realflow.api.mfc import MFCDef
from realflow.api.model_options import LoRAConfig, MoEConfig, TrainingMemoryConfig
from realflow.api.rollout import RolloutSpec
from realflow.api.registry import Registry
from realflow.base.devices import PRECISIONS
from realflow.base.wandb_sink import WandbConfig


@dataclass
class OptimizerConfig:
    """AdamW with warmup and a decaying schedule; the same fields on every backend."""

    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.98, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    warmup_steps_proportion: float = field(
        default=0.05, metadata={"help": "fraction of total steps spent in linear warmup"}
    )
    lr_scheduler_type: str = field(
        default="cosine", metadata={"help": "after warmup: cosine | linear | constant"}
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr as a fraction of lr"})
    gradient_clipping: float = field(default=1.0, metadata={"help": "max global grad norm (0 = off)"})

    def __post_init__(self) -> None:
        # checked here, where the user sets the values, so a bad override fails before any process starts
        if self.lr_scheduler_type not in ("cosine", "constant", "linear"):
            raise ValueError(f"OptimizerConfig.lr_scheduler_type={self.lr_scheduler_type!r}: "
                             "expected cosine | constant | linear")
        if not 0.0 <= self.warmup_steps_proportion < 1.0:
            raise ValueError("OptimizerConfig.warmup_steps_proportion must be in [0, 1), got "
                             f"{self.warmup_steps_proportion}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio={self.min_lr_ratio} not in [0, 1]")
        # a non-finite value can only poison the run (inf lr -> NaN weights after one step)
        for name in ("lr", "weight_decay", "gradient_clipping", "eps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"OptimizerConfig.{name}={value} must be a finite number >= 0"
                                 + (" (0 = off)" if name == "gradient_clipping" else ""))
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"OptimizerConfig.{name}={value} must be in [0, 1)")


def _check_precision(what: str, value: str) -> None:
    if value not in PRECISIONS:
        raise ValueError(f"{what}={value!r} must be auto, fp32 or bf16")


@dataclass
class ModelSpec:
    """One named model (role): where its weights come from and whether it trains.

    ``path`` is an HF checkpoint directory (config.json + safetensors). ``optimizer``
    is None for roles that are never trained (reference, reward).
    """

    role: str
    path: str
    tokenizer_path: Optional[str] = None
    optimizer: Optional[OptimizerConfig] = None
    backend: str = "megatron"
    total_train_steps: int = 0  # set by the runtime once the data is counted
    backend_args: dict[str, Any] = field(default_factory=dict)
    #: parameters' precision: auto (the run's ``precision``) | fp32 | bf16 (realflow.base.devices)
    precision: str = "auto"
    #: the HF config (as a dict) the checkpoint at ``path`` will have once ``prepare()`` made it,
    #: so that layouts are checked before a slow preparation (e.g. training the SFT start)
    expected_config: Optional[dict[str, Any]] = None
    #: LoRA adapters (``enabled=False``: full fine-tuning) and memory trades of a trained model
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    training: TrainingMemoryConfig = field(default_factory=TrainingMemoryConfig)
    #: mixture-of-experts options (routing replay, aux loss); refused on a dense model
    moe: MoEConfig = field(default_factory=MoEConfig)
    #: vision-language models: the vision tower is not trained (``model.freeze_vision``)
    freeze_vision: bool = False


@dataclass
class DatasetSpec:
    """A data set in a registered format (see ``realflow.data.dataset``)."""

    format: str
    path: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupFilterSpec:
    """Dynamic sampling (DAPO): after the MFC producing ``key`` ran, samples whose values of ``key``
    are all equal (a prompt's responses all right or all wrong: no learning signal) are dropped
    and more samples drawn, up to ``max_extra_rounds`` rounds, until the training batch is full."""

    key: str = "rewards"
    max_extra_rounds: int = 8

    def __post_init__(self) -> None:
        if self.max_extra_rounds < 0:
            raise ValueError(f"max_extra_rounds={self.max_extra_rounds} must be >= 0")


@dataclass
class EvalSpec:
    """Held-out evaluation: the role whose ``evaluate`` runs, on which data, how often."""

    role: str
    dataset: DatasetSpec
    interface_impl: str
    interface_args: dict[str, Any] = field(default_factory=dict)
    freq_steps: int = 0  # 0: only before the first and after the last step


@dataclass
class ExperimentSetup:
    """The complete, process-independent description of a run."""

    experiment_name: str
    trial_name: str
    mfcs: list[MFCDef]
    models: dict[str, ModelSpec]
    dataset: DatasetSpec
    n_workers: int
    allocation: str
    run_dir: str
    total_train_epochs: int = 1
    max_train_steps: Optional[int] = None
    save_freq_steps: int = 0  # 0: only at the end
    eval: Optional[EvalSpec] = None
    seed: int = 1
    name_resolve: dict[str, Any] = field(default_factory=lambda: {"type": "file"})
    worker_threads: int = 1
    setup_timeout_s: float = 600.0
    mfc_timeout_s: float = 1800.0
    heartbeat_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    precision: str = "auto"  # of every model whose own is auto: auto (bf16 on GPUs, fp32 on CPUs) | fp32 | bf16
    group_filter: Optional[GroupFilterSpec] = None  # dynamic sampling (synchronous runs)
    on_nonfinite: str = "stop"  # a train step with a non-finite loss or gradient: stop | skip (its update)
    max_nonfinite_skips: int = 3  # skip mode: consecutive skipped steps before the run stops
    trace: bool = True
    log_samples: int = 0  # the first N samples of each train step / gen server requests -> <run dir>/samples/
    mismatch_dump_every: int = 0  # every N-th actor train step: samples + weights for the mismatch doctor
    mismatch_dump_samples: int = 8  # responses per dump
    deploy: DeploySpec = field(default_factory=DeploySpec)
    recover: RecoverSpec = field(default_factory=lambda: RecoverSpec(mode="off"))
    rollout: Optional["RolloutSpec"] = None  # set: asynchronous PPO (trajectories come from the rollout side)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # W&B beside TensorBoard (mode=disabled: off)
    #: the user-facing experiment config as plain data, attached to the W&B run (empty while W&B is off)
    experiment_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # values a run would accept and then do nothing with (0 epochs, -1 steps) are errors here
        if not isinstance(self.total_train_epochs, int) or self.total_train_epochs < 1:
            raise ValueError(f"total_train_epochs={self.total_train_epochs!r} must be an integer >= 1")
        if self.max_train_steps is not None and self.max_train_steps < 1:
            raise ValueError(f"max_train_steps={self.max_train_steps!r} must be >= 1 (or none: the epochs decide)")
        if self.save_freq_steps < 0:
            raise ValueError(f"save_freq_steps={self.save_freq_steps!r} must be >= 0 (0 = only at the end)")
        if self.eval is not None and self.eval.freq_steps < 0:
            raise ValueError(f"eval_freq_steps={self.eval.freq_steps!r} must be >= 0 (0 = before and after)")
        if self.n_workers < 1:
            raise ValueError(f"n_workers={self.n_workers!r} must be >= 1")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r} must be 'stop' or 'skip'")
        if not isinstance(self.max_nonfinite_skips, int) or self.max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips={self.max_nonfinite_skips!r} must be an integer >= 0")
        _check_precision("precision", self.precision)
        for role, m in self.models.items():
            _check_precision(f"model {role!r} precision", m.precision)

    def model_precision(self, spec: ModelSpec) -> str:
        """A model's precision: its own, else the run's (either may still be ``auto``, which the
        worker resolves for its device: realflow.base.devices.resolve_precision)."""
        return spec.precision if spec.precision != "auto" else self.precision

    def generation_precision(self) -> str:
        """The generator's precision (may be ``auto``): an asynchronous run's ``rollout.precision``, else
        that of the model the servers serve (a synchronous run's generator shares the trainer's weights)."""
        spec = self.rollout
        if spec is not None and spec.precision != "auto":
            return spec.precision
        served = next((m for m in self.models.values() if spec is not None and m.path == spec.model_path), None)
        return self.model_precision(served) if served else self.precision

    def name_resolve_config(self) -> dict[str, Any]:
        """The name-resolution config every process of this run uses (the file backend
        defaults to a directory inside the run directory)."""
        import os

        conf = dict(self.name_resolve)
        if conf.get("type", "file") == "file" and not conf.get("root"):
            conf["root"] = os.path.join(self.run_dir, "name_resolve")
        return conf

    def train_roles(self) -> list[str]:
        return sorted(r for r, m in self.models.items() if m.optimizer is not None)

    def replace(self, **kw: Any) -> "ExperimentSetup":
        return dataclasses.replace(self, **kw)


@dataclass
class NameResolveConfig:
    """Where processes of a run find each other."""

    type: str = field(default="file", metadata={"help": "file | etcd | redis"})
    root: str = field(default="", metadata={"help": "file backend directory ('' = <run dir>/name_resolve)"})
    host: str = field(default="127.0.0.1", metadata={"help": "etcd or redis host"})
    port: int = field(default=0, metadata={"help": "etcd or redis port (0 = the backend's default: 2379 etcd, 6379 redis)"})

    def __post_init__(self) -> None:
        if self.type not in ("file", "etcd", "redis"):
            raise ValueError(f"name_resolve.type={self.type!r} is not a backend; choose file, etcd or redis")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"name_resolve.port={self.port} is not a port (0 = the backend's default)")


@dataclass
class BaseExperimentConfig:
    """Fields every experiment has; subclasses add models, data and hyper-parameters.

    Subclasses implement :meth:`setup` (pure: config -> :class:`ExperimentSetup`) and
    may implement :meth:`prepare` (run once in the launcher before any worker starts,
    e.g. to create a data set or an initial checkpoint).
    """

    experiment_name: str = field(default="", metadata={"help": "name of the run ('' = the experiment's name)"})
    trial_name: str = field(default="trial0", metadata={"help": "trial of the run; scopes files and names"})
    fileroot: str = field(default="outputs", metadata={"help": "directory for runs, checkpoints and logs"})
    seed: int = field(default=1, metadata={"help": "global seed"})
    n_workers: int = field(default=2, metadata={"help": "number of model worker processes"})
    allocation: str = field(default="", metadata={
        "help": "parallel strategy, e.g. d2 ('' = dN over all workers; auto = the planner's best for this machine)"})
    worker_threads: int = field(default=1, metadata={"help": "torch threads per model worker process"})
    trace: bool = field(default=True, metadata={"help": "write a Perfetto/Chrome timeline trace per process"})
    log_samples: int = field(default=0, metadata={
        "help": "the first N samples of every train step (token ids, decoded prompt and answer, reward) and "
                "the first N requests each generation server answers, to <run dir>/samples/*.jsonl: what the "
                "model really saw (0 = off)"})
    mismatch_dump_every: int = field(default=0, metadata={
        "help": "every N-th train step of a model with behaviour log-probs (the actor), before it updates, "
                "writes mismatch_dump_samples responses and the weights to <run dir>/mismatch/step_N/ for "
                "`realflow doctor mismatch RUN_DIR` (0 = off; each dump is a full HF checkpoint)"})
    mismatch_dump_samples: int = field(default=8, metadata={"help": "responses per mismatch dump"})
    precision: str = field(default="auto", metadata={
        "help": "model parameters and generation: auto = bf16 on GPUs (fp32 master weights and gradients in "
                "the optimizer), fp32 on CPUs | fp32 | bf16"})
    name_resolve: NameResolveConfig = field(default_factory=NameResolveConfig)
    launcher: str = field(default="local", metadata={"help": "local | slurm | ray: where the processes run"})
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    heartbeat_timeout_s: float = field(default=10.0, metadata={
        "help": "a process of the run silent this long is declared lost and the run stops or relaunches "
                "(a stopped or frozen worker is named within this; must exceed 2 heartbeat intervals). "
                "10 s: on a host with several busy workers per core a live process can go unscheduled "
                "for seconds (seen at load 5 on 2 cores with 3 s)"})
    heartbeat_interval_s: float = field(default=1.0, metadata={
        "help": "every process sends a signed heartbeat this often (shorter: faster detection, more messages)"})
    recover_mode: str = field(default="auto", metadata={
        "help": "auto: write recover points, resume from the last one, relaunch after a fault | "
                "resume: the same without relaunching | off: neither write nor resume"})
    recover_freq_steps: int = field(default=0, metadata={"help": "a recover point every N steps (0 = by time only)"})
    recover_freq_seconds: float = field(default=600.0, metadata={
        "help": "a recover point once this many seconds passed since the last (0 = by steps only)"})
    recover_retries: int = field(default=3, metadata={"help": "relaunches after faults (recover_mode=auto)"})
    recover_keep: int = field(default=2, metadata={"help": "recover points kept; older ones are deleted"})
    on_nonfinite: str = field(default="stop", metadata={
        "help": "a train step whose loss or gradient norm is NaN/inf applies no update and then: stop = the run "
                "ends naming the step, MFC, micro-batch and samples | skip = training goes on (counted as "
                "nonfinite_skipped) until max_nonfinite_skips consecutive skips"})
    max_nonfinite_skips: int = field(default=3, metadata={
        "help": "on_nonfinite=skip: consecutive skipped steps after which the run stops"})
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        self.runtime_fields()  # a bad launcher / recover / heartbeat value fails where it is set
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if value and not _PATH_SAFE_NAME.fullmatch(value):
                raise ValueError(f"{name}={value!r}: use letters, digits, '_', '-' and '.' (not first); it names "
                                 f"directories and name-resolution keys")
        for name in ("batch_size", "max_tokens_per_mb"):  # the sizes every built-in experiment has
            value = getattr(self, name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")

    def runtime_fields(self) -> dict[str, Any]:
        """The :class:`ExperimentSetup` fields every experiment takes from these common settings."""
        if not 0.05 <= self.heartbeat_interval_s <= 60.0:
            raise ValueError(f"heartbeat_interval_s={self.heartbeat_interval_s} must be in [0.05, 60] seconds")
        if not self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be > 2 x heartbeat_interval_s="
                             f"{self.heartbeat_interval_s} (one late beat must not declare a worker lost)")
        if self.worker_threads < 1:
            raise ValueError(f"worker_threads={self.worker_threads} must be >= 1")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r} must be 'stop' or 'skip'")
        if self.max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips={self.max_nonfinite_skips} must be >= 0")
        if self.log_samples < 0:
            raise ValueError(f"log_samples={self.log_samples} must be >= 0 (0 = off)")
        if self.mismatch_dump_every < 0:
            raise ValueError(f"mismatch_dump_every={self.mismatch_dump_every} must be >= 0 (0 = off)")
        if self.mismatch_dump_samples < 1:
            raise ValueError(f"mismatch_dump_samples={self.mismatch_dump_samples} must be >= 1")
        _check_precision("precision", self.precision)
        return dict(precision=self.precision,
            on_nonfinite=self.on_nonfinite, max_nonfinite_skips=self.max_nonfinite_skips,
            seed=self.seed, name_resolve=dataclasses.asdict(self.name_resolve), worker_threads=self.worker_threads,
            trace=self.trace, log_samples=self.log_samples, mismatch_dump_every=self.mismatch_dump_every,
            mismatch_dump_samples=self.mismatch_dump_samples, heartbeat_timeout_s=self.heartbeat_timeout_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            deploy=DeploySpec(launcher=self.launcher, slurm=self.slurm, ray=self.ray),
            recover=RecoverSpec(mode=self.recover_mode, freq_steps=self.recover_freq_steps,
                                freq_seconds=self.recover_freq_seconds, retries=self.recover_retries,
                                keep=self.recover_keep),
            wandb=self.wandb, experiment_config=self._plain_config() if self.wandb.enabled else {},
        )

    def _plain_config(self) -> dict[str, Any]:
        """This config as JSON-able data for trackers; a value that is not plain data becomes its str
        (a tracker's copy of the config must never stop a run)."""
        import json

        from realflow.api.config_values import ConfigError, config_to_dict

        try:
            return config_to_dict(self)
        except ConfigError:
            return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    def run_dir(self, default_name: str) -> str:
        import os

        return os.path.abspath(os.path.join(self.fileroot, self.experiment_name or default_name, self.trial_name))

    def prepare(self) -> None:  # pragma: no cover - default does nothing
        """One-time preparation in the launcher (data, tokenizer, initial weights)."""

    def pending_paths(self) -> list[str]:
        """What :meth:`prepare` would still create (files or directories): ``--check`` never
        prepares (it trains, generates and downloads nothing), so it skips checking these."""
        return []

    def setup(self) -> ExperimentSetup:
        raise NotImplementedError(f"{type(self).__name__} must implement setup()")


_PATH_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")

experiment_registry: Registry = Registry("experiment")


def register_experiment(name: str):
    """Class decorator registering an experiment config under ``name``."""

    return experiment_registry.register(name)
