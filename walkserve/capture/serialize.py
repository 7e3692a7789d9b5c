"""JSON export and import of the Walk Graph IR (exact round trip), and tensor constants."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from walkserve.capture import ir

_ENCODER = msgspec.json.Encoder()


def to_json(graph: ir.WalkGraph) -> str:
    return _ENCODER.encode(graph).decode()


def from_json(text: str | bytes) -> ir.WalkGraph:
    graph = msgspec.json.decode(text, type=ir.WalkGraph)
    if graph.version != ir.IR_VERSION:
        raise ValueError(f"IR version {graph.version} is not supported (expected {ir.IR_VERSION})")
    return graph


def tensor_to_data(t: torch.Tensor) -> ir.TensorData:
    t = t.detach().cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return ir.TensorData(dtype, list(t.shape), raw)


def tensor_from_data(d: ir.TensorData) -> torch.Tensor:
    dtype = getattr(torch, d.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {d.dtype!r} in a tensor constant")
    buf = np.frombuffer(bytearray(d.data), dtype=np.uint8)
    flat = torch.from_numpy(buf).view(dtype)
    return flat.reshape(d.shape)
