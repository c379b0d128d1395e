"""msgpack codec with out-of-band, zero-copy buffers for tensors and arrays.

Why: control messages carry small metadata *and* sometimes tensors. Packing a
tensor's bytes into the msgpack body would copy it (twice: into the body and
out of it). Instead every ``torch.Tensor`` / ``numpy.ndarray`` / ``RawBuffer``
becomes a tiny msgpack *ext reference* (frame index, dtype, shape) and its bytes
travel as a separate frame that ZMQ can send without copying and that the
receiver wraps with ``torch.frombuffer`` without copying.

Wire format (list of frames)::

    frame 0      msgpack header (the object, with ext references)
    frame 1..n   raw buffers, in the order they are referenced

No pickle anywhere: only the types listed below can be encoded, anything else
raises ``TypeError`` naming the type and where in the object it was found.

Supported: None, bool, int (64-bit), float, str, bytes, bytearray (decoded as
bytes), list, tuple (kept a tuple), dict (any key type above; dict subclasses
decode as dict), torch.Tensor (every non-quantized dtype, strided layout; CUDA
tensors are copied to CPU), numpy.ndarray (non-object, non-structured dtypes),
numpy scalars (decoded as the Python scalar), ``RawBuffer``. Subclasses of
int/float/str/list/dict are sent as their base type; Enum members are refused.

Decoded tensors *alias* the received frame memory (no copy). The frames are
private to the message, so writing into a decoded tensor is safe, but the
tensor keeps the whole frame alive. Decoded numpy arrays are read-only when the
frame is read-only (copy them to modify).
"""
from __future__ import annotations

import enum
import math
import threading
import warnings
from typing import Any, Sequence

import msgpack
import numpy as np
import torch

__all__ = ["encode", "decode", "CodecError", "RawBuffer", "TORCH_DTYPES", "dtype_name", "dtype_from_name"]

# ext type codes (stable wire constants)
_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_TUPLE = 3
_EXT_RAW = 4


class CodecError(ValueError):
    """A message could not be decoded (garbled, truncated or from an incompatible peer)."""


class RawBuffer:
    """A bytes-like payload that travels as its own frame (zero copy both ways).

    Why: large opaque blobs (serialized files, already-packed buffers) should not be
    copied into the msgpack header. On decode ``.data`` is a read-only memoryview of
    the received frame; call ``bytes(raw)`` to copy.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data)
        self.data = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")

    def __bytes__(self) -> bytes:
        return self.data.tobytes()

    def __len__(self) -> int:
        return self.data.nbytes

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawBuffer):
            return self.data == other.data
        return NotImplemented

    def __repr__(self) -> str:
        return f"RawBuffer({self.data.nbytes} bytes)"


def _build_dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype):
            name = str(value).removeprefix("torch.")
            if name.startswith(("qint", "quint")):
                continue  # quantized tensors carry scale/zero-point: not raw bytes
            table[name] = value
    return table


#: every torch dtype the codec (and shm) can carry, by canonical name ("bfloat16", "float8_e4m3fn", ...)
TORCH_DTYPES: dict[str, torch.dtype] = _build_dtype_table()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TypeError(f"torch dtype {dtype} cannot be sent (quantized dtypes are not supported)")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown torch dtype {name!r} (known: {', '.join(sorted(TORCH_DTYPES))})") from None


class _Unsupported(Exception):
    """Internal: raised inside msgpack's default hook; converted to TypeError with a path."""


def tensor_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview | bytes]:
    """Return (contiguous CPU tensor, a zero-copy byte view of it). Shared with shm."""
    if t.layout != torch.strided:
        raise _Unsupported(f"torch.Tensor with layout {t.layout}")
    if t.is_quantized:
        raise _Unsupported(f"quantized torch.Tensor ({t.dtype})")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.numel() == 0:
        return t, b""
    # numpy() keeps the tensor alive through the memoryview's base
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Encoder:
    """Per-thread encoder: a reusable msgpack Packer (creating one per message costs more than packing
    a small control message) whose ``default`` hook moves buffers into ``self.frames``."""

    def __init__(self) -> None:
        self.frames: list[bytes | memoryview] = []
        self.packer = msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True, autoreset=True)

    def default(self, o: Any) -> Any:
        frames = self.frames
        if type(o) is tuple:  # nested pack: the Packer itself is not re-entrant
            return msgpack.ExtType(_EXT_TUPLE, _pack(list(o), self.default))
        if isinstance(o, torch.Tensor):
            try:
                t, buf = tensor_bytes(o)
            except _Unsupported:
                raise
            except Exception as e:  # e.g. a meta tensor has no bytes to send
                raise _Unsupported(f"torch.Tensor on device {o.device} ({type(e).__name__}: {e})") from None
            frames.append(buf)
            return msgpack.ExtType(_EXT_TENSOR, _pack([len(frames) - 1, dtype_name(t.dtype), list(t.shape)], None))
        if isinstance(o, np.ndarray):
            if o.dtype.hasobject or o.dtype.fields is not None or o.dtype.subdtype is not None:
                raise _Unsupported(f"numpy.ndarray with dtype {o.dtype}")
            a = o if o.flags.c_contiguous else np.ascontiguousarray(o)  # (ascontiguousarray makes 0-d 1-d)
            frames.append(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
            return msgpack.ExtType(_EXT_NDARRAY, _pack([len(frames) - 1, o.dtype.str, list(o.shape)], None))
        if isinstance(o, RawBuffer):
            frames.append(o.data)
            return msgpack.ExtType(_EXT_RAW, _pack(len(frames) - 1, None))
        if isinstance(o, np.generic) and isinstance(o, (np.bool_, np.integer, np.floating)):
            return o.item()
        if isinstance(o, enum.Enum):
            raise _Unsupported(type(o).__qualname__)
        if isinstance(o, dict):
            return dict(o)
        if isinstance(o, list):
            return list(o)
        if isinstance(o, (bytearray, memoryview)):
            return bytes(o)
        if isinstance(o, bool):
            return bool(o)
        for base in (int, float, str, bytes):
            if isinstance(o, base):
                return base(o)
        raise _Unsupported(type(o).__qualname__)


_local = threading.local()


def encode(obj: Any) -> list[bytes | memoryview]:
    """Encode ``obj`` into frames: [msgpack header, raw buffer frames...]. Zero-copy for buffers."""
    enc = getattr(_local, "encoder", None)
    if enc is None or enc.frames:  # (non-empty frames: re-entered from a hook; use a fresh one)
        enc = _local.encoder = _Encoder()
    frames: list[bytes | memoryview] = [b""]
    enc.frames = frames
    try:
        frames[0] = enc.packer.pack(obj)
    except _Unsupported as e:
        _local.encoder = None  # do not reuse a packer that failed half-way
        raise TypeError(f"cannot encode {e} at {_find_culprit(obj) or 'obj'} (no pickle on the wire; "
                        "send plain containers, str/int/float/bytes, tensors or numpy arrays)") from None
    except (OverflowError, ValueError) as e:
        _local.encoder = None
        raise TypeError(f"cannot encode value at {_find_culprit(obj) or 'obj'}: {e}") from None
    finally:
        enc.frames = []
    return frames


def _pack(obj: Any, default: Any) -> bytes:
    return msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True)


def _find_culprit(obj: Any, path: str = "obj") -> str:
    """Locate the first value that msgpack cannot take, as a python-like path."""
    if obj is None or type(obj) in (bool, str, bytes, bytearray, float):
        return ""  # fine
    if type(obj) is int:
        return path if not (-(2**63) <= obj < 2**64) else ""
    if isinstance(obj, (torch.Tensor, RawBuffer)):
        ok = not isinstance(obj, torch.Tensor) or (obj.layout == torch.strided and not obj.is_quantized
                                                   and obj.device.type != "meta")
        return "" if ok else path
    if isinstance(obj, np.ndarray):
        return path if (obj.dtype.hasobject or obj.dtype.fields is not None) else ""
    if isinstance(obj, np.generic) and isinstance(obj, (np.bool_, np.integer, np.floating)):
        return ""
    if isinstance(obj, enum.Enum):
        return path
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = _find_culprit(k, f"{path}.keys()[{k!r}]") or _find_culprit(v, f"{path}[{k!r}]")
            if p:
                return p
        return ""
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            p = _find_culprit(v, f"{path}[{i}]")
            if p:
                return p
        return ""
    if isinstance(obj, (int, float, str, bytes, memoryview)):
        return ""
    return path


_frombuffer_warned = False


def _as_buffer(frame: Any) -> memoryview:
    mv = memoryview(frame)  # bytes, bytearray, memoryview, zmq.Frame all expose the buffer protocol
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _tensor_from(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    global _frombuffer_warned
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if not _frombuffer_warned and buf.readonly:
        # torch warns once per process that the frame buffer is read-only; the frame is private to
        # this message, so aliasing it is safe and intended.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(buf, dtype=torch.uint8)
        _frombuffer_warned = True
    else:
        t = torch.frombuffer(buf, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


def _single_frame_ext_hook(code: int, data: bytes) -> Any:
    """Ext types of a one-frame message: only tuples can occur (buffers would need more frames)."""
    if code == _EXT_TUPLE:
        return tuple(msgpack.unpackb(data, ext_hook=_single_frame_ext_hook, raw=False, strict_map_key=False))
    if code in (_EXT_RAW, _EXT_TENSOR, _EXT_NDARRAY):
        raise CodecError("reference to a buffer frame but the message has 1 frame")
    raise CodecError(f"unknown msgpack ext type {code}")


def decode(frames: Sequence[Any]) -> Any:
    """Inverse of :func:`encode`. Raises :class:`CodecError` on garbled input."""
    if not frames:
        raise CodecError("no frames to decode")
    if len(frames) == 1:  # a control message without buffers: the common case, kept lean
        try:
            f = frames[0]
            return msgpack.unpackb(f if type(f) is bytes else _as_buffer(f), ext_hook=_single_frame_ext_hook,
                                   raw=False, strict_map_key=False)
        except CodecError:
            raise
        except (ValueError, TypeError, KeyError, msgpack.UnpackException, RuntimeError) as e:
            raise CodecError(f"garbled message: {type(e).__name__}: {e}") from None
    bufs = [_as_buffer(f) for f in frames]

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False))
        if code == _EXT_RAW:
            idx = msgpack.unpackb(data)
            return RawBuffer(_frame(idx))
        if code in (_EXT_TENSOR, _EXT_NDARRAY):
            idx, dt, shape = msgpack.unpackb(data, raw=False)
            buf = _frame(idx)
            if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise CodecError(f"bad shape {shape!r} for frame {idx}")
            if code == _EXT_TENSOR:
                dtype = dtype_from_name(dt)
                want = math.prod(shape) * dtype.itemsize
            else:
                try:
                    npdt = np.dtype(dt)
                except TypeError:
                    raise CodecError(f"unknown numpy dtype {dt!r}") from None
                if npdt.hasobject:
                    raise CodecError(f"numpy object dtype {dt!r} refused")
                want = math.prod(shape) * npdt.itemsize
            if buf.nbytes != want:
                raise CodecError(f"frame {idx} holds {buf.nbytes} bytes but {dt}{shape} needs {want}")
            if code == _EXT_TENSOR:
                return _tensor_from(buf, dtype, shape)
            if not want:
                return np.empty(tuple(shape), npdt)
            return np.frombuffer(buf, dtype=np.uint8).view(npdt).reshape(tuple(shape))
        raise CodecError(f"unknown msgpack ext type {code}")

    def _frame(idx: Any) -> memoryview:
        if not isinstance(idx, int) or not 1 <= idx < len(bufs):
            raise CodecError(f"reference to frame {idx!r} but the message has {len(bufs)} frames")
        return bufs[idx]

    try:
        return msgpack.unpackb(bufs[0], ext_hook=ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except (ValueError, TypeError, KeyError, msgpack.UnpackException, RuntimeError) as e:
        raise CodecError(f"garbled message: {type(e).__name__}: {e}") from None
