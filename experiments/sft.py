"""The SFT experiment: ``python -m realflow.apps.main_sft``.

Default: a tiny Qwen2-architecture model trained from scratch on locally generated
multi-digit arithmetic (GSM8K-shaped jsonl, ``#### answer``), with a tokenizer
trained offline on that data, on 2 data-parallel CPU workers. Point ``model.path``
and ``dataset.train_path`` at a real HF checkpoint and jsonl file to fine-tune
something else.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from experiments.data_config import UserDataConfig, context_length
from experiments.init_model import TinyArchConfig, ensure_random_checkpoint, planned_hf_config
from realflow.api.batch import MicroBatchSpec
from realflow.api.dfg import graph_registry
from realflow.api.model_options import LoRAConfig
from realflow.api.experiment import (
    BaseExperimentConfig,
    DatasetSpec,
    EvalSpec,
    ExperimentSetup,
    ModelSpec,
    OptimizerConfig,
    register_experiment,
)
from realflow.api.model_options import TrainingMemoryConfig
from realflow.base.hf_models import describe_supported, resolve_checked_model, resolve_model_path


@dataclass
class SFTModelConfig:
    path: str = field(default="", metadata={
        "help": "HF checkpoint to fine-tune: a directory or a hub id in the local HF cache ('' = tiny model from "
                "scratch). Supported: " + describe_supported()})
    revision: str = field(default="main", metadata={"help": "hub revision of a hub id: a branch, tag or commit"})
    tokenizer_path: str = field(default="", metadata={
        "help": "tokenizer directory or hub id ('' = model.path, or the task's own)"})
    arch: TinyArchConfig = field(default_factory=TinyArchConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig, metadata={
        "help": "train LoRA adapters (model.lora.enabled=true) on the frozen model; saves a PEFT adapter"})
    freeze_vision: bool = field(default=False, metadata={
        "help": "vision-language models: keep the vision tower frozen (trains the language model only)"})


@dataclass
class SFTDataConfig(UserDataConfig):
    response_key: str = field(default="", metadata={
        "help": "field holding the target ('' = response | solution | completion, or the assistant turns of "
                "messages)"})
    n_train: int = field(default=50_000, metadata={"help": "generated training problems"})
    n_test: int = field(default=200, metadata={"help": "generated held-out problems"})
    task: str = field(default="arithmetic", metadata={
        "help": "generated task: arithmetic | worked_arithmetic | code_expr | shapes_count (experiments/tasks/registry.py)"})
    difficulty: Optional[int] = field(default=None, metadata={
        "help": "max operand digits of generated problems (None = the task's default)"})
    data_seed: int = field(default=0, metadata={"help": "seed of the generated data"})
    slip_rate: float = field(default=0.0, metadata={
        "help": "share of the generated training rows whose final answer is replaced by a near miss after correct "
                "working (experiments/tasks/careless.py; 0 = clean data; only without dataset.train_path). Why: a "
                "start trained on clean rows samples what it answers greedily, so a GRPO group's samples agree and "
                "RL has nothing to learn; a careless start's samples disagree (its slips), and RL removes them"})
    max_prompt_len: Optional[int] = field(default=None, metadata={
        "help": "longest prompt in tokens (None = max_seq_len - 1)"})
    max_seq_len: Optional[int] = field(default=None, metadata={
        "help": "longest prompt + response in tokens (None = the model's context)"})

    def __post_init__(self) -> None:
        from experiments.tasks.registry import get_task

        get_task(self.task)  # an unknown task fails here, naming the closest ones
        if not 0.0 <= self.slip_rate < 1.0:
            raise ValueError(f"dataset.slip_rate={self.slip_rate} must be >= 0 and < 1")
        if self.slip_rate and self.train_path:
            raise ValueError(f"dataset.slip_rate={self.slip_rate} makes a careless copy of the generated task data; "
                             "with dataset.train_path write the rows you want instead "
                             "(experiments/tasks/careless.py: careless_rows)")
        for name in ("n_train", "n_test", "max_prompt_len", "max_seq_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"dataset.{name}={getattr(self, name)} must be >= 1")
        if self.max_prompt_len is not None and self.max_seq_len is not None \
                and self.max_prompt_len >= self.max_seq_len:
            raise ValueError(f"dataset.max_prompt_len={self.max_prompt_len} must be < dataset.max_seq_len="
                             f"{self.max_seq_len} (room for the solution)")
        self._check_user_data()


@register_experiment("sft")
@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning on (prompt, solution) pairs; held-out exact match before/after."""

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    dataset: SFTDataConfig = field(default_factory=SFTDataConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=2e-3, weight_decay=0.01, warmup_steps_proportion=0.1)
    )
    batch_size: int = field(default=128, metadata={"help": "samples per optimizer step (global)"})
    max_tokens_per_mb: int = field(default=4096, metadata={"help": "micro-batch token budget per worker"})
    total_train_epochs: int = field(default=2, metadata={"help": "passes over the training data"})
    max_train_steps: Optional[int] = field(default=500, metadata={"help": "stop after this many steps"})
    save_freq_steps: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    eval_freq_steps: int = field(default=0, metadata={"help": "evaluate every N steps (0 = before and after)"})
    eval_max_new_tokens: int = field(default=16, metadata={"help": "greedy tokens per held-out prompt"})
    training: TrainingMemoryConfig = field(default_factory=TrainingMemoryConfig, metadata={
        "help": "memory-for-time trades of the trained model"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_max_new_tokens < 0:
            raise ValueError(f"eval_max_new_tokens={self.eval_max_new_tokens} must be >= 0")

    # ---- derived paths: pure functions of the config ------------------------------------------
    def _task(self) -> Any:
        from experiments.tasks.registry import get_task

        return get_task(self.dataset.task)

    def _difficulty(self) -> int:
        d = self.dataset.difficulty
        return self._task().difficulty if d is None else d

    def _data_dir(self) -> str:
        name = f"{self._task().data_prefix}-d{self._difficulty()}-s{self.dataset.data_seed}"
        return os.path.abspath(os.path.join(self.fileroot, "data", name))

    def _careless(self) -> bool:
        """Whether the run trains on a careless copy of the generated data (dataset.slip_rate)."""
        return not self.dataset.train_path and self.dataset.slip_rate > 0

    def _clean_train(self) -> str:
        return self.dataset.train_path or os.path.join(self._data_dir(), "train.jsonl")

    def _paths(self) -> tuple[str, str, str, str]:
        """(train jsonl, test jsonl, tokenizer dir, model dir). With dataset.slip_rate the train file is
        the careless copy beside the generated data; the tokenizer and held-out data stay the clean ones."""
        from experiments.tasks.careless import careless_path

        d = self._data_dir()
        train = self._clean_train()
        if self._careless():
            train = careless_path(train, self.dataset.slip_rate)
        test = self.dataset.test_path or os.path.join(d, "test.jsonl")
        # a tokenizer trained on user data lives with the run, not with the generated data
        own_tok = os.path.join(d if not self.dataset.train_path else self.run_dir("sft"), "tokenizer")
        m = self.model
        model = (resolve_checked_model(m.path, m.revision, "model.path") if m.path
                 else os.path.join(self.run_dir("sft"), "init_model"))
        tok = (resolve_model_path(m.tokenizer_path, m.revision, "model.tokenizer_path") if m.tokenizer_path
               else model if m.path else own_tok)
        return train, test, tok, model

    def data_args(self) -> dict[str, Any]:
        """The data sets' args: the data keys and the length limits (``dataset.max_seq_len``, else the
        model's context; ``dataset.max_prompt_len``, else one less). Generated task data is filtered
        by length as it always was; a user's overlong rows are refused unless dataset.filter_overlong."""
        from parallel.backend import read_hf_config

        d = self.dataset
        seq = d.max_seq_len
        if seq is None:
            model = self._paths()[3]
            seq = context_length(read_hf_config(model) if self.model.path else planned_hf_config(self.model.arch))
            seq = seq or 2048
        prompt = d.max_prompt_len if d.max_prompt_len is not None else seq - 1
        if prompt >= seq:
            raise ValueError(f"dataset.max_prompt_len={prompt} must be < the sequence limit {seq} "
                             "(dataset.max_seq_len, default the model's context)")
        args = d.data_args(image_inputs=self.sees_images(), max_prompt_len=prompt, max_seq_len=seq)
        if not d.train_path:
            args["filter_overlong"] = True
        return args

    def sees_images(self) -> bool:
        """Whether the trained model is a vision-language one (its config has a vision tower)."""
        from parallel.backend import read_hf_config
        from realflow.data.images import is_vision_language

        model = self._paths()[3]
        return is_vision_language((read_hf_config(model) if self.model.path else None)
                                  or planned_hf_config(self.model.arch))

    def pending_paths(self) -> list[str]:
        train, test, tok, model = self._paths()
        made = [train, test] if not self.dataset.train_path else []
        if self._careless():  # the careless copy and the clean file it is made from (and the tokenizer from)
            made.append(self._clean_train())
        if not self.model.path and not self.model.tokenizer_path:
            made.append(tok)
        if not self.model.path:
            made.append(model)
        return [p for p in made if not os.path.exists(p)]

    def prepare(self) -> None:
        from experiments.tasks.careless import ensure_careless_copy
        from experiments.tasks.tokenizer import ensure_tokenizer

        train, test, tok, model = self._paths()
        ds = self.dataset
        if not ds.train_path:
            self._task().ensure_dataset(self._data_dir(), ds.n_train, ds.n_test, ds.data_seed, self._difficulty())
        if self._careless():
            ensure_careless_copy(self._clean_train(), ds.slip_rate)
        if not self.model.path and not self.model.tokenizer_path:
            (self._task().ensure_tokenizer or ensure_tokenizer)(tok, [self._clean_train()])
        if not self.model.path:
            ensure_random_checkpoint(model, tok, self.model.arch, self.seed)

    def setup(self) -> ExperimentSetup:
        train, test, tok, model = self._paths()
        mb_spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=self.max_tokens_per_mb)
        mfcs = graph_registry.get("sft")(self.batch_size, mb_spec, role="default", images=self.sees_images())
        data_args = self.data_args()
        return ExperimentSetup(
            experiment_name=self.experiment_name or "sft",
            trial_name=self.trial_name,
            mfcs=mfcs,
            models={"default": ModelSpec(role="default", path=model, tokenizer_path=tok, optimizer=self.optimizer,
                                         expected_config=None if self.model.path else planned_hf_config(self.model.arch),
                                         lora=self.model.lora, training=self.training,
                                         freeze_vision=self.model.freeze_vision)},
            dataset=DatasetSpec(format="sft", path=train, args=data_args),
            n_workers=self.n_workers,
            allocation=self.allocation or f"d{self.n_workers}",
            run_dir=self.run_dir("sft"),
            total_train_epochs=self.total_train_epochs,
            max_train_steps=self.max_train_steps,
            save_freq_steps=self.save_freq_steps,
            eval=None if self.dataset.train_path and not self.dataset.test_path else EvalSpec(
                role="default",
                dataset=DatasetSpec(format="prompt_answer", path=test, args=_eval_args(data_args)),
                interface_impl="sft",
                # the task's held-out check: final-answer match, or e.g. code-tests for code_expr
                interface_args={"eval_max_new_tokens": self.eval_max_new_tokens,
                                "eval_reward": self._task().eval_reward},
                freq_steps=self.eval_freq_steps,
            ),
            **self.runtime_fields(),
        )


def _eval_args(data_args: dict[str, Any]) -> dict[str, Any]:
    """The held-out set's args: the training data's, less what only SFT targets use."""
    return {k: v for k, v in data_args.items() if k not in ("max_seq_len", "response_key")}
