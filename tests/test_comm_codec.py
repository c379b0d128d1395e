"""Codec round trips: every torch dtype bit-exact, shapes, numpy, containers, errors."""
from __future__ import annotations

import enum
import math
import warnings

import numpy as np
import pytest
import torch

from realflow.comm.codec import TORCH_DTYPES, CodecError, RawBuffer, decode, encode

torch.set_num_threads(1)
pytestmark = [pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")]


def wire(frames):
    """What the peer sees: independent byte copies of every frame."""
    return [bytes(memoryview(f)) for f in frames]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_every_torch_dtype_bit_exact(name):
    dtype = TORCH_DTYPES[name]
    for shape in [(3, 5), (), (0,), (2, 0, 4)]:
        t = random_tensor(dtype, shape)
        out = decode(wire(encode({"t": t})))["t"]
        assert out.dtype == dtype and tuple(out.shape) == shape
        if t.numel():
            assert same_bits(t, out), (name, shape)


def test_dtype_table_covers_the_important_ones():
    for name in ["bfloat16", "float16", "float32", "float64", "bool", "complex64", "complex128",
                 "uint8", "int8", "int16", "int32", "int64", "float8_e4m3fn", "float8_e5m2"]:
        assert name in TORCH_DTYPES


def test_non_contiguous_and_views():
    base = random_tensor(torch.bfloat16, (6, 8), seed=1)
    cases = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3).reshape(3, 1).expand(3, 4),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "neg_view": torch._neg_view(torch.randn(5, dtype=torch.complex128)),
        "grad": torch.randn(3, requires_grad=True),
        "zero_d": torch.tensor(3.25, dtype=torch.float64),
    }
    out = decode(wire(encode(cases)))
    for k, t in cases.items():
        expect = t.detach().resolve_conj().resolve_neg()
        assert out[k].is_contiguous()
        assert torch.equal(out[k], expect), k
        assert out[k].shape == expect.shape


def test_tensor_bytes_are_out_of_band_and_zero_copy():
    t = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB
    frames = encode({"ids": t, "meta": "x"})
    assert len(frames) == 2
    assert len(frames[0]) < 100  # header holds a reference, not the data
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == t.data_ptr()  # no copy on encode
    buf = bytearray(frames[1])
    out = decode([frames[0], buf])["ids"]
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data == out.data_ptr()  # no copy on decode
    buf[0:4] = (7).to_bytes(4, "little")
    assert out[0].item() == 7


def test_numpy_arrays():
    arrays = {
        "f4": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
        "big_endian": np.arange(5, dtype=">i8"),
        "bool": np.array([True, False, True]),
        "c16": np.array([1 + 2j, 3 - 4j]),
        "dt64": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
        "noncontig": np.arange(20).reshape(4, 5)[:, ::2],
        "zero_d": np.array(7, dtype=np.uint16),
        "empty": np.zeros((0, 3), dtype=np.float16),
        "unicode": np.array(["ab", "cde"]),
    }
    out = decode(wire(encode(arrays)))
    for k, a in arrays.items():
        assert out[k].dtype == a.dtype and out[k].shape == a.shape, k
        np.testing.assert_array_equal(out[k], a)


def test_nested_containers_and_scalars():
    obj = {
        "none": None, "t": True, "f": False, "int": -(2**63), "uint": 2**64 - 1, "float": 1.5,
        "inf": float("inf"), "str": "héllo ✓", "bytes": b"\x00\xff", "bytearray": bytearray(b"ab"),
        "list": [1, [2, [3, (4, 5)]]], "tuple": (1, "a", (None,)), "empty": [[], (), {}],
        3: "int key", (1, 2): "tuple key", "np_scalars": [np.float32(0.5), np.int64(3), np.bool_(True)],
        "nested": {"a": {"b": [{"t": torch.ones(2)}]}},
    }
    out = decode(wire(encode(obj)))
    assert out["tuple"] == (1, "a", (None,)) and isinstance(out["tuple"], tuple)
    assert isinstance(out["list"][1][1][1], tuple)
    assert out[3] == "int key" and out[(1, 2)] == "tuple key"
    assert out["bytearray"] == b"ab" and out["np_scalars"] == [0.5, 3, True]
    assert torch.equal(out["nested"]["a"]["b"][0]["t"], torch.ones(2))
    for k in ["none", "t", "f", "int", "uint", "float", "inf", "str", "bytes", "empty"]:
        assert out[k] == obj[k] and type(out[k]) is type(obj[k]), k
    assert math.isnan(decode(wire(encode(float("nan")))))


def test_raw_buffer_passthrough():
    blob = bytes(range(256)) * 1000
    frames = encode({"blob": RawBuffer(blob), "n": 1})
    assert len(frames) == 2 and len(frames[0]) < 50
    out = decode(wire(frames))
    assert isinstance(out["blob"], RawBuffer) and bytes(out["blob"]) == blob


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize("bad, path, tname", [
    ({"a": [1, {"b": object()}]}, "obj['a'][1]['b']", "object"),
    ({"s": {1, 2}}, "obj['s']", "set"),
    ([Color.RED], "obj[0]", "Color"),
    ({"x": (1, lambda: 0)}, "obj['x'][1]", "function"),
    ({"big": 2**70}, "obj['big']", "out of range"),
    ({"q": "quantized"}, "obj['q']", "quantized"),
    ({"sparse": torch.eye(2).to_sparse()}, "obj['sparse']", "sparse"),
    ({"obj_arr": np.array([object()])}, "obj['obj_arr']", "dtype object"),
])
def test_unknown_types_name_type_and_path(bad, path, tname):
    if bad.get("q") == "quantized" if isinstance(bad, dict) else False:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad = {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}
    with pytest.raises(TypeError) as ei:
        encode(bad)
    assert path in str(ei.value) and tname in str(ei.value), str(ei.value)


def test_garbled_input_is_codec_error():
    good = encode({"t": torch.arange(4), "r": RawBuffer(b"xyz")})
    with pytest.raises(CodecError):
        decode([b"\xc1"])  # invalid msgpack byte
    with pytest.raises(CodecError):
        decode([])
    with pytest.raises(CodecError, match="frame"):
        decode(wire(good)[:1])  # buffer frames missing
    with pytest.raises(CodecError, match="needs"):
        decode([good[0], bytes(memoryview(good[1]))[:-1], bytes(good[2])])  # truncated buffer
    with pytest.raises(CodecError):
        decode([bytes(good[0])[:-3], *wire(good)[1:]])  # truncated header
