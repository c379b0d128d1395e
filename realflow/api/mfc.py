"""Model function calls (MFCs): the nodes of the data flow graph.

An MFC is one call of one interface method (generate / inference / train_step)
on one model role, with declared input and output keys.  A graph builder
returns a list of :class:`MFCDef`; everything else (edges, placement, data
transfers, parameter reallocation) is derived from these declarations, so they
are validated eagerly and every error names the MFC.

Key remapping exists so that a reusable interface can speak its own
vocabulary: ``input_key_remap`` maps *graph key -> interface key* on the way
in, ``output_key_remap`` maps *interface key -> graph key* on the way out.
``input_keys`` / ``output_keys`` are always graph keys.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from realflow.api.batch import MicroBatchSpec

__all__ = ["MFCDefError", "ModelInterfaceType", "MFCDef", "MFCHook", "ParamReallocHook", "OffloadHook"]

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class MFCDefError(ValueError):
    """An invalid :class:`MFCDef` field; the message names the MFC and the field."""


class ModelInterfaceType(str, enum.Enum):
    """Which :class:`~realflow.api.interface.ModelInterface` method an MFC calls."""

    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"


@dataclass(frozen=True)
class MFCHook:
    """Base of hooks the plan compiler attaches before/after an MFC (typed placeholders)."""


@dataclass(frozen=True)
class ParamReallocHook(MFCHook):
    """Move ``source_role``'s parameters into ``target_role``'s layout before/after the MFC.

    ``target = eta * source + (1 - eta) * target``: ``eta=1`` is a plain copy
    (e.g. train layout -> generation layout), ``eta<1`` an EMA (reference model).
    """

    source_role: str
    target_role: str
    eta: float = 1.0

    def __post_init__(self) -> None:
        for f in ("source_role", "target_role"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise MFCDefError(f"ParamReallocHook.{f} must be a non-empty str, got {getattr(self, f)!r}")
        if isinstance(self.eta, bool) or not isinstance(self.eta, (int, float)) or not 0.0 <= self.eta <= 1.0:
            raise MFCDefError(f"ParamReallocHook.eta must be a number in [0, 1], got {self.eta!r}")


@dataclass(frozen=True)
class OffloadHook(MFCHook):
    """Offload the MFC's model (e.g. to CPU memory) after it ran, freeing the devices it shares."""


def _check_name(mfc: str, what: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise MFCDefError(f"MFC {mfc!r}: {what} must be a non-empty str, got {value!r}")


@dataclass
class MFCDef:
    """Declaration of one model function call.

    ``n_seqs`` is the batch size in *samples* (a sample may hold a group of
    sequences); ``mb_spec`` says how the MFC's worker cuts its share into
    micro-batches.
    """

    name: str
    model_name: str
    interface_type: ModelInterfaceType
    interface_impl: str
    interface_args: dict[str, Any] = field(default_factory=dict)
    input_keys: tuple[str, ...] = ()
    output_keys: tuple[str, ...] = ()
    input_key_remap: dict[str, str] = field(default_factory=dict)
    output_key_remap: dict[str, str] = field(default_factory=dict)
    n_seqs: int = 1
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    pre_hooks: list[MFCHook] = field(default_factory=list)
    post_hooks: list[MFCHook] = field(default_factory=list)
    log_return_value: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise: lists -> tuples, str -> enum) every field; raises :class:`MFCDefError`.

        Runs at construction; the graph runs it again because the dataclass is mutable.
        """
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise MFCDefError(
                f"MFC name must be a non-empty identifier-like str (letters, digits, _ . -), got {self.name!r}"
            )
        n = self.name
        _check_name(n, "model_name (role)", self.model_name)
        _check_name(n, "interface_impl", self.interface_impl)
        try:
            self.interface_type = ModelInterfaceType(self.interface_type)
        except ValueError:
            valid = ", ".join(t.value for t in ModelInterfaceType)
            raise MFCDefError(f"MFC {n!r}: interface_type must be one of {valid}; got {self.interface_type!r}") from None
        if not isinstance(self.interface_args, dict) or not all(isinstance(k, str) for k in self.interface_args):
            raise MFCDefError(f"MFC {n!r}: interface_args must be a dict with str keys, got {self.interface_args!r}")
        for attr in ("input_keys", "output_keys"):
            keys = getattr(self, attr)
            if isinstance(keys, str) or not isinstance(keys, (tuple, list)):
                raise MFCDefError(f"MFC {n!r}: {attr} must be a tuple of str, got {keys!r}")
            keys = tuple(keys)
            for k in keys:
                _check_name(n, f"every entry of {attr}", k)
            dup = sorted({k for k in keys if keys.count(k) > 1})
            if dup:
                raise MFCDefError(f"MFC {n!r}: key(s) {dup} listed twice in {attr}")
            setattr(self, attr, keys)
        both = sorted(set(self.input_keys) & set(self.output_keys))
        if both:
            raise MFCDefError(f"MFC {n!r}: key(s) {both} are both input and output of the same MFC")
        self._check_remap("input_key_remap", self.input_key_remap, self.input_keys, "graph input key")
        self._check_remap("output_key_remap", self.output_key_remap, None, "interface output key")
        if not isinstance(self.mb_spec, MicroBatchSpec):
            raise MFCDefError(f"MFC {n!r}: mb_spec must be a MicroBatchSpec, got {type(self.mb_spec).__name__}")
        if isinstance(self.n_seqs, bool) or not isinstance(self.n_seqs, int) or self.n_seqs < 1:
            raise MFCDefError(f"MFC {n!r}: n_seqs must be an integer >= 1, got {self.n_seqs!r}")
        for attr in ("pre_hooks", "post_hooks"):
            hooks = getattr(self, attr)
            if not isinstance(hooks, (list, tuple)) or not all(isinstance(h, MFCHook) for h in hooks):
                raise MFCDefError(
                    f"MFC {n!r}: {attr} must be a list of hooks (ParamReallocHook, OffloadHook), got {hooks!r}"
                )
            setattr(self, attr, list(hooks))
        if not isinstance(self.log_return_value, bool):
            raise MFCDefError(f"MFC {n!r}: log_return_value must be a bool, got {self.log_return_value!r}")

    def _check_remap(self, attr: str, remap: Any, allowed: tuple[str, ...] | None, what: str) -> None:
        if not isinstance(remap, dict):
            raise MFCDefError(f"MFC {self.name!r}: {attr} must be a dict, got {remap!r}")
        for k, v in remap.items():
            _check_name(self.name, f"{attr} keys and values", k)
            _check_name(self.name, f"{attr} keys and values", v)
            if allowed is not None and k not in allowed:
                raise MFCDefError(f"MFC {self.name!r}: {attr} renames {k!r}, which is not a {what} {list(allowed)}")
        targets = list(remap.values())
        dup = sorted({v for v in targets if targets.count(v) > 1})
        if dup:
            raise MFCDefError(f"MFC {self.name!r}: {attr} maps several keys onto {dup}")
        if attr == "output_key_remap":
            unknown = sorted(set(targets) - set(self.output_keys))
            if unknown:
                raise MFCDefError(
                    f"MFC {self.name!r}: output_key_remap produces {unknown}, not listed in output_keys {list(self.output_keys)}"
                )

    @property
    def role(self) -> str:
        """The model role this MFC runs on (alias of ``model_name``)."""
        return self.model_name

    @property
    def interface_input_keys(self) -> tuple[str, ...]:
        """Input keys as the interface sees them (after ``input_key_remap``)."""
        return tuple(self.input_key_remap.get(k, k) for k in self.input_keys)

    @property
    def interface_output_keys(self) -> tuple[str, ...]:
        """Output keys as the interface produces them (before ``output_key_remap``)."""
        back = {v: k for k, v in self.output_key_remap.items()}
        return tuple(back.get(k, k) for k in self.output_keys)

    @property
    def is_train(self) -> bool:
        return self.interface_type is ModelInterfaceType.TRAIN_STEP
