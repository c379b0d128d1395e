"""Run megatron-core 0.16.1 on a CPU-only host (gloo, no CUDA).

megatron-core assumes a GPU in a few dozen places: it allocates buffers with
``device=torch.cuda.current_device()`` or ``device="cuda"``, keeps its RNG
streams in the CUDA generator, and checks tensor kinds with string compares such
as ``param.type() == "torch.cuda.FloatTensor"``.  On a CPU-only torch build all
of these raise.  This is the ONE place that maps them to CPU; nothing else in
realflow special-cases CPU for megatron.

``apply_cpu_compat()`` does nothing when ``torch.cuda.is_available()`` (a GPU
host runs stock megatron), and is idempotent.  Three mechanisms, narrowest first:

1. Module-scoped ``torch`` stand-in (:data:`_DEVICE_MODULES`).  In each listed
   megatron module the global name ``torch`` is rebound to :class:`_CpuTorch`,
   which forwards everything to the real torch except that ``torch.cuda`` becomes
   a CPU namespace (``current_device() -> cpu``, RNG calls -> the CPU generator,
   synchronize/empty_cache -> no-ops) and tensor factories called with a CUDA
   ``device=`` allocate on CPU.  Only code in those modules sees the stand-in;
   torch itself and every other module are untouched.
2. RNG (tensor_parallel/random.py).  Megatron's tracker saves/restores the CUDA
   generator around model-parallel regions (weight init, dropout, activation
   recompute).  On CPU "the CUDA generator" is the CPU default generator, so its
   two accessors ``_get_cuda_rng_state``/``_set_cuda_rng_state`` are mapped to
   ``torch.get_rng_state``/``torch.set_rng_state`` and the tracker class is a
   subclass whose ``fork`` does not warn that "the CPU RNG changed inside the GPU
   RNG context" (on CPU that is the same generator, by construction).
3. Call-scoped tensor-kind names.  A few megatron functions compare
   ``tensor.type()`` with ``"torch.cuda.FloatTensor"`` or call ``tensor.cuda()``.
   Only while one of :data:`_CUDA_NAMED_CALLS` runs, a CPU tensor's zero-argument
   ``.type()`` reports the CUDA name of the same dtype and ``.cuda()`` returns the
   tensor itself.  (The swap is process-wide for the duration of the call; these
   are construction / optimizer-step calls on the training thread.)

Every entry below was checked to be needed by dp training, tp / sequence-
parallel training, or the pp 1F1B schedule (removing it breaks one of them).
Not mapped: GPU-initialised linear weights (we use CPU init on CPU), the
distributed optimizer's checkpoint/offload paths.  Not mapped at all (never
enabled on CPU): ``torch.autocast("cuda")`` in the schedules
(``enable_autocast``), CUDA streams for overlapped grad reduce
(``overlap_grad_reduce`` / several optimizer instances), CUDA graphs, optimizer
CPU offload, the fused kernels (``*_fusion`` flags must be False).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["apply_cpu_compat", "cpu_compat_applied", "import_megatron_core"]

_log = logging.getLogger(__name__)

# Megatron modules whose hard-coded CUDA device / generator calls we map, and the
# call site that needs it (megatron-core 0.16.1).
_DEVICE_MODULES: dict[str, str] = {
    # GlobalMemoryBuffer.get_tensor: device=torch.cuda.current_device()
    "megatron.core.utils": "GlobalMemoryBuffer buffers",
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device()
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE frequencies",
    # get_default_causal_mask: torch.ones(sq, sq, device="cuda") (local attention)
    "megatron.core.transformer.utils": "causal attention mask",
    # CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed seed torch.cuda
    "megatron.core.tensor_parallel.random": "RNG tracker seeding",
    # forward_backward_*: total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.pipeline_parallel.schedules": "token counter in the schedules",
    # _ParamAndGradBuffer: param/grad buffers on torch.cuda.current_device()
    "megatron.core.distributed.param_and_grad_buffer": "DDP param/grad buffers",
    # MixedPrecisionOptimizer/FP32Optimizer: found_inf, _scale on device='cuda'
    "megatron.core.optimizer.optimizer": "optimizer scalars",
    # get_grad_norm_fp32 / clip_grad_by_total_norm_fp32: overflow bufs on 'cuda'
    "megatron.core.optimizer.clip_grads": "grad-norm / clipping scratch tensors",
    # _gather_along_*_dim allocate on torch.cuda.current_device() (tp > 1: logits gather)
    "megatron.core.tensor_parallel.mappings": "tensor-parallel collectives",
    # LinearWithGradAccumulationAndAsyncCommunication.backward (sequence parallel):
    # all-gather buffer of the input on torch.cuda.current_device()
    "megatron.core.tensor_parallel.layers": "sequence-parallel linear backward",
    # P2PCommunicator._communicate: receive buffers (and shape buffers) on
    # torch.cuda.current_device(); torch.cuda.synchronize() after batched p2p
    "megatron.core.pipeline_parallel.p2p_communication": "pipeline p2p buffers",
    # MoEAlltoAllTokenDispatcher: a side torch.cuda.Stream for the device-to-host copies of
    # the token splits (CPU: the copies are no-ops and the stream is :class:`_CpuStream`)
    "megatron.core.transformer.moe.token_dispatcher": "MoE token dispatcher streams",
    # Router.gating: router weight moved to torch.cuda.current_device() before the GEMM
    "megatron.core.transformer.moe.router": "MoE router weight device",
    # MoE aux-loss tracker values on device="cuda"
    "megatron.core.transformer.moe.moe_utils": "MoE loss tracker",
}

# (module, qualified attribute) of megatron callables that compare tensor.type()
# with "torch.cuda.*Tensor" or call tensor.cuda(); they run with CUDA names.
_CUDA_NAMED_CALLS: list[tuple[str, str]] = [
    # _build_model_and_main_param_groups: model_param.type() == 'torch.cuda.FloatTensor'
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    # asserts param.grad.type() == 'torch.cuda.FloatTensor'; its only caller
    # (MegatronOptimizer / ChainedOptimizer in optimizer.py) imported it by name
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    # pp > 1 with tied embeddings: weight.data = weight.data.cuda() before the
    # embedding all-reduce
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
    ),
]

_applied = False


def cpu_compat_applied() -> bool:
    """True once :func:`apply_cpu_compat` has patched megatron (CPU-only hosts)."""
    return _applied


# --------------------------------------------------------------------------- 1.


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a CUDA ordinal, e.g. from torch.cuda.current_device()
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # pinning needs an accelerator
        return factory(*args, **kwargs)

    return wrapper


class _CpuEvent:
    """A CUDA event on CPU: work is synchronous, so it has always happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, *_args: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream on CPU (the MoE dispatcher's side stream): every op is already ordered."""

    def wait_stream(self, _other: Any) -> None:
        return None

    def wait_event(self, _event: Any) -> None:
        return None

    def record_event(self, _event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_CURRENT_STREAM = _CpuStream()


class _CpuCuda:
    """What ``torch.cuda`` looks like to a patched megatron module."""

    Stream = _CpuStream
    Event = _CpuEvent

    @staticmethod
    def current_stream(*_args: Any) -> _CpuStream:
        return _CURRENT_STREAM

    @staticmethod
    def stream(_stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def current_device() -> torch.device:
        # megatron only passes the result on as ``device=``.
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_args: Any, **_kwargs: Any) -> None:
        return None  # CPU ops are synchronous

    @staticmethod
    def empty_cache() -> None:
        return None

    # "The CUDA generator" is the CPU default generator on a CPU host.
    @staticmethod
    def get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_FACTORIES = frozenset(
    "tensor zeros ones empty full arange rand randn randint zeros_like ones_like "
    "empty_like full_like as_tensor".split()
)


class _CpuTorch(types.ModuleType):
    """Stand-in bound to the name ``torch`` inside the modules of mechanism 1."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --------------------------------------------------------------------------- 2.


def _patch_rng() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state
    base = random.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's tracker with the CPU default generator as 'the CUDA generator'."""

        @contextlib.contextmanager
        def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name!r} was never added to the tracker")
            outer_name = self._current_state_name
            outer_state = torch.get_rng_state()
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    # A tracker built before we got here would be the CUDA one: rebuild lazily.
    random.initialize_rng_tracker(force_reset=True)


# --------------------------------------------------------------------------- 3.

_cuda_named_depth = 0
_orig_type = torch.Tensor.type
_orig_cuda = torch.Tensor.cuda


def _type_with_cuda_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = _orig_type(self, *args, **kwargs)
    if args or kwargs or self.device.type != "cpu":
        return name
    return "torch.cuda." + name[len("torch."):]


def _cuda_is_noop_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


@contextlib.contextmanager
def _cuda_tensor_names() -> Iterator[None]:
    global _cuda_named_depth
    if _cuda_named_depth == 0:
        torch.Tensor.type = _type_with_cuda_name  # type: ignore[method-assign]
        torch.Tensor.cuda = _cuda_is_noop_on_cpu  # type: ignore[method-assign]
    _cuda_named_depth += 1
    try:
        yield
    finally:
        _cuda_named_depth -= 1
        if _cuda_named_depth == 0:
            torch.Tensor.type = _orig_type  # type: ignore[method-assign]
            torch.Tensor.cuda = _orig_cuda  # type: ignore[method-assign]


def _wrap_cuda_named(module_name: str, qualname: str) -> None:
    owner: Any = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_tensor_names():
            return fn(*args, **kwargs)

    setattr(owner, attr, wrapper)


# ---------------------------------------------------------------------------


def _define_missing_te_names() -> None:
    """moe_utils imports ``te_general_gemm`` from Transformer Engine inside a try block with no
    fallback, then tests ``te_general_gemm is not None`` in the router GEMM: without TE the name
    is undefined (a NameError).  Define it as None, which selects megatron's torch path."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_split_sizes_to_host()


def _patch_split_sizes_to_host() -> None:
    """The all-to-all dispatcher moves its token split sizes "to the host" with
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors; a CPU
    tensor stays a tensor, and ``all_to_all_single`` wants a list of ints (numpy arrays pass).
    On CPU the split sizes are converted to numpy like a GPU host's."""
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = to_host


def import_megatron_core() -> None:
    """Import megatron-core, on a CPU host without its compile-time fusers (~2 s, not ~6 s).

    ``megatron.core.jit`` decorates its fused kernels with ``torch.compile`` when the package
    is imported, which imports TorchDynamo and Inductor (sympy, networkx, ...: ~3.5 s of CPU
    per process), and its dynamic inference context imports ``wandb`` (~1 s). On CPU the
    fused kernels never run (the ``*_fusion`` flags are False) and megatron's inference
    context is not used, yet every model worker, generation server and test rank paid both.
    Here, only while ``megatron.core`` is first imported on a host without CUDA:
    ``torch.compile`` returns the function unchanged (megatron's ``disable_jit_fuser()``
    then makes that its setting) and ``wandb`` reads as not installed to megatron (an
    ``import wandb`` afterwards, by realflow's own W&B logging, loads it as usual). A GPU
    host imports stock megatron. Idempotent; the first megatron import of a process must
    come through here (or through :func:`apply_cpu_compat`) to get the fast path.
    """
    import sys

    if "megatron.core" in sys.modules or torch.cuda.is_available():
        import megatron.core  # noqa: F401  (already imported, or stock on a GPU host)
        return
    real_compile = torch.compile

    def _uncompiled(model: Any = None, **_options: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    hide_wandb = "wandb" not in sys.modules
    torch.compile = _uncompiled
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  (import raises ImportError)
    try:
        import megatron.core
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = real_compile
        if hide_wandb:
            sys.modules.pop("wandb", None)


def apply_cpu_compat() -> None:
    """Patch megatron-core for CPU when CUDA is unavailable; no-op otherwise.

    Safe to call many times and from every entry point that builds megatron
    objects; call it before the first GPTModel / DDP / optimizer is created.
    """
    global _applied
    if _applied or torch.cuda.is_available():
        return
    import_megatron_core()
    stand_in = _CpuTorch()
    for module_name in _DEVICE_MODULES:
        importlib.import_module(module_name).torch = stand_in
    _patch_rng()
    for module_name, qualname in _CUDA_NAMED_CALLS:
        _wrap_cuda_named(module_name, qualname)
    _define_missing_te_names()
    _applied = True
    _log.debug("megatron-core mapped to CPU: %s", ", ".join(_DEVICE_MODULES.values()))
