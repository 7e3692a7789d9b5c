"""A rank's device: where its components, their inputs and what it makes live.

The plan names a device kind (``ExecutablePlan.device``: ``cpu``, ``cuda`` or ``cuda:N``);
each worker resolves its own (``rank_device``: ``cuda`` is ``cuda:<rank mod the visible
GPUs>``, as a tensor-parallel group's ranks bind theirs) and, once the model is loaded, moves
there what it runs (``place``): the components placed on it, and the model's tensors that are
in no component (glue reads them). Components of other ranks stay where the loader put them:
a rank holds on its device only what it runs. Values reach a rank as CPU tensors (the wire
has no device) and are moved to its device as they are decoded (``to_device``); what leaves
it is copied to the host by the codec (``tensorcodec``). On the CPU all of this is a no-op.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from walkserve.lowering.plan import ExecutablePlan

__all__ = ["place", "placed_components", "rank_device", "to_device"]


def rank_device(kind: str, rank: int) -> torch.device:
    """The torch device of ``rank`` for the plan's device ``kind``; a clear error where the
    kind asks for CUDA and this process sees none."""
    device = torch.device(kind)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"rank {rank}: device must be cpu, cuda or cuda:N, got {kind!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"rank {rank}: the plan runs on {kind!r} but this process sees no CUDA device "
            "(torch.cuda.is_available() is False); lower for device='cpu' instead"
        )
    count = torch.cuda.device_count()
    index = rank % count if device.index is None else device.index
    if index >= count:
        raise RuntimeError(f"rank {rank}: device {kind!r} asked for, {count} visible")
    return torch.device("cuda", index)


def placed_components(plan: ExecutablePlan, rank: int) -> set[str]:
    """Module paths of the components whose nodes run on ``rank``."""
    return {
        node.target
        for walk in plan.walks
        for node in plan.nodes(walk)
        if node.kind == "component" and rank in node.ranks
    }


def place(
    model: nn.Module,
    mine: Collection[str],
    others: Collection[str],
    device: torch.device,
) -> None:
    """Move the components ``mine`` (module paths) of ``model`` and every tensor of it that
    is in no component to ``device``; the components ``others`` (of other ranks) stay. A
    parameter shared with another rank's component moves for it too (one tensor). On the CPU
    nothing moves: the model stays as its loader made it (as before there were devices)."""
    if device.type == "cpu":
        return
    mine, others = set(mine), set(others) - set(mine)

    def visit(module: nn.Module, path: str, in_other: bool) -> None:
        if path in mine:
            module.to(device)
            return
        in_other = in_other or path in others
        if in_other and not any(m.startswith(f"{path}.") for m in mine):
            return  # another rank's component, none of this rank's inside it
        if not in_other:  # the model's own tensors, outside every component: as ``to`` moves
            module._apply(lambda t: t.to(device), recurse=False)  # them, not its children's
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name, in_other)

    visit(model, "", False)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors (also inside lists and tuples) on ``device``; other values
    as they are."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(to_device(v, device) for v in value)
    return value
