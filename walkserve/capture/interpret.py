"""The reference interpreter: runs walks of a captured model from the IR alone.

One process, one request at a time, on CPU. It is the oracle the lowering and the runtime are
tested against, so it is written for obviousness, not speed: every node is executed in block
order; a loop runs its body block once per iteration exactly as ``ir.LoopNode`` documents
(per-step values computed from the iteration index, carried values passed on, accumulated
channels joined at the end, the stop evaluated after each iteration).

It never calls the model's walk or loop-body methods; it calls components (by module path) and
glue functions (by their allowlisted names) with the arguments the IR records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from walkserve.capture import dataflow, ir
from walkserve.capture.chunk import ChunkPolicy
from walkserve.capture.convert import SAFE_BUILTINS, resolve_function
from walkserve.capture.errors import CaptureError
from walkserve.capture.loopsem import (
    loop_bound,
    loop_channels,
    needs_iteration,
    step_value,
    stream_chunks,
    truth,
)
from walkserve.capture.values import merge_meta, meta_of

if TYPE_CHECKING:
    from walkserve.capture.model import CapturedModel

MAX_TRANSITIONS = 64


class InterpreterError(RuntimeError):
    """A walk could not run: a missing input, a failing node (named, and ``source``: the
    user's line that made it), a bad transition."""

    def __init__(self, message: str, source: str | None = None) -> None:
        super().__init__(message)
        self.source = source


Observer = Callable[[str, Any], None]
OpObserver = Callable[[ir.Op, list[Any], dict[str, Any]], None]


class Interpreter:
    """Runs walks of ``captured``. ``loop_limit`` caps every loop's iterations (capture uses
    2 to record value metadata cheaply), except that a loop feeding a stream runs on until
    its consumer gets ``loop_limit`` chunks (``stream_demands``); ``record`` collects the metadata of every value;
    ``observe(name, value)`` sees every value bound and ``observe_op(op, args, kwargs)`` every
    op's materialized arguments (lowering uses both to find batch dimensions and samples)."""

    def __init__(
        self,
        captured: CapturedModel,
        *,
        loop_limit: int | None = None,
        record: dict[str, ir.ValueMeta] | None = None,
        check_carried: bool = False,
        observe: Observer | None = None,
        observe_op: OpObserver | None = None,
    ) -> None:
        self.captured = captured
        self.model: nn.Module = captured.model
        self.loop_limit = loop_limit
        self.record = record
        self.check_carried = check_carried
        self.observe = observe
        self.observe_op = observe_op
        self._functions: dict[str, Callable[..., Any]] = {}
        self._modules: dict[str, nn.Module] = {}
        self._walk_inputs: Mapping[str, Any] = {}
        self._walk: ir.Walk | None = None
        self._demands: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ requests

    def run(self, inputs: Mapping[str, Any], walk: str | None = None) -> dict[str, Any]:
        """Run a request from ``walk`` (default: the first entry walk) through the walk
        transitions; returns the client outputs of every walk it ran (later ones win)."""
        graph = self.captured.graph
        entries = graph.entry_walks()
        if walk is None and not entries:
            raise InterpreterError(
                "the model has no entry walk (every walk is another's next); name one"
            )
        current: str | None = walk or entries[0]
        state: dict[str, Any] = dict(inputs)
        client: dict[str, Any] = {}
        for _ in range(MAX_TRANSITIONS):
            if current is None:
                return client
            if current not in graph.walks:
                raise InterpreterError(
                    f"unknown walk {current!r}; the model has {sorted(graph.walks)}"
                )
            w = graph.walks[current]
            outputs = self.run_walk(current, state)
            state.update(outputs)
            client.update({k: v for k, v in outputs.items() if k not in w.state})
            current = self.captured.next_walk(state, current, outputs)
        raise InterpreterError(
            f"more than {MAX_TRANSITIONS} walk transitions; is the transition cyclic?"
        )

    def run_walk(self, name: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run one walk; ``inputs`` may hold more values than it needs."""
        w = self.captured.graph.walks[name]
        inputs = ir.with_defaults(w, inputs)
        missing = [i.name for i in w.inputs if i.name not in inputs]
        if missing:
            raise InterpreterError(f"walk {name!r} needs inputs {missing}")
        self._walk, self._walk_inputs = w, {i.name: inputs[i.name] for i in w.inputs}
        self._demands = {} if self.loop_limit is None else stream_demands(w, self.loop_limit)
        env: dict[str, Any] = {}
        for i in w.inputs:
            self._bind(env, i.name, inputs[i.name])
        self.block(w.body, env)
        return {k: self.value(a, env) for k, a in w.outputs.items()}

    # ------------------------------------------------------------------ blocks

    def block(self, block: ir.Block, env: dict[str, Any]) -> None:
        for node in block.nodes:
            if isinstance(node, ir.Op):
                self._bind(env, node.name, self.op(node, env))
            else:
                for channel, value in self.loop(node, env).items():
                    self._bind(env, channel, value)

    def op(self, node: ir.Op, env: dict[str, Any]) -> Any:
        args = [self.value(a, env) for a in node.args]
        kwargs = {k: self.value(a, env) for k, a in node.kwargs.items()}
        if self.observe_op is not None:
            self.observe_op(node, args, kwargs)
        fn = self.callable(node, args)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            where = f" ({node.source})" if node.source else ""
            raise InterpreterError(
                f"node {node.name} ({node.target}){where} failed: {e}", node.source
            ) from e

    def callable(self, node: ir.Op, args: list[Any]) -> Callable[..., Any]:
        """The function an op calls: its component module, or its checked glue target."""
        if node.kind == "component":
            module = self._modules.get(node.target)
            if module is None:
                module = self._modules[node.target] = self.model.get_submodule(node.target)
            return module
        kind, _, name = node.target.partition(":")
        if kind == "method":
            if name.startswith("_"):
                raise InterpreterError(f"glue may not call private method {name!r}")
            return lambda obj, *a, **k: getattr(obj, name)(*a, **k)
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = resolve_function(name)
        if name == "builtins.getattr" and (
            len(args) < 2 or not isinstance(args[1], str) or args[1].startswith("_")
        ):
            raise InterpreterError("glue getattr may only read public attributes")
        assert name.rpartition(".")[2] in SAFE_BUILTINS or not name.startswith("builtins.")
        return fn

    def value(self, arg: ir.Arg, env: Mapping[str, Any]) -> Any:
        if isinstance(arg, ir.Ref):
            try:
                return env[arg.name]
            except KeyError:
                raise InterpreterError(f"value {arg.name!r} is not defined here") from None
        if isinstance(arg, ir.Const):
            return arg.value
        if isinstance(arg, ir.FloatConst):
            return float(arg.repr)
        if isinstance(arg, ir.ListArg):
            return [self.value(a, env) for a in arg.items]
        if isinstance(arg, ir.TupleArg):
            return tuple(self.value(a, env) for a in arg.items)
        if isinstance(arg, ir.DictArg):
            return {k: self.value(a, env) for k, a in arg.items.items()}
        if isinstance(arg, ir.SliceArg):
            return slice(
                self.value(arg.start, env), self.value(arg.stop, env), self.value(arg.step, env)
            )
        if isinstance(arg, ir.DTypeArg):
            dtype = getattr(torch, arg.name, None)
            if not isinstance(dtype, torch.dtype):
                raise InterpreterError(f"unknown dtype {arg.name!r}")
            return dtype
        if isinstance(arg, ir.DeviceArg):
            return torch.device(arg.name)
        if isinstance(arg, ir.EllipsisArg):
            return ...
        if isinstance(arg, ir.TensorConst):
            return self.captured.constant(arg.name)
        if isinstance(arg, ir.ModelAttr):
            return self.captured.attr(arg.path)
        raise InterpreterError(f"unknown argument {arg!r}")

    # ------------------------------------------------------------------ loops

    def loop(self, node: ir.LoopNode, env: dict[str, Any]) -> dict[str, Any]:
        assert self._walk is not None
        chunks = stream_chunks(self._walk, node, env)
        bound = loop_bound(node, self._walk_inputs, None if chunks is None else len(chunks))
        limit = bound if self.loop_limit is None else min(bound, self.loop_limit)
        demand = self._demands.get(node.name, {})
        if chunks == [] and self.loop_limit is not None and needs_iteration(node):
            raise _short_stream(self._walk, node, env)
        carried = {
            p.name: self.value(p.role.init, env)
            for p in node.params
            if isinstance(p.role, ir.Carried)
        }
        fixed = {
            p.name: self.value(p.role.value, env)
            for p in node.params
            if isinstance(p.role, ir.Invariant)
        }
        per_step = [p for p in node.params if isinstance(p.role, ir.PerStep)]
        collected: dict[str, list[Any]] = {ch: [] for ch in node.accumulated}
        last: list[Any] | None = None
        for i in range(bound):
            if i >= limit and all(
                _items(collected[ch], node.accumulated[ch]) >= n for ch, n in demand.items()
            ):
                break
            body_env: dict[str, Any] = {}
            for name, value in (*carried.items(), *fixed.items()):
                self._bind(body_env, name, value)
            for p in per_step:
                assert isinstance(p.role, ir.PerStep)
                self._bind(
                    body_env, p.name, step_value(p.role, i, lambda a: self.value(a, env), chunks)
                )
            self.block(node.body, body_env)
            outs = [body_env[o] for o in node.outputs]
            for ch, acc in node.accumulated.items():
                collected[ch].append(outs[acc.output])
            for p in node.params:
                if isinstance(p.role, ir.Carried):
                    new = outs[p.role.output]
                    if self.check_carried:
                        _check_carried(node, p.name, carried[p.name], new)
                    carried[p.name] = new
            last = outs
            if node.stop is not None and truth(body_env[node.stop], node):
                break
        result = loop_channels(node, carried, last, collected)
        if self.record is not None:
            for ch, acc in node.accumulated.items():
                meta = meta_of(result[ch])
                if isinstance(meta, ir.TensorMeta) and meta.shape:
                    shape = list(meta.shape)
                    shape[acc.dim] = None  # grows with the iteration count
                    # _bind merges the concrete shape into this one and keeps the None.
                    self.record[ch] = ir.TensorMeta(shape, meta.dtype)
        return result

    # ------------------------------------------------------------------ values

    def _bind(self, env: dict[str, Any], name: str, value: Any) -> None:
        env[name] = value
        if self.observe is not None:
            self.observe(name, value)
        if self.record is not None:
            meta = meta_of(value)
            old = self.record.get(name)
            self.record[name] = meta if old is None else merge_meta(old, meta)


# Extra items asked of a producer whose stream source is glue over its channel (a leading
# token concatenated, a slice), so that the consumer still gets its chunks.
DEMAND_SLACK = 2


def stream_demands(walk: ir.Walk, chunks: int) -> dict[str, dict[str, int]]:
    """For a run with loops cut to ``chunks`` iterations: loop name -> {accumulated channel:
    items it must produce} so that every stream consumer still gets ``chunks`` chunks (a
    ``SlidingWindow(28, 7)`` consumer needs 35 items for two windows, whatever the cut). A
    consumer that feeds another stream needs as many iterations as that stream needs items
    (one item per iteration at least), which its own stream's producer must supply."""
    defs: dict[str, ir.Node] = {}
    for n in dataflow.iter_nodes(walk.body):
        for out in dataflow.node_outputs(n):
            defs[out] = n
    edges = {e.consumer: e for e in walk.streams}
    demands: dict[str, dict[str, int]] = {}

    def need(value: str, items: int, depth: int = 0) -> None:
        node = defs.get(value)
        if node is None or depth > 64:
            return
        if isinstance(node, ir.Op):
            for ref in dataflow.node_inputs(node):
                need(ref, items + DEMAND_SLACK, depth + 1)
            return
        if value not in node.accumulated:
            return
        have = demands.setdefault(node.name, {})
        have[value] = max(have.get(value, 0), items)
        edge = edges.get(node.name)
        if edge is not None:  # this producer is itself a stream consumer
            need(edge.source, items_for_chunks(edge, items), depth + 1)

    for edge in walk.streams:
        need(edge.source, items_for_chunks(edge, chunks))
    return demands


def items_for_chunks(edge: ir.StreamEdge, chunks: int, most: int = 1 << 20) -> int:
    """The fewest items of a finished stream that give ``chunks`` chunks under its policy."""
    policy = ChunkPolicy.from_json(dict(edge.policy))
    n = 1
    while policy.ready(n, finished=True) < chunks and n < most:
        n += 1
    return n


def _items(pieces: list[Any], acc: ir.Accumulated) -> int:
    if acc.mode == "stack":
        return len(pieces)
    return sum(p.shape[acc.dim] for p in pieces if isinstance(p, torch.Tensor) and p.dim())


def _short_stream(walk: ir.Walk, node: ir.LoopNode, env: Mapping[str, Any]) -> CaptureError:
    assert isinstance(node.trips, ir.StreamTrips)
    edge = next(e for e in walk.streams if e.name == node.trips.stream)
    source = env[edge.source]
    n = source.shape[edge.dim] if isinstance(source, torch.Tensor) else "?"
    policy = ChunkPolicy.from_json(dict(edge.policy))
    return CaptureError(
        "stream-sample",
        f"on the sample inputs the stream into loop {node.name} has {n} items, and "
        f"{policy.to_json()} makes no chunk of them (it needs {items_for_chunks(edge, 1)}), so "
        "the loop would run no iteration; give sample inputs whose producer makes a longer "
        "stream (a larger max_new_tokens, a later stop), or end='flush' / 'pad' to chunk "
        "the final fragment",
        node.source,
    )


def _check_carried(node: ir.LoopNode, name: str, old: Any, new: Any) -> None:
    if isinstance(old, torch.Tensor) != isinstance(new, torch.Tensor) or (
        isinstance(old, torch.Tensor) and (old.dtype != new.dtype or old.dim() != new.dim())
    ):
        raise CaptureError(
            "carried-consistency",
            f"carried value '{name.rpartition('/')[2]}' of loop {node.name} changes from "
            f"{_describe(old)} to {_describe(new)} between iterations; check the order of the "
            "values the body returns (carried values first, in parameter order)",
            node.source,
        )


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return type(v).__name__
