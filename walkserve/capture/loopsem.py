"""Loop semantics shared by every executor of the IR (the reference interpreter, the batched
runner, the runtime's conductor): how many iterations a loop may run, what a per-step
parameter is in iteration ``i``, how a stream is cut into chunks, and which channels a finished
loop defines. One definition, so the executors cannot drift apart."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.chunk import ChunkPolicy, ChunkSpan, split

Chunks = list[tuple[torch.Tensor, ChunkSpan]]


class LoopError(RuntimeError):
    """A loop cannot run or finish: a bad bound, an empty accumulated channel."""


def int_input(inputs: Mapping[str, Any], name: str) -> int:
    """A walk input used as a loop bound: a Python int or a one-element tensor."""
    value = inputs.get(name)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value.item())
    if not isinstance(value, int) or isinstance(value, bool):
        raise LoopError(f"walk input {name!r} must be an int (a loop bound), got {value!r}")
    return value


def stream_edge(walk: ir.Walk, name: str) -> ir.StreamEdge:
    for edge in walk.streams:
        if edge.name == name:
            return edge
    raise LoopError(f"walk {walk.name!r} has no stream {name!r}")


def stream_chunks(walk: ir.Walk, node: ir.LoopNode, env: Mapping[str, Any]) -> Chunks | None:
    """The chunks of the complete stream a loop iterates (None if it iterates none)."""
    if not isinstance(node.trips, ir.StreamTrips):
        return None
    edge = stream_edge(walk, node.trips.stream)
    source = env[edge.source]
    dim = edge.dim if edge.dim >= 0 else source.dim() + edge.dim
    return split(source, ChunkPolicy.from_json(dict(edge.policy)), dim)


def loop_bound(node: ir.LoopNode, inputs: Mapping[str, Any], n_chunks: int | None) -> int:
    """Most iterations the loop may run: its trip count, capped by ``max_iters``."""
    trips = node.trips
    if isinstance(trips, ir.FixedTrips):
        return trips.count
    if isinstance(trips, ir.InputTrips):
        count = int_input(inputs, trips.input)
    else:
        if n_chunks is None:
            raise LoopError(f"loop {node.name} iterates a stream but no chunks were given")
        count = n_chunks
    if node.max_iters is not None:
        cap = (
            node.max_iters if isinstance(node.max_iters, int) else int_input(inputs, node.max_iters)
        )
        count = min(count, cap)
    return count


def step_value(
    role: ir.PerStep, i: int, value: Callable[[ir.Arg], Any], chunks: Chunks | None
) -> Any:
    """The value of a per-step parameter in iteration ``i``; ``value`` resolves outer args."""
    src = role.source
    if isinstance(src, ir.AffineStep):
        return src.start + i * src.step
    if isinstance(src, ir.TableStep):
        return value(src.values[i])
    if isinstance(src, ir.SelectStep):
        return value(src.source).select(src.dim, src.start + i * src.step)
    if chunks is None:
        raise LoopError(f"per-step chunk of stream {src.stream} without chunks")
    chunk, span = chunks[i]
    return chunk if src.part == "data" else span.context


def loop_channels(
    node: ir.LoopNode,
    carried: Mapping[str, Any],
    last: list[Any] | None,
    collected: Mapping[str, list[Any]],
) -> dict[str, Any]:
    """The channels a finished loop defines: terminal ones from the last iteration's outputs
    (after zero iterations: the carried initial value), accumulated ones joined."""
    result: dict[str, Any] = {}
    for ch, j in node.terminal.items():
        if last is not None:
            result[ch] = last[j]
            continue
        init = next(
            (
                carried[p.name]
                for p in node.params
                if isinstance(p.role, ir.Carried) and p.role.output == j
            ),
            None,
        )
        if init is None:
            raise LoopError(f"loop {node.name} ran no iteration, so {ch} has no value")
        result[ch] = init
    for ch, acc in node.accumulated.items():
        if not collected[ch]:
            raise LoopError(f"loop {node.name} ran no iteration, so {ch} is empty")
        join = torch.cat if acc.mode == "cat" else torch.stack
        result[ch] = join(collected[ch], dim=acc.dim)
    return result


def truth(value: Any, node: ir.LoopNode) -> bool:
    """A stop value as a Python bool: one boolean per request."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise LoopError(
                f"the stop of loop {node.name} must be one boolean per request, got shape {list(value.shape)}"
            )
        return bool(value.item())
    return bool(value)
