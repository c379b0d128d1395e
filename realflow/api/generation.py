"""The generation-backend contract: one interface, several engines.

The gen server (:mod:`realflow.rollout.gen_server`) must not import ``parallel/``,
so what it needs from an engine is written down here: request parameters
(:class:`SamplingParams`), results (:class:`GenerationResult`), the engine
protocol (:class:`GenerationBackend`) and the registry the engines put their
factories in (:data:`generation_backends`).  ``parallel.generation`` registers
``builtin`` (torch, CPU/GPU) and ``sglang`` (an external SGLang server process).

Logprob semantics (``SamplingParams.logprob_mode``):

* ``"raw"`` (default, as SGLang): log-softmax of the model's unmodified logits,
  i.e. before temperature, top-k, top-p and min-p.  This is what a trainer recomputes
  with a plain forward, so PPO ratios compare like with like at temperature 1.
* ``"sampling"``: log-probability under the distribution the token was actually
  drawn from (after temperature and top-k/top-p/min-p renormalisation) - the exact
  behaviour-policy probability, for off-policy corrections when T != 1.
  Greedy requests (temperature 0) report 0.0 (probability 1) in this mode.

Top-p, top-k and min-p make the behaviour policy a truncation of the policy a
trainer recomputes (which sees only the tempered softmax): ``"sampling"`` reports
the truncated probability, ``"raw"`` the untruncated one; neither makes them equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

from realflow.api.registry import Registry

__all__ = [
    "SamplingParams",
    "GenerationResult",
    "GenerationBackend",
    "ExternalServerBackend",
    "BackendConfig",
    "GenServerLimits",
    "generation_backends",
    "LOGPROB_MODES",
    "PAUSE_MODES",
    "validate_input_ids",
    "check_inference_memory",
]

LOGPROB_MODES = ("raw", "sampling")
# abort: running requests finish now with finish_reason "abort" and what they have;
# retract: they are held (KV dropped) and continue, re-prefilled, after continue_generation.
PAUSE_MODES = ("abort", "retract")

# SGLang sampling fields we accept only at their neutral value (anything else is an error,
# never silently ignored).
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0}
# SGLang fields about text post-processing only: accepted and ignored.
_IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang's ``sampling_params`` names)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 = off; >= 1 keeps the k most likely tokens
    min_p: float = 0.0  # in [0, 1], 0 = off; keeps tokens with prob >= min_p x the top prob (after temperature)
    n: int = 1  # samples per prompt; sample i uses seed + i
    seed: Optional[int] = None  # None: drawn from the engine's own generator
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # False: the model's eos token ids stop generation too
    logprob_mode: str = "raw"  # see module docstring
    # MoE models: return the experts each token was routed to (GenerationResult.routed_experts);
    # None = the engine's default (the built-in engine: on for MoE models; dense models never have it)
    return_routed_experts: Optional[bool] = None

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the first bad field; returns self (normalised)."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"sampling_params.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be an integer >= 0")
        if not _is_num(self.temperature) or not self.temperature >= 0 or self.temperature == float("inf"):
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1] (0 = off)")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be null or an integer >= 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers >= 0")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a boolean")
        if self.logprob_mode not in LOGPROB_MODES:
            raise bad("logprob_mode", f"must be one of {LOGPROB_MODES}")
        if self.return_routed_experts is not None and not isinstance(self.return_routed_experts, bool):
            raise bad("return_routed_experts", "must be null or a boolean")
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "SamplingParams":
        """From SGLang's JSON ``sampling_params``; unknown fields are errors naming them."""
        if d is None:
            return cls().validate()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in known:
                kw[k] = v
            elif k in _NEUTRAL:
                if v is not None and v != _NEUTRAL[k]:
                    raise ValueError(f"sampling_params.{k}={v!r}: not supported by this engine "
                                     f"(only the neutral value {_NEUTRAL[k]!r})")
            elif k not in _IGNORED:
                raise ValueError(f"sampling_params.{k}: unknown field (known: {sorted(known)})")
        if kw.get("stop") is None:
            kw.pop("stop", None)
        if kw.get("stop_token_ids") is None:
            kw.pop("stop_token_ids", None)
        if kw.get("max_new_tokens", 0) is None:
            kw.pop("max_new_tokens")
        return cls(**kw).validate()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate_input_ids(input_ids: Any, vocab_size: int, max_context: int,
                       what: str = "input_ids") -> list[int]:
    """A prompt as a list of ints, or ValueError naming the problem (empty, too long, out of vocab)."""
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError(f"{what} must be a list of token ids, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise ValueError(f"{what} is empty: a prompt needs at least one token")
    if len(input_ids) >= max_context:
        raise ValueError(f"{what} has {len(input_ids)} tokens; the context holds {max_context} "
                         f"(prompt must be shorter to leave room for output)")
    for i, t in enumerate(input_ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{what}[{i}]={t!r} is not a token id in [0, {vocab_size})")
    return [int(t) for t in input_ids]


class GenerationFailed(RuntimeError):
    """A generation request failed inside the engine (e.g. non-finite logits after a bad weight
    update); a server answers it with HTTP 500 naming the request and the weight version."""


@dataclass
class GenerationResult:
    """One finished (or aborted) sequence.

    ``rid`` is the sequence id: the request id, with ``-i`` appended for sample
    i when the request had ``n > 1``.  ``output_logprobs[j]`` is the logprob of
    ``output_ids[j]`` (see module docstring for which distribution) and
    ``output_versions[j]`` the weight version that generated it.

    ``routed_experts`` (MoE models, when asked: ``SamplingParams.return_routed_experts``): an
    integer numpy array ``[len(prompt_ids) + len(output_ids) - 1, num_layers, topk]`` of global
    expert ids, row ``t`` the experts the token at position ``t`` was routed to (the last output
    token is never run as input); uint8 for up to 256 experts, else int16.  None for dense models,
    when not asked, and for a sequence that never ran (aborted while queued).
    """

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict[str, Any]  # {"type": "stop"|"length"|"abort"|"error", "matched"/"message": ...}
    request_rid: str = ""  # the id of the request this sequence belongs to
    index: int = 0  # sample index within the request
    routed_experts: Any = None  # numpy [prompt + output - 1, layers, topk] (see the class docstring)

    @property
    def weight_version(self) -> int:
        return self.output_versions[-1] if self.output_versions else -1


@runtime_checkable
class GenerationBackend(Protocol):
    """An in-process engine that a server steps from one thread.

    Not thread-safe: the server serialises every call (one lock).  ``step``
    advances every running request by one token (prefilling the ones that
    joined) and returns the sequences that finished in it.
    """

    @property
    def weight_version(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def add_request(self, rid: str, input_ids: Sequence[int], params: SamplingParams) -> list[str]: ...

    def abort(self, rid: str) -> list[GenerationResult]: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[GenerationResult]: ...

    def pause(self, mode: str = "abort") -> list[GenerationResult]: ...

    def flush_cache(self) -> None: ...

    def update_weights_from_disk(self, model_path: str, version: Optional[int] = None) -> int: ...

    def update_weights_from_tensors(self, tensors: Mapping[str, Any], fmt: str = "hf",
                                    version: Optional[int] = None) -> int: ...

    def decode(self, ids: Sequence[int]) -> Optional[str]: ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class ExternalServerBackend(Protocol):
    """A backend that is its own HTTP server speaking the same API (e.g. SGLang)."""

    def serve(self, host: str, port: int) -> int:
        """Run the server in the foreground until it exits; return its exit code."""
        ...


def check_inference_memory(gpu_memory_utilization: Any, max_model_len: Any, model_context: Optional[int] = None,
                           prefix: str = "") -> None:
    """The one rule for the two inference memory keys, wherever they are set (``rollout.*`` of an
    asynchronous run, ``ppo.*`` of the trainer's generator, a gen server's flags, an engine's config).

    ``gpu_memory_utilization``: the fraction of the device's free memory, when the engine starts,
    that its KV cache may take (SGLang: ``mem_fraction_static``), in (0, 1]. ``max_model_len``:
    prompt + new tokens of one sequence, what each KV-cache slot holds (SGLang: ``context_length``);
    None = the model's context. Raises ValueError naming ``prefix + key`` and what to do.
    """
    g = gpu_memory_utilization
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0:
        raise ValueError(f"{prefix}gpu_memory_utilization={g!r} must be in (0, 1]: the fraction of the device's "
                         f"free memory the KV cache may take (e.g. 0.9 on a generation server)")
    n = max_model_len
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"{prefix}max_model_len={n!r} must be an integer >= 2 (prompt + new tokens of one "
                         f"sequence), or unset for the model's context")
    if model_context is not None and n > model_context:
        raise ValueError(f"{prefix}max_model_len={n} is above the model's context of {model_context} tokens "
                         f"(max_position_embeddings): lower it, or leave it unset for the whole context")


@dataclass
class BackendConfig:
    """What a backend factory gets from the server's command line."""

    model_path: str
    tokenizer_path: Optional[str] = None  # default: model_path when it holds a tokenizer
    max_running_requests: int = 64
    max_model_len: Optional[int] = None  # prompt + new tokens per sequence; default the model's context
    gpu_memory_utilization: float = 0.9  # of the device's free memory, for the KV cache (see check_inference_memory)
    dtype: str = "float32"
    seed: int = 0
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode (SGLang: --disable-cuda-graph)
    kv_block_size: int = 16  # tokens per KV block, a power of two (built-in engine)
    prefix_sharing: bool = True  # sequences share a common prefix's KV blocks (SGLang: radix cache)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the policy trains LoRA adapters: ``{"r", "alpha", "target_modules"}``; weight updates then carry
    #: adapters only (PEFT names), which the server applies to the base it was started from
    lora: Optional[dict[str, Any]] = None


@dataclass
class GenServerLimits:
    """What one generation server accepts; over a bound -> 400/413 naming the field, a full queue -> 429.

    Why: a server is shared by many clients (rollout workers, agents, people with
    curl); one request must not be able to hold the engine for minutes or grow the
    process without bound.  ``None`` means "what the model allows": prompts shorter
    than the context, ``max_new_tokens`` up to the context.  ``max_queued_tokens``
    bounds the work waiting or running on the server, counted per sequence as
    prompt tokens + the new tokens it may still produce; a request that would pass
    it is answered 429 with ``Retry-After`` (the clients of realflow wait and retry).
    """

    max_sequences_per_request: int = field(default=4096, metadata={
        "help": "prompts x n of one /generate"})
    max_new_tokens: Optional[int] = field(default=None, metadata={
        "help": "sampling_params.max_new_tokens at most this (None: the model's context)"})
    max_prompt_tokens: Optional[int] = field(default=None, metadata={
        "help": "tokens of one prompt at most this (None: shorter than the model's context)"})
    max_body_bytes: int = field(default=64 << 20, metadata={"help": "HTTP request body size (413 above)"})
    max_queued_tokens: int = field(default=16 << 20, metadata={
        "help": "prompt + new tokens of all sequences waiting or running; a request past it gets 429"})
    # the image processor's pixel budget for /generate's image_data (vision-language models): the same
    # as the data set's (dataset.min_pixels / max_pixels), so that the trainer sees the images the
    # server generated from. Defaults: realflow.api.images.ImageProcessing's (a test holds them equal;
    # not imported: that module needs torch, this one stays cheap for the config parser)
    min_pixels: int = field(default=56 * 56, metadata={
        "help": "images are resized to at least this many pixels (VL models' image_data)"})
    max_pixels: int = field(default=28 * 28 * 1280, metadata={
        "help": "images are resized to at most this many pixels (VL models' image_data)"})

    def validate(self) -> "GenServerLimits":
        for name in ("max_sequences_per_request", "max_body_bytes", "max_queued_tokens", "min_pixels", "max_pixels"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}")
        for name in ("max_new_tokens", "max_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name}={v!r}: must be null (the model's context) or an integer >= 1")
        return self


BackendFactory = Callable[[BackendConfig], Any]  # -> GenerationBackend | ExternalServerBackend
generation_backends: Registry[BackendFactory] = Registry("generation backend")
