"""Walk inputs and outputs as JSON. A tensor travels as nested lists, or as
``{"b64": <raw little-endian bytes, base64>, "dtype": "float32", "shape": [1, 4, 8, 8]}``;
Python ints, floats and bools as themselves. Inputs are checked against the walk's traced
input metadata (rank and dtype kind); a bad value raises ``ValueError`` naming the input."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.model import CapturedModel

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
MAX_ELEMENTS = 1 << 22


def required_inputs(captured: CapturedModel, walk: str) -> dict[str, ir.ValueMeta | None]:
    """The inputs a request starting at ``walk`` must give: the inputs of ``walk`` and of the
    walks its ``next`` chain reaches that no earlier walk of the chain produces."""
    need: dict[str, ir.ValueMeta | None] = {}
    produced: set[str] = set()
    current: str | None = walk
    seen: set[str] = set()
    while current is not None and current not in seen:
        seen.add(current)
        w = captured.walk(current)
        for i in w.inputs:
            if i.name not in produced:
                need.setdefault(i.name, i.meta)
        produced |= set(w.outputs)
        current = w.next
    return need


def input_defaults(captured: CapturedModel, walk: str) -> dict[str, int | float | bool]:
    """The defaults of the inputs of ``walk`` and of its ``next`` chain."""
    found: dict[str, int | float | bool] = {}
    current: str | None = walk
    seen: set[str] = set()
    while current is not None and current not in seen:
        seen.add(current)
        w = captured.walk(current)
        for i in w.inputs:
            if i.default is not None:
                found.setdefault(i.name, i.default)
        current = w.next
    return found


def decode_inputs(
    captured: CapturedModel, walk: str, raw: Mapping[str, Any]
) -> dict[str, torch.Tensor | int | float | bool]:
    need = required_inputs(captured, walk)
    defaults = input_defaults(captured, walk)
    raw = {**{n: v for n, v in defaults.items() if n in need}, **raw}
    missing = [n for n in need if n not in raw]
    if missing:
        raise ValueError(f"walk {walk!r} needs inputs {missing} (it takes {list(need)})")
    unknown = [n for n in raw if n not in need]
    if unknown:
        raise ValueError(f"walk {walk!r} takes no inputs {unknown} (it takes {list(need)})")
    return {name: _decode_one(name, raw[name], need[name]) for name in need}


def _decode_one(name: str, value: Any, meta: ir.ValueMeta | None) -> Any:
    if isinstance(meta, ir.ScalarMeta):
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
        }[meta.kind]
        if not ok:
            raise ValueError(f"input {name!r} must be a JSON {meta.kind}, got {value!r}")
        if meta.kind == "int" and not -(2**63) <= value < 2**63:
            raise ValueError(f"input {name!r} is outside the 64-bit integer range")
        return value
    if isinstance(meta, ir.OpaqueMeta):
        raise ValueError(f"input {name!r} is a {meta.kind} object and cannot be sent as JSON")
    dtype = DTYPES.get(meta.dtype.removeprefix("torch.")) if meta is not None else None
    tensor = tensor_from_json(name, value, dtype)
    if isinstance(meta, ir.TensorMeta) and tensor.dim() != len(meta.shape):
        raise ValueError(
            f"input {name!r} must have {len(meta.shape)} dimensions, got shape {list(tensor.shape)}"
        )
    return tensor


def tensor_from_json(name: str, value: Any, dtype: torch.dtype | None) -> torch.Tensor:
    if isinstance(value, dict):
        if set(value) != {"b64", "dtype", "shape"}:
            raise ValueError(f"input {name!r}: a tensor object has keys b64, dtype and shape")
        given = DTYPES.get(str(value.get("dtype")))
        if given is None:
            raise ValueError(f"input {name!r}: dtype must be one of {sorted(DTYPES)}")
        shape = value.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"input {name!r}: shape must be a list of non-negative ints")
        numel = math.prod(shape)  # exact: a product past 64 bits is refused, not wrapped
        if numel > MAX_ELEMENTS:
            raise ValueError(f"input {name!r} has {numel} elements; at most {MAX_ELEMENTS}")
        try:
            data = base64.b64decode(str(value.get("b64")), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"input {name!r}: b64 is not valid base64") from None
        itemsize = torch.empty((), dtype=given).element_size()
        if len(data) != numel * itemsize:
            raise ValueError(
                f"input {name!r}: b64 holds {len(data)} bytes, but shape {shape} of {value['dtype']}"
                f" needs {numel * itemsize}"
            )
        tensor = (
            torch.frombuffer(bytearray(data), dtype=given).reshape(shape)
            if numel
            else (torch.empty(shape, dtype=given))
        )
    elif isinstance(value, list):
        leaves = _leaf_types(value)
        wants_bool = dtype == torch.bool
        if bool in leaves and (not wants_bool or leaves != {bool}):
            kind = "booleans only" if wants_bool else "numbers, not booleans"
            raise ValueError(f"input {name!r} must hold {kind}")
        if wants_bool and leaves - {bool}:
            raise ValueError(f"input {name!r} must hold booleans only")
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"input {name!r} must be a rectangular nested list of numbers"
            ) from None
        if tensor.numel() > MAX_ELEMENTS:
            raise ValueError(
                f"input {name!r} has {tensor.numel()} elements; at most {MAX_ELEMENTS}"
            )
    else:
        raise ValueError(f"input {name!r} must be a tensor (nested list or b64 object)")
    if dtype is not None and tensor.dtype != dtype:
        if tensor.is_floating_point() and not dtype.is_floating_point and tensor.numel():
            raise ValueError(f"input {name!r} must hold integers ({dtype}), got floats")
        tensor = tensor.to(dtype)
    return tensor


def _leaf_types(value: list[Any]) -> set[type]:
    """The types of a nested list's leaves."""
    found: set[type] = set()
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            found.add(type(item))
    return found


def to_json(value: Any, encoding: str) -> Any:
    """An output value as JSON (``encoding``: "list" or "b64")."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if encoding == "b64":
            data = value.contiguous()
            if data.dtype == torch.bfloat16:
                raw = data.view(torch.int16).numpy().tobytes()
            else:
                raw = data.numpy().tobytes()
            return {
                "b64": base64.b64encode(raw).decode("ascii"),
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
            }
        return value.tolist()
    if isinstance(value, int | float | bool | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [to_json(v, encoding) for v in value]
    return repr(value)
