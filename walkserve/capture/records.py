"""Loop and stream records: what the tracer writes down while it runs a walk, for ``loops`` to
finalize and ``convert`` to translate.

Marker targets stand in the fx graphs for what is not a torch call; they never run::

    _loop_iter(key, index, *args)        one recorded call of loop body ``key`` (while tracing)
    _loop_node(key, deps)                a finalized loop reading the outer values ``deps``
    _loop_channel(loop, channel)         one terminal or accumulated channel of that loop
    _stream_chunk(source, stream, i)     chunk ``i`` of stream ``stream`` of ``source``
    _stream_context(source, stream, i)   the left-context length of that chunk

Records: a ``Scope`` per graph being recorded (a walk or a loop body) lists its ``LoopRecord``s
and ``StreamInfo``s; a ``LoopRecord`` holds the body traced once, one ``Iteration`` per call
(the arguments passed, the nodes standing for the outputs), the stop checks, the trip-count
expression or stream it iterates, and, once ``loops.finalize_scope`` has run, its ``Finalized``
plan. The tracer (``tracer``) fills them; nothing here traces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from walkserve.capture import ir
from walkserve.capture.api import LoopSpec
from walkserve.capture.chunk import ChunkPolicy


def _loop_iter(key: int, index: int, *args: Any) -> Any:
    """Marker target: one recorded iteration of loop ``key`` (never executed)."""
    raise RuntimeError("_loop_iter is a tracing marker and never runs")


def _loop_node(key: int, deps: list[Any]) -> Any:
    """Marker target: a finalized loop; ``deps`` are the outer values it reads."""
    raise RuntimeError("_loop_node is a tracing marker and never runs")


def _loop_channel(loop: Any, channel: str) -> Any:
    """Marker target: one output channel of a finalized loop."""
    raise RuntimeError("_loop_channel is a tracing marker and never runs")


def _stream_chunk(source: Any, stream: int, index: int) -> Any:
    """Marker target: chunk ``index`` of stream ``stream`` of ``source``."""
    raise RuntimeError("_stream_chunk is a tracing marker and never runs")


def _stream_context(source: Any, stream: int, index: int) -> Any:
    """Marker target: left-context length of chunk ``index``."""
    raise RuntimeError("_stream_context is a tracing marker and never runs")


MARKERS = (_loop_iter, _loop_node, _loop_channel, _stream_chunk, _stream_context)


@dataclass
class Iteration:
    node: fx.Node
    args: list[Any]  # per body parameter: the value passed (Proxy, scalar, tensor, other)
    outputs: list[fx.Node]  # per body output: the node standing for it
    source: str | None


@dataclass
class StreamInfo:
    key: int
    source: fx.Node
    policy: ChunkPolicy
    dim: int
    origin: str | None
    consumer: LoopRecord | None = None


@dataclass
class LoopRecord:
    """Everything recorded about one loop instance in one graph."""

    key: int
    name: str
    fn: Callable[..., Any]
    spec: LoopSpec
    params: list[str]
    static: dict[str, Any]  # parameters baked into the body (not tensors or scalars)
    body: fx.Graph
    n_outputs: int
    single_output: bool
    source: str | None
    iterations: list[Iteration] = field(default_factory=list)
    checks: list[fx.Node] = field(default_factory=list)  # stop predicates, one per check
    trip: ir.IntExpr | None = None  # range(<expr>) / iterations(<expr>) of walk inputs
    stream: StreamInfo | None = None
    closed: bool = False
    carries: bool = False  # some argument was a previous iteration's output
    finalized: Any = None  # loops.Finalized, set by loops.finalize


@dataclass
class Scope:
    """One graph being recorded: a walk or a loop body."""

    graph: fx.Graph
    loops: list[LoopRecord] = field(default_factory=list)
    streams: list[StreamInfo] = field(default_factory=list)
