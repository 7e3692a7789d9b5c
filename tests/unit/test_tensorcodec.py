"""Tensor <-> (header, bytes): every allowed dtype, odd layouts, and header validation."""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.tensorcodec import (
    DTYPES,
    TensorHeader,
    copy_into,
    dtype_name,
    from_bytes,
    header_of,
    to_bytes,
)


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order (compares NaNs and -0.0 exactly, unlike ==)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (any bit pattern, NaNs included; 0/1 for bool)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    nbytes = math.prod(shape) * dtype.itemsize
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return flat.view(dtype).view(shape)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert raw(a) == raw(b)


ALL_DTYPES = sorted(DTYPES)


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: t, id="contiguous"),
        pytest.param(lambda t: t.transpose(0, 2), id="transposed"),
        pytest.param(lambda t: t[:, ::2, 1:], id="strided-slice"),
        pytest.param(lambda t: t[1, 2, 3], id="0-d"),
        pytest.param(lambda t: t[:, :0], id="empty"),
        pytest.param(lambda t: t[:1, :1, :1].expand(2, 3, 4), id="expanded"),
    ],
)
def test_round_trip_every_dtype(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    t = make(random_tensor(DTYPES[name], (3, 4, 5)))
    header, data = to_bytes(t)
    assert header == TensorHeader(name, tuple(t.shape), t.numel() * t.element_size())
    assert len(data) == header.nbytes
    assert_same(from_bytes(header, data), t)

    buf = bytearray(header.nbytes)
    assert copy_into(t, buf) == header
    assert bytes(buf) == data
    assert_same(from_bytes(header, buf, copy=False), t)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(ALL_DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    seed=st.integers(0, 2**16),
    permute=st.booleans(),
)
def test_round_trip_property(name: str, shape: tuple[int, ...], seed: int, permute: bool) -> None:
    t = random_tensor(DTYPES[name], shape, seed)
    if permute and t.dim() > 1:
        t = t.permute(*reversed(range(t.dim())))
    header, data = to_bytes(t)
    assert_same(from_bytes(header, data), t)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(header), type=TensorHeader)
    assert decoded == header


def test_copy_does_not_alias_the_buffer() -> None:
    t = torch.arange(6, dtype=torch.float32)
    header, data = to_bytes(t)
    buf = bytearray(data)
    out = from_bytes(header, buf)
    buf[:] = bytes(len(buf))
    assert torch.equal(out, t)


def test_zero_copy_view_aliases_the_buffer_only_when_asked() -> None:
    t = torch.arange(6, dtype=torch.int32)
    header, data = to_bytes(t)
    buf = bytearray(data)
    view = from_bytes(header, buf, copy=False)
    buf[:4] = (42).to_bytes(4, "little")
    assert view[0].item() == 42
    with pytest.raises(ValueError, match="writable"):
        from_bytes(header, data, copy=False)  # bytes are immutable


def test_lazy_conjugate_and_negative_views_are_materialised() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for t in (z.conj(), torch._neg_view(z)):
        header, data = to_bytes(t)
        assert torch.equal(from_bytes(header, data), t.resolve_conj().resolve_neg())
        buf = bytearray(header.nbytes)
        copy_into(t, buf)
        assert torch.equal(from_bytes(header, buf), t.resolve_conj().resolve_neg())


def test_tensor_requiring_grad_is_encoded_by_value() -> None:
    t = torch.ones(3, requires_grad=True) * 2
    header, data = to_bytes(t)
    out = from_bytes(header, data)
    assert not out.requires_grad
    assert torch.equal(out, t.detach())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "qint8", "shape": (2,), "nbytes": 2}, "not allowed"),
        ({"dtype": "torch.float32", "shape": (2,), "nbytes": 8}, "not allowed"),
        ({"dtype": "float32", "shape": (2,), "nbytes": 4}, "does not match"),
        ({"dtype": "float32", "shape": (2, 3), "nbytes": 25}, "does not match"),
        ({"dtype": "float32", "shape": (-1, 2), "nbytes": 0}, "non-negative"),
        ({"dtype": "uint8", "shape": (1,) * 65, "nbytes": 1}, "dims"),
    ],
)
def test_bad_headers_are_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TensorHeader(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(kwargs), type=TensorHeader)


def test_byte_count_must_match_header() -> None:
    header, data = to_bytes(torch.zeros(4))
    with pytest.raises(ValueError, match="16 bytes, buffer holds 15"):
        from_bytes(header, data[:-1])
    with pytest.raises(ValueError, match="cannot hold"):
        copy_into(torch.zeros(4), bytearray(15))
    with pytest.raises(ValueError, match="writable"):
        copy_into(torch.zeros(4), bytes(16))


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized and complex32 are deprecated
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(2, 2).to_sparse(), id="sparse"),
        pytest.param(
            lambda: torch.quantize_per_tensor(torch.zeros(2), 1.0, 0, torch.quint8), id="quint8"
        ),
        pytest.param(lambda: torch.zeros(2, device="meta"), id="meta"),
        pytest.param(lambda: torch.zeros(2, dtype=torch.complex32), id="complex32"),
    ],
)
def test_tensors_without_plain_bytes_are_rejected(make: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(ValueError):
        header_of(make())


def test_dtype_names_are_the_torch_names() -> None:
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name == str(dtype).removeprefix("torch.")
