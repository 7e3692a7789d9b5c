"""Value metadata: what the IR records about each value (shape and dtype, scalar kind, or
the type of an opaque object), observed on the sample inputs during capture."""

from __future__ import annotations

from typing import Any

import torch

from walkserve.capture import ir


def meta_of(value: Any) -> ir.ValueMeta:
    if isinstance(value, torch.Tensor):
        return ir.TensorMeta(list(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, bool):
        return ir.ScalarMeta("bool")
    if isinstance(value, int):
        return ir.ScalarMeta("int")
    if isinstance(value, float):
        return ir.ScalarMeta("float")
    return ir.OpaqueMeta(f"{type(value).__module__}.{type(value).__qualname__}")


def merge_meta(a: ir.ValueMeta, b: ir.ValueMeta) -> ir.ValueMeta:
    """The metadata of a value seen as ``a`` once and ``b`` another time: dimensions that
    differ become None (they vary between iterations or requests)."""
    if isinstance(a, ir.TensorMeta) and isinstance(b, ir.TensorMeta):
        if len(a.shape) != len(b.shape) or a.dtype != b.dtype:
            return ir.OpaqueMeta("varies")
        return ir.TensorMeta([x if x == y else None for x, y in zip(a.shape, b.shape)], a.dtype)
    return a if a == b else ir.OpaqueMeta("varies")
