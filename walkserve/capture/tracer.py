"""The tracer: records a walk method as an fx graph in which components are leaves and each
``@loop`` body is traced once.

How a loop is captured. The author's Python ``for`` loop runs during tracing, but only the
first call of the body is traced (into its own fx graph, with one placeholder per parameter).
Every call, first or not, leaves one ``_loop_iter`` node in the enclosing graph that records the
arguments of that iteration and stands for its outputs:

    outer graph while tracing           after finalize (loops.py)
    iter0 = _loop_iter(L, 0, noise, s0) loop = _loop_node(L, [noise, sigmas])
    iter1 = _loop_iter(L, 1, iter0, s1) z = _loop_channel(loop, "euler_step.z")
    ...                                 image = decoder(z)
    image = decoder(iter48)

``loops.finalize`` reads the recorded iterations: an argument that is always the previous
iteration's output is carried, one that never changes is invariant, one that changes is a
per-step input; ``torch.cat``/``stack`` of every iteration's output is an accumulated channel;
``if <traced bool>: break`` after a call (``to_bool``) is the stop of a DynamicLoop. This
module owns the recording; ``records`` the markers and records it writes; ``loops`` the
analysis; ``convert`` the translation to the IR.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from walkserve.capture import ir, rng, trips
from walkserve.capture.api import ComponentSpec, LoopSpec, _Hook, component_spec
from walkserve.capture.chunk import ChunkPolicy, LeftContext
from walkserve.capture.errors import CaptureError, user_source
from walkserve.capture.records import (
    Iteration,
    LoopRecord,
    Scope,
    StreamInfo,
    _loop_iter,
    _stream_chunk,
    _stream_context,
)

SAMPLE_ITERATIONS = trips.SAMPLE_ITERATIONS

CONST_PREFIX = "__const__."


class WalkTracer(fx.Tracer, _Hook):
    """fx tracer with components as leaves and loop/stream hooks. One instance per walk."""

    def __init__(self, model: nn.Module, const_prefix: str = "") -> None:
        super().__init__(autowrap_modules=(), param_shapes_constant=False)  # type: ignore[arg-type]
        self.model = model
        self.const_prefix = const_prefix
        self.proxy_buffer_attributes = True
        self.attr_paths: dict[int, str] = {}
        for path, p in itertools.chain(model.named_parameters(), model.named_buffers()):
            self.attr_paths.setdefault(id(p), path)
        self.module_paths = {id(m): path for path, m in model.named_modules()}
        self.constants: dict[str, torch.Tensor] = {}
        self.components: dict[str, tuple[nn.Module, ComponentSpec]] = {}
        self.scopes: dict[int, Scope] = {}
        self.all_loops: dict[int, LoopRecord] = {}
        self.loop_names: dict[str, int] = {}
        self._keys = itertools.count()
        self._seq = itertools.count()
        self._attr_cache: dict[int, dict[str, fx.Proxy]] = {}
        self.pending_trip: ir.IntExpr | None = None
        self._pending_stream: StreamInfo | None = None
        self.body_graphs: set[int] = set()

    # -------------------------------------------------------------- fx overrides

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return component_spec(m) is not None

    def path_of_module(self, mod: nn.Module) -> str:
        path = self.module_paths.get(id(mod))
        if path is None:
            raise CaptureError(
                "component-not-in-model",
                f"{type(mod).__name__} is called but is not a submodule of the model; "
                "assign it as an attribute of the model (or of one of its submodules)",
                user_source(),
            )
        return path

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        spec = component_spec(m)
        if spec is not None:
            path = self.path_of_module(m)
            self.components[path] = (m, spec)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        # One cache per graph: a proxy of the walk graph must never leak into a loop body.
        cache = self._attr_cache.setdefault(id(self.graph), {})
        return super().getattr(attr, attr_val, cache)

    def tensor_path(self, a: torch.Tensor) -> str:
        """The model attribute path of ``a``, or the path of a new graph constant holding it."""
        path = self.attr_paths.get(id(a))
        if path is None:
            path = f"{CONST_PREFIX}{self.const_prefix}c{len(self.constants)}"
            self.constants[path] = a.detach().clone()
            self.attr_paths[id(a)] = path
        return path

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(a, fx.Proxy):
            return self.create_node("get_attr", self.tensor_path(a), (), {})
        if isinstance(a, nn.Module):
            raise CaptureError(
                "module-as-value",
                f"a module ({type(a).__name__}) is passed as a value; call it instead",
                user_source(),
            )
        if isinstance(a, rng.REAL_GENERATOR):
            raise CaptureError(
                "rng-generator",
                "a torch.Generator is passed as a value (to a component, a loop body or a glue "
                "function); only torch's random functions may take it, in the walk body: "
                + rng.SUPPORTED,
                user_source(),
            )
        return super().create_arg(a)

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any = None,
        proxy_factory_fn: Any = None,
    ) -> fx.Proxy:
        if kind == "call_method" and isinstance(kwargs.get("generator"), rng.TracedGenerator):
            return self.draw(f"method:{target}", args, kwargs)  # x.normal_(generator=g)
        return super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)

    def create_node(
        self,
        kind: str,
        target: Any,
        args: Any,
        kwargs: Any,
        name: str | None = None,
        type_expr: Any = None,
    ) -> fx.Node:
        for arg in _nodes_in((args, kwargs)):
            if arg.graph is not self.graph:
                raise CaptureError(
                    "loop-body-closure",
                    "a loop body uses a traced value that is not one of its arguments "
                    f"({arg.name}); pass it to the body as an argument",
                    user_source(),
                )
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["seq"] = next(self._seq)
        node.meta["source"] = user_source()
        return node

    def to_bool(self, obj: fx.Proxy) -> bool:
        loop = self._loop_of_predicate(obj.node)
        if loop is None:
            raise CaptureError(
                "control-flow",
                "Python control flow on a traced value: a tensor's value cannot decide a Python "
                "`if`/`while` while capturing, except `if <stop>: break` right after a @loop "
                "body call (which makes it a DynamicLoop)",
                user_source(),
            )
        if loop.spec.max_iters is None and loop.stream is None and loop.trip is None:
            raise CaptureError(
                "dynamic-loop-max-iters",
                f"loop body '{loop.name}' has a data-dependent stop but no max_iters; declare "
                f"@loop(max_iters=N) or @loop(max_iters='<int walk input>')",
                user_source(),
            )
        if len(loop.checks) != len(loop.iterations) - 1:
            raise CaptureError(
                "stop-after-body",
                f"the stop of loop '{loop.name}' must be checked once right after every body call",
                user_source(),
            )
        loop.checks.append(obj.node)
        return len(loop.checks) >= SAMPLE_ITERATIONS

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        raise CaptureError(
            "iterate-traced",
            "a traced value is iterated (a for loop, a list comprehension, a generator "
            "expression or *args over it); its length is not known while capturing. Loop over "
            "its indices instead, `for k in range(x.shape[1]): ... x[:, k]` (a walk input's "
            "size is a trip count), or unpack a fixed number of items, `a, b = out`",
            user_source(),
        )

    # -------------------------------------------------------------- hooks (api.py)

    @property
    def cur_scope(self) -> Scope:
        graph = self.graph
        scope = self.scopes.get(id(graph))
        if scope is None:
            scope = self.scopes[id(graph)] = Scope(graph)
        return scope

    def call_loop(
        self, spec: LoopSpec, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        source = user_source()
        sig = inspect.signature(fn)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise CaptureError(
                "loop-call", f"bad call of loop body {fn.__name__}: {e}", source
            ) from None
        bound.apply_defaults()
        names = list(bound.arguments)
        if not names or not isinstance(bound.arguments[names[0]], nn.Module):
            raise CaptureError(
                "loop-method", f"@loop body {fn.__name__} must be a method of the model", source
            )
        owner = bound.arguments[names[0]]
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise CaptureError(
                    "loop-signature", f"@loop body {fn.__name__} cannot take *{pname}", source
                )
        params = names[1:]
        values = [bound.arguments[p] for p in params]

        record = self._continuing(fn, values, source)
        if record is None:
            record = self._start_loop(spec, fn, owner, params, values, source)
        return self._record_iteration(record, values, source)

    def stream(self, x: Any, policy: ChunkPolicy, dim: int) -> Iterator[Any]:
        source = user_source()
        if not isinstance(x, fx.Proxy):
            raise CaptureError(
                "stream-source",
                "stream() needs a traced tensor (a loop's accumulated output)",
                source,
            )
        info = StreamInfo(next(self._keys), x.node, policy, dim, source)
        self.cur_scope.streams.append(info)
        return self._stream_iter(info, x)

    def _stream_iter(self, info: StreamInfo, x: fx.Proxy) -> Iterator[Any]:
        for i in range(SAMPLE_ITERATIONS):
            self._pending_stream = info
            chunk = self.create_proxy("call_function", _stream_chunk, (x, info.key, i), {})
            if isinstance(info.policy, LeftContext):
                ctx = self.create_proxy("call_function", _stream_context, (x, info.key, i), {})
                yield (chunk, ctx)
            else:
                yield chunk
        self._pending_stream = None

    def iterations(self, n: Any) -> Iterator[int]:
        if isinstance(n, int):
            return iter(range(n))
        return trips.traced_iterations(self, self._trip_expr(n, "iterations"), 0, 1)

    def traced_range(self, *args: Any) -> trips.TracedRange:
        """``range(...)`` with a traced argument (see ``shims`` and ``trips``)."""
        return trips.traced_range(self, *args)

    def _trip_expr(self, value: Any, what: str) -> ir.IntExpr:
        return trips.trip_expr(self, value, what)

    def torch_call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A torch function called from the model's module while tracing (see ``shims``)."""
        if isinstance(kwargs.get("generator"), rng.TracedGenerator):
            return self.draw(rng.target_of(fn), args, kwargs)
        try:
            return fn(*args, **kwargs)
        except TypeError:
            if not _nodes_in_proxies((args, kwargs)):
                raise
        # A traced size or count where torch's parser wants an int: record the call.
        return self.create_proxy("call_function", fn, args, kwargs)

    # -------------------------------------------------------------- random numbers (rng.py)

    def generator(self, *args: Any, **kwargs: Any) -> rng.TracedGenerator:
        """What ``torch.Generator(...)`` returns in a walk while tracing (``rng``)."""
        return rng.new_generator(self, *args, **kwargs)

    def draw(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Proxy:
        """One traced draw from the generator in ``kwargs`` (``rng``)."""
        return rng.trace_draw(self, target, args, kwargs)

    # -------------------------------------------------------------- loop recording

    def _continuing(
        self, fn: Callable[..., Any], values: list[Any], site: str | None
    ) -> LoopRecord | None:
        """The open loop of ``fn`` in this scope if this call continues it, else None (and
        that loop is closed). A call continues a loop when an argument is an output of its
        latest iteration, or, for a loop that carries nothing, when it comes from the same
        line in the same stream or ``iterations()`` pass."""
        for record in self.cur_scope.loops:
            if record.fn is not fn or record.closed:
                continue
            last = record.iterations[-1]
            if any(isinstance(v, fx.Proxy) and v.node in last.outputs for v in values):
                return record
            if (
                site == record.source
                and not record.carries
                and record.stream is self._pending_stream
                and record.trip == self.pending_trip
            ):
                return record
            record.closed = True
        return None

    def _start_loop(
        self,
        spec: LoopSpec,
        fn: Callable[..., Any],
        owner: nn.Module,
        params: list[str],
        values: list[Any],
        source: str | None,
    ) -> LoopRecord:
        key = next(self._keys)
        base = fn.__name__
        count = self.loop_names.get(base, 0)
        self.loop_names[base] = count + 1
        name = base if count == 0 else f"{base}_{count}"
        body = fx.Graph(tracer_cls=type(self))
        self.body_graphs.add(id(body))
        static = {p: v for p, v in zip(params, values) if not _is_traced_value(v)}
        outer_graph = self.graph
        self.graph = body
        try:
            proxies: dict[str, Any] = {}
            for p in params:
                proxies[p] = (
                    static[p] if p in static else self.create_proxy("placeholder", p, (), {})
                )
            saved = (self._pending_stream, self.pending_trip)
            self._pending_stream = self.pending_trip = None
            result = fn(owner, **proxies)
            self._pending_stream, self.pending_trip = saved
            if isinstance(result, dict):
                raise CaptureError(
                    "loop-returns",
                    f"loop body {name} must return a value or a tuple, not a dict",
                    source,
                )
            single = not isinstance(result, (tuple, list))
            outs = [result] if single else list(result)
            if not outs:
                raise CaptureError("loop-returns", f"loop body {name} returns nothing", source)
            body.output(tuple(self.create_arg(o) for o in outs))
            from walkserve.capture.loops import finalize_scope  # loops imports this module

            finalize_scope(self, self.cur_scope)
        finally:
            self.graph = outer_graph
        record = LoopRecord(key, name, fn, spec, params, static, body, len(outs), single, source)
        record.trip = self.pending_trip
        if self._pending_stream is not None and self._pending_stream.consumer is None:
            record.stream = self._pending_stream
            record.stream.consumer = record
        self.cur_scope.loops.append(record)
        self.all_loops[key] = record
        return record

    def _record_iteration(self, record: LoopRecord, values: list[Any], source: str | None) -> Any:
        for p, v in zip(record.params, values):
            if p in record.static and not _same_static(record.static[p], v):
                raise CaptureError(
                    "loop-static-arg",
                    f"argument '{p}' of loop body {record.name} is neither a tensor nor a number "
                    "and must be the same object in every iteration",
                    source,
                )
        index = len(record.iterations)
        if index:
            previous = record.iterations[-1].outputs
            record.carries = record.carries or any(
                isinstance(v, fx.Proxy) and v.node in previous for v in values
            )
        traced = [v for p, v in zip(record.params, values) if p not in record.static]
        proxy = self.create_proxy("call_function", _loop_iter, (record.key, index, *traced), {})
        if record.single_output:
            outputs = [proxy.node]
            result: Any = proxy
        else:
            getters = [
                self.create_proxy("call_function", operator.getitem, (proxy, j), {})
                for j in range(record.n_outputs)
            ]
            outputs = [g.node for g in getters]
            result = tuple(getters)
        record.iterations.append(Iteration(proxy.node, values, outputs, source))
        return result

    def _loop_of_predicate(self, node: fx.Node) -> LoopRecord | None:
        """The open loop of this scope whose latest iteration's outputs the predicate reads."""
        candidates = {
            n: r
            for r in self.cur_scope.loops
            if not r.closed and r.iterations
            for n in r.iterations[-1].outputs
        }
        seen: set[fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in candidates:
                return candidates[n]
            if n.target is _loop_iter:
                continue
            stack.extend(_nodes_in((n.args, n.kwargs)))
        return None


def _nodes_in_proxies(tree: Any) -> bool:
    """Whether a Proxy sits anywhere in nested lists, tuples and dicts."""
    if isinstance(tree, fx.Proxy):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_nodes_in_proxies(t) for t in tree)
    if isinstance(tree, dict):
        return any(_nodes_in_proxies(t) for t in tree.values())
    return False


def _is_traced_value(v: Any) -> bool:
    return isinstance(v, (fx.Proxy, torch.Tensor)) or (
        isinstance(v, (int, float)) and not isinstance(v, bool)
    )


def _same_static(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:
        return False


def _nodes_in(tree: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(tree, lambda n: found.append(n) or n)  # type: ignore[func-returns-value]
    return found
