"""Tensors as (dtype name, shape, raw bytes): the only form in which a tensor crosses a process.

Owns the mapping between ``torch.Tensor`` and its wire form, and nothing else. What crosses
the boundary is a ``TensorHeader`` (a msgspec struct: dtype name from a fixed allowlist, shape,
byte count) plus the tensor's bytes in C-contiguous order. No pickle is involved anywhere: a
header is plain data, and bytes are reinterpreted through ``torch.frombuffer`` and ``view``.

    header, data = to_bytes(t)            # t: any strided tensor, any device
    t2 = from_bytes(header, data)         # a fresh CPU tensor; never aliases ``data``
    view = from_bytes(header, buf, copy=False)   # zero-copy: aliases the writable ``buf``
    copy_into(t, buf)                     # writes t's bytes into ``buf[:header.nbytes]``

A ``TensorHeader`` validates itself when it is built and when it is decoded from a message:
unknown dtype names, negative dimensions, and a byte count that does not match the shape are
``ValueError`` (``msgspec.ValidationError`` while decoding).
"""

from __future__ import annotations

import math
import warnings
from typing import Annotated, TypeAlias

import msgspec
import torch

# Every dtype that may cross a process, by wire name. Quantized, bit-packed and experimental
# dtypes (qint8, uint4, complex32, ...) are not here on purpose: their byte layout is either
# not plain or not stable across torch versions.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

MAX_NDIM = 64

# Anything exposing a contiguous byte buffer (wrap an ``mmap`` in ``memoryview`` first).
Buffer: TypeAlias = bytes | bytearray | memoryview

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class TensorHeader(msgspec.Struct, frozen=True):
    """What a reader needs to rebuild a tensor from ``nbytes`` raw C-contiguous bytes."""

    dtype: str
    shape: Annotated[tuple[NonNegInt, ...], msgspec.Meta(max_length=MAX_NDIM)]
    nbytes: NonNegInt

    def __post_init__(self) -> None:
        # Runs on construction and on msgspec decode; a header that exists is consistent.
        dtype = DTYPES.get(self.dtype)
        if dtype is None:
            raise ValueError(
                f"dtype {self.dtype!r} is not allowed on the wire; allowed: {sorted(DTYPES)}"
            )
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise ValueError(f"shape must have <= {MAX_NDIM} non-negative dims, got {self.shape}")
        expected = math.prod(self.shape) * dtype.itemsize
        if self.nbytes != expected:
            raise ValueError(
                f"nbytes={self.nbytes} does not match shape {self.shape} of {self.dtype} "
                f"({expected} bytes)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ``ValueError`` if it may not cross a process."""
    name = _NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} is not allowed on the wire; allowed: {sorted(DTYPES)}")
    return name


def header_of(tensor: torch.Tensor) -> TensorHeader:
    """The header describing ``tensor``; ``ValueError`` for tensors without plain bytes."""
    if tensor.layout != torch.strided or tensor.is_nested:
        raise ValueError(f"only strided dense tensors can be encoded, got layout {tensor.layout}")
    if tensor.is_meta:
        raise ValueError("a meta tensor has no data to encode")
    name = dtype_name(tensor.dtype)
    return TensorHeader(name, tuple(tensor.shape), tensor.numel() * tensor.element_size())


def to_bytes(tensor: torch.Tensor) -> tuple[TensorHeader, bytes]:
    """``tensor``'s header and a copy of its bytes in C-contiguous order (one copy for a
    contiguous CPU tensor)."""
    header = header_of(tensor)
    if header.nbytes == 0:
        return header, b""
    return header, _flat_bytes(tensor).numpy().tobytes()


def copy_into(
    tensor: torch.Tensor, buf: Buffer, header: TensorHeader | None = None
) -> TensorHeader:
    """Write ``tensor``'s bytes into the writable buffer ``buf`` (starting at its first byte,
    which should be 64-byte aligned) and return its header (pass ``header_of(tensor)`` as
    ``header`` if you have it). Strided and non-CPU sources are copied directly, without an
    intermediate contiguous copy."""
    if header is None:
        header = header_of(tensor)
    if header.nbytes == 0:
        return header
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError("copy_into needs a writable buffer")
    if mv.nbytes < header.nbytes:
        raise ValueError(f"buffer of {mv.nbytes} bytes cannot hold {header.nbytes} bytes")
    _view(mv, header).copy_(tensor.detach())
    return header


def from_bytes(header: TensorHeader, data: Buffer, *, copy: bool = True) -> torch.Tensor:
    """Rebuild the tensor ``header`` describes from exactly ``header.nbytes`` bytes.

    ``copy=True`` (default): a new CPU tensor that owns its memory; ``data`` may be reused or
    overwritten afterwards. ``copy=False``: a zero-copy view that aliases ``data``, which must
    be writable and stay unchanged for as long as the view is used.
    """
    mv = memoryview(data)
    if mv.nbytes != header.nbytes:
        raise ValueError(f"header says {header.nbytes} bytes, buffer holds {mv.nbytes}")
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=header.torch_dtype)
    if not copy:
        if mv.readonly:
            raise ValueError("a zero-copy view needs a writable buffer; use copy=True")
        return _view(mv, header)
    if not mv.readonly:
        return _view(mv, header).clone()
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers (bytes); this view is only read, then dropped.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return _view(mv, header).clone()


def _view(mv: memoryview, header: TensorHeader) -> torch.Tensor:
    """A tensor of ``header``'s dtype and shape over the first ``nbytes`` (> 0) bytes of
    ``mv``."""
    dtype = header.torch_dtype
    flat = torch.frombuffer(mv, dtype=dtype, count=header.nbytes // dtype.itemsize)
    return flat.view(header.shape)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``tensor``'s bytes in C order: a view when ``tensor`` is a
    contiguous CPU tensor without lazy conjugation, a copy otherwise."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)
