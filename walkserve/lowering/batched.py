"""Lowered callables and a batched walk runner.

``BatchedComponent`` is the fixed calling convention of a lowered component node::

    outputs = node(batch)     batch: list of (args, kwargs), one per request, materialized
                              outputs: list of the op's result, one per request

It partitions the batch into *compatible groups*: requests whose tensor arguments agree on
every non-batch dimension and dtype, and whose other arguments (non-batched tensors, Python
scalars, objects) are equal. Each group is one call: batched arguments are concatenated along
their batch dimension (``in_dims``), optionally padded up to a batch bucket by repeating the
last row, the component runs once, and the result is split along ``out_dim`` back into one value
per request; padded rows are dropped. Requests never share a call they could not share in
eager execution, so batching changes no request's result beyond floating-point reassociation in
batched kernels.

A component that batches better than by concatenation (a KV-cache LM packing prompts and decode
steps of any lengths into one forward: ``runtime.kv.paged_lm.PagedLM``) defines
``forward_batch(batch) -> outputs`` with this same convention; it then gets every call of the
batch at once, ungrouped and unpadded. It may answer ``DEFER`` for a call it cannot run now
(no KV memory for it yet): the runtime sends that call again later, unchanged. A batch must
run at least one of its calls (or raise), so deferring never stalls the server.

``BatchedRunner`` runs a walk for many requests at once from the plan: every plan node is one
dispatch over the requests present; loops run in lockstep, a request leaves its loop when its
own bound or stop says so (requests join and leave at iteration boundaries).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from walkserve.capture import dataflow, ir
from walkserve.capture.interpret import Interpreter, InterpreterError
from walkserve.capture.loopsem import loop_bound, loop_channels, step_value, stream_chunks, truth
from walkserve.capture.model import CapturedModel
from walkserve.lowering.plan import BlockPlan, ExecutablePlan, LoopPlan, NodePlan

Call = tuple[list[Any], dict[str, Any]]


class Deferred:
    """The type of ``DEFER``: "not now, send this call again"."""

    _instance: Deferred | None = None

    def __new__(cls) -> Deferred:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DEFER"


DEFER = Deferred()


@dataclass
class BatchStats:
    """Group sizes of every component call, for tests and reports."""

    calls: dict[str, list[int]] = field(default_factory=dict)

    def add(self, node: str, size: int) -> None:
        self.calls.setdefault(node, []).append(size)


class BatchedComponent:
    """A component op with a batch calling convention (see the module docstring)."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        in_dims: Sequence[Any],
        kw_dims: Mapping[str, Any],
        out_dim: Any,
        buckets: Sequence[int] = (),
        stats: BatchStats | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.in_dims = list(in_dims)
        self.kw_dims = dict(kw_dims)
        self.out_dim = out_dim
        self.buckets = sorted(buckets)
        self.stats = stats
        self.batchable = _has_batch(out_dim) and (
            any(isinstance(d, int) for d in self.in_dims)
            or any(isinstance(d, int) for d in self.kw_dims.values())
        )
        self._forward_batch = getattr(fn, "forward_batch", None)

    def __call__(self, batch: Sequence[Call]) -> list[Any]:
        forward_batch = self._forward_batch
        if forward_batch is not None:
            if self.stats is not None:
                self.stats.add(self.name, len(batch))
            return list(forward_batch(batch))
        if len(batch) == 1 and not self.buckets:  # alone: the eager call
            if self.stats is not None:
                self.stats.add(self.name, 1)
            args, kwargs = batch[0]
            return [self.fn(*args, **kwargs)]
        rows = self._alike(batch)
        if rows:  # one group, every call's batch the same size: no signature per call
            outs = self._run(list(batch), [rows] * len(batch))
            if self.stats is not None:  # as a group's: counted once it ran
                self.stats.add(self.name, len(batch))
            return outs
        results: list[Any] = [None] * len(batch)
        for group in self._groups(batch):
            calls = [batch[i] for i in group]
            outs = (
                self._run(calls)
                if len(calls) > 1 or self.buckets
                else [self.fn(*calls[0][0], **calls[0][1])]
            )
            if self.stats is not None:
                self.stats.add(self.name, len(calls))
            for i, out in zip(group, outs):
                results[i] = out
        return results

    def _alike(self, batch: Sequence[Call]) -> int:
        """The batch size of every call of ``batch`` where they all are alike (0 where not,
        or not worth asking): no keyword arguments, each batched argument a tensor of the
        first call's shape and dtype, each other argument the first call's very object. Such
        calls are one group of ``_groups`` (a narrower rule, checked for what a map of one
        component makes: its windows, many a batch)."""
        if len(batch) < 2 or not self.batchable or self.buckets:
            return 0
        first, kw = batch[0]
        if kw or len(first) != len(self.in_dims):
            return 0
        rows = 0
        for x, d in zip(first, self.in_dims):
            if isinstance(d, int):
                if not isinstance(x, torch.Tensor) or not 0 <= d < x.dim():
                    return 0
                rows = rows or int(x.shape[d])
        if not rows:
            return 0
        for args, kwargs in batch[1:]:
            if kwargs or len(args) != len(first):
                return 0
            for x, y, d in zip(first, args, self.in_dims):
                if isinstance(d, int):
                    if not (
                        isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype
                    ):
                        return 0
                elif y is not x:
                    return 0
        return rows

    def _groups(self, batch: Sequence[Call]) -> list[list[int]]:
        """Compatible groups, first come first grouped: one pass by signature (dtype and
        non-batch shape of batched tensors, plain values, object identity); only calls with a
        non-batched tensor argument are compared pairwise (by value) within their signature."""
        if not self.batchable:
            return [[i] for i in range(len(batch))]
        by_key: dict[Any, list[list[int]]] = {}
        groups: list[list[int]] = []
        for i, call in enumerate(batch):
            key, by_value = self._signature(call)
            found = by_key.setdefault(key, [])
            for group in found:
                if not by_value or self._compatible(batch[group[0]], call):
                    group.append(i)
                    break
            else:
                found.append(group := [i])
                groups.append(group)
        return groups

    def _signature(self, call: Call) -> tuple[Any, bool]:
        """(key, by_value): calls of different keys are never compatible; with ``by_value``
        equal keys still need ``_compatible`` (a non-batched tensor compared by value)."""
        args, kwargs = call
        key: list[Any] = [len(args), frozenset(kwargs)]
        by_value = False
        for x, d in [*zip(args, self.in_dims), *((kwargs[k], self.kw_dims.get(k)) for k in kwargs)]:
            if isinstance(d, int):
                if isinstance(x, torch.Tensor) and 0 <= d < x.dim():
                    key.append((x.dtype, x.dim(), d, x.shape[:d], x.shape[d + 1 :]))
                elif isinstance(x, torch.Tensor):
                    key.append((x.dtype, x.dim(), d, x.shape))
                else:
                    key.append(object())  # compatible with nothing
            elif isinstance(x, torch.Tensor):
                key.append(("tensor", x.dtype, x.shape))
                by_value = True
            elif isinstance(x, (int, float, str, bool, type(None))):
                key.append((type(x), x))
            else:
                key.append(("object", id(x)))
        return tuple(key), by_value

    def direct(self) -> Callable[..., Any] | None:
        """The function ``joined`` amounts to, where it adds nothing to the call (no batch
        buckets to pad to, no stats to count, no subclass's own ``joined``, as CUDA graphs'
        replays): the fast lane calls it as it is."""
        plain = type(self).joined is BatchedComponent.joined
        return self.fn if plain and not self.buckets and self.stats is None else None

    def joined(self, call: Call, count: int) -> Any:
        """One call whose batched arguments already hold ``count`` requests' rows (a loop
        stepper joined them, as ``_groups`` would group them): padded to a batch bucket as
        ``__call__`` pads, run, and padded rows dropped."""
        if self.stats is not None:
            self.stats.add(self.name, count)
        args, kwargs = call
        if not self.buckets:
            return self.fn(*args, **kwargs)
        rows = _batch_size(call, self.in_dims, self.kw_dims)
        k = bisect.bisect_left(self.buckets, rows)
        pad = self.buckets[k] - rows if k < len(self.buckets) else 0
        if not pad:
            return self.fn(*args, **kwargs)
        args = [_join([a], d, pad) for a, d in zip(args, self.in_dims)] + args[len(self.in_dims) :]
        kwargs = {key: _join([v], self.kw_dims.get(key), pad) for key, v in kwargs.items()}
        return _split(self.fn(*args, **kwargs), self.out_dim, [rows])[0]

    def _compatible(self, a: Call, b: Call) -> bool:
        if len(a[0]) != len(b[0]) or a[1].keys() != b[1].keys():
            return False
        pairs = [(x, y, d) for x, y, d in zip(a[0], b[0], self.in_dims)]
        pairs += [(a[1][k], b[1][k], self.kw_dims.get(k)) for k in a[1]]
        return all(_compatible(x, y, d) for x, y, d in pairs)

    def _run(self, calls: list[Call], sizes: list[int] | None = None) -> list[Any]:
        if sizes is None:
            sizes = [_batch_size(c, self.in_dims, self.kw_dims) for c in calls]
        total = sum(sizes)
        pad = 0
        if self.buckets:
            k = bisect.bisect_left(self.buckets, total)
            pad = self.buckets[k] - total if k < len(self.buckets) else 0
        args = [_join([c[0][j] for c in calls], d, pad) for j, d in enumerate(self.in_dims)]
        kwargs = {
            key: _join([c[1][key] for c in calls], self.kw_dims.get(key), pad)
            for key in calls[0][1]
        }
        out = self.fn(*args, **kwargs)
        return _split(out, self.out_dim, sizes)


def merges_calls(node: NodePlan) -> bool:
    """Whether the component of ``node`` runs many requests' calls as one (by concatenation
    along a batch dimension, or a ``forward_batch`` such as ``PagedLM``'s, whose token
    output batches too): only then is it worth waiting to send calls together."""
    if node.kind != "component":
        return False
    return _has_batch(node.out_dim) and (
        any(isinstance(d, int) for d in node.in_dims)
        or any(isinstance(d, int) for d in node.kw_dims.values())
    )


def _has_batch(dim: Any) -> bool:
    if isinstance(dim, (list, tuple)):
        return any(_has_batch(d) for d in dim)
    return isinstance(dim, int)


def _compatible(x: Any, y: Any, dim: Any) -> bool:
    if isinstance(dim, int):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.dim() == y.dim()
            and all(x.shape[d] == y.shape[d] for d in range(x.dim()) if d != dim)
        )
    if x is y:
        return True
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.shape == y.shape
            and x.dtype == y.dtype
            and bool(torch.equal(x, y))
        )
    if isinstance(x, (int, float, str, bool, type(None))):
        return type(x) is type(y) and x == y
    return False  # objects (a cache, a structured output): only the same object


def _batch_size(call: Call, in_dims: list[Any], kw_dims: dict[str, Any]) -> int:
    for value, dim in [*zip(call[0], in_dims), *((call[1][k], kw_dims.get(k)) for k in call[1])]:
        if isinstance(dim, int) and isinstance(value, torch.Tensor):
            return int(value.shape[dim])
    raise InterpreterError("a batched call has no batched tensor argument")


def _join(values: list[Any], dim: Any, pad: int) -> Any:
    if not isinstance(dim, int):
        return values[0]  # equal in every call of the group
    joined = torch.cat(values, dim=dim)
    if pad:
        last = joined.narrow(dim, joined.shape[dim] - 1, 1)
        joined = torch.cat([joined, *([last] * pad)], dim=dim)
    return joined


def _split(out: Any, dim: Any, sizes: list[int]) -> list[Any]:
    if isinstance(dim, int):
        if not isinstance(out, torch.Tensor):
            raise InterpreterError(
                f"expected a tensor to split along dim {dim}, got {type(out).__name__}"
            )
        parts = list(torch.split(out, [*sizes, out.shape[dim] - sum(sizes)], dim=dim))
        return parts[: len(sizes)]
    if isinstance(dim, (list, tuple)) and isinstance(out, (list, tuple)):
        columns = [_split(o, d, sizes) for o, d in zip(out, dim)]
        rows = [
            type(out)(col[i] for col in columns)
            if isinstance(out, tuple)
            else [col[i] for col in columns]
            for i in range(len(sizes))
        ]
        return rows
    return [out] * len(sizes)  # no batch dimension: identical for every request


# ---------------------------------------------------------------------------------- runner


@dataclass(eq=False)
class _LoopState:
    env: dict[str, Any]
    carried: dict[str, Any]
    fixed: dict[str, Any]
    chunks: list[Any] | None
    bound: int
    collected: dict[str, list[Any]]
    i: int = 0
    last: list[Any] | None = None
    done: bool = False


class BatchedRunner:
    """Runs walks of ``captured`` for many requests at once, node by node as ``plan`` says.
    The oracle for what it must produce is ``Interpreter`` run per request."""

    def __init__(
        self,
        captured: CapturedModel,
        plan: ExecutablePlan,
        callables: Mapping[str, BatchedComponent],
    ) -> None:
        self.captured = captured
        self.plan = plan
        self.callables = callables
        self.all_ops: dict[str, dict[str, ir.Op]] = {}
        self.all_loops: dict[str, dict[str, ir.LoopNode]] = {}
        for walk in captured.graph.walks.values():
            nodes = dataflow.iter_nodes(walk.body)
            self.all_ops[walk.name] = {n.name: n for n in nodes if isinstance(n, ir.Op)}
            self.all_loops[walk.name] = {n.name: n for n in nodes if isinstance(n, ir.LoopNode)}
        self.interp = Interpreter(captured)

    def run(
        self, requests: Sequence[Mapping[str, Any]], walk: str | None = None
    ) -> list[dict[str, Any]]:
        """Every request through its walk chain; returns client outputs per request."""
        graph = self.captured.graph
        start = walk or graph.entry_walks()[0]
        states = [dict(r) for r in requests]
        clients: list[dict[str, Any]] = [{} for _ in requests]
        current: list[str | None] = [start] * len(requests)
        with torch.no_grad():
            while any(c is not None for c in current):
                name = next(c for c in current if c is not None)
                group = [i for i, c in enumerate(current) if c == name]
                outs = self.run_walk(name, [states[i] for i in group])
                w = graph.walks[name]
                for i, out in zip(group, outs):
                    states[i].update(out)
                    clients[i].update({k: v for k, v in out.items() if k not in w.state})
                    current[i] = self.captured.next_walk(states[i], name, out)
        return clients

    def run_walk(self, name: str, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        w = self.captured.graph.walks[name]
        self.walk = w
        self.ops, self.loops = self.all_ops[name], self.all_loops[name]
        given = [ir.with_defaults(w, r) for r in inputs]
        envs = [{i.name: g[i.name] for i in w.inputs} for g in given]
        self.walk_inputs = [dict(e) for e in envs]
        self.block(self.plan.walks[name], envs, list(range(len(envs))))
        return [{k: self.interp.value(a, env) for k, a in w.outputs.items()} for env in envs]

    def block(self, block: BlockPlan, envs: list[dict[str, Any]], owners: list[int]) -> None:
        """Run ``block`` for the requests whose environments are ``envs``; ``owners`` are
        their request indices (for walk inputs)."""
        for node in block.nodes:
            if isinstance(node, LoopPlan):
                self.loop(node, envs, owners)
            elif node.kind == "component":
                self.component(node, envs)
            else:
                for env in envs:
                    self.glue(node.ops, env)

    def component(self, node: NodePlan, envs: list[dict[str, Any]]) -> None:
        op = self.ops[node.ops[0]]
        batch = [
            (
                [self.interp.value(a, env) for a in op.args],
                {k: self.interp.value(a, env) for k, a in op.kwargs.items()},
            )
            for env in envs
        ]
        outs = self.callables[f"{self.walk.name}:{node.name}"](batch)
        if any(out is DEFER for out in outs):  # lockstep: nothing can wait for a later round
            raise RuntimeError(
                f"component {node.name} deferred calls for lack of memory; BatchedRunner runs "
                "requests in lockstep: run fewer at once, or serve them (the runtime retries)"
            )
        for env, out in zip(envs, outs):
            env[op.name] = out
            self.glue(node.ops[1:], env)

    def glue(self, names: list[str], env: dict[str, Any]) -> None:
        for name in names:
            env[name] = self.interp.op(self.ops[name], env)

    def loop(self, plan: LoopPlan, envs: list[dict[str, Any]], owners: list[int]) -> None:
        node = self.loops[plan.name]
        states = [self._start(node, env, owner) for env, owner in zip(envs, owners)]
        while True:
            active_ix = [k for k, s in enumerate(states) if not s.done and s.i < s.bound]
            if not active_ix:
                break
            active = [states[k] for k in active_ix]
            bodies = []
            for s in active:
                body: dict[str, Any] = {**s.carried, **s.fixed}
                for p in node.params:
                    if isinstance(p.role, ir.PerStep):
                        body[p.name] = self._step_value(p.role, s)
                bodies.append(body)
            self.block(plan.body, bodies, [owners[k] for k in active_ix])
            for s, body in zip(active, bodies):
                outs = [body[o] for o in node.outputs]
                for ch, acc in node.accumulated.items():
                    s.collected[ch].append(outs[acc.output])
                for p in node.params:
                    if isinstance(p.role, ir.Carried):
                        s.carried[p.name] = outs[p.role.output]
                s.last = outs
                s.i += 1
                if node.stop is not None and truth(body[node.stop], node):
                    s.done = True
        for s in states:
            self._finish(node, s)

    def _start(self, node: ir.LoopNode, env: dict[str, Any], owner: int) -> _LoopState:
        chunks = stream_chunks(self.walk, node, env)
        return _LoopState(
            env=env,
            carried={
                p.name: self.interp.value(p.role.init, env)
                for p in node.params
                if isinstance(p.role, ir.Carried)
            },
            fixed={
                p.name: self.interp.value(p.role.value, env)
                for p in node.params
                if isinstance(p.role, ir.Invariant)
            },
            chunks=chunks,
            bound=loop_bound(
                node, self.walk_inputs[owner], None if chunks is None else len(chunks)
            ),
            collected={ch: [] for ch in node.accumulated},
        )

    def _step_value(self, role: ir.PerStep, s: _LoopState) -> Any:
        return step_value(role, s.i, lambda a: self.interp.value(a, s.env), s.chunks)

    def _finish(self, node: ir.LoopNode, s: _LoopState) -> None:
        s.env.update(loop_channels(node, s.carried, s.last, s.collected))
