"""Translate finalized fx graphs into IR blocks (and glue targets to and from names).

Value names: a walk's values keep their fx names (``denoiser``, ``add_3``); a loop body's
values are prefixed with the loop's name and a slash (``euler_step/denoiser_1``), recursively;
loop channels are ``<loop>.<label>`` (terminal) and ``<loop>.<label>.all`` (accumulated), where
the label is the carried parameter's name or ``out<j>``. Names are unique within a walk.
"""

from __future__ import annotations

import builtins
import importlib
import math
from typing import Any, Literal

import torch
from torch import fx

from walkserve.capture import ir
from walkserve.capture.errors import CaptureError
from walkserve.capture.loopparams import ParamPlan
from walkserve.capture.loops import Finalized
from walkserve.capture.records import _loop_channel, _loop_node
from walkserve.capture.tracer import CONST_PREFIX, WalkTracer

# Modules whose functions glue may call. Attribute and method names starting with "_" are
# refused too, so that an imported IR cannot reach arbitrary Python.
SAFE_MODULES = ("torch", "operator", "math")
SAFE_BUILTINS = {
    "getattr",
    "len",
    "min",
    "max",
    "abs",
    "int",
    "float",
    "bool",
    "round",
    "slice",
    "tuple",
    "list",
}


def target_name(target: Any) -> str:
    """``function:<module>.<qualname>`` for a glue function, checked to resolve back."""
    if target is builtins.getattr or getattr(target, "__module__", None) == "builtins":
        name = f"builtins.{target.__name__}"
    elif getattr(target, "__module__", None) in ("_operator", "operator"):
        name = f"operator.{target.__name__}"
    elif target in vars(math).values():
        name = f"math.{target.__name__}"
    else:
        module = getattr(target, "__module__", None) or ""
        qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", "")
        name = f"{module}.{qual}"
        try:
            if resolve_function(name) is not target:
                name = _torch_public_name(target) or name
        except (ValueError, AttributeError, ImportError):
            name = _torch_public_name(target) or name
    if resolve_function(name) is not target:
        raise ValueError(f"cannot name glue function {target!r}")
    return name


def _torch_public_name(target: Any) -> str | None:
    for modname in ("torch", "torch.nn.functional", "torch.special", "torch.linalg", "torch.fft"):
        module = importlib.import_module(modname)
        name = getattr(target, "__name__", None)
        if name and getattr(module, name, None) is target:
            return f"{modname}.{name}"
    return None


def resolve_function(name: str) -> Any:
    """The glue function a ``function:`` target names; refuses anything outside the allowlist
    (and the functions registered with ``capture.gluefn.glue_function``)."""
    from walkserve.capture.gluefn import registered

    custom = registered(name)
    if custom is not None:
        return custom
    module_name, _, attr = name.rpartition(".")
    if module_name == "builtins":
        if attr not in SAFE_BUILTINS:
            raise ValueError(f"glue may not call builtins.{attr}")
        return getattr(builtins, attr)
    parts = name.split(".")
    if parts[0] not in SAFE_MODULES or any(p.startswith("__") for p in parts):
        raise ValueError(f"glue function {name!r} is outside the allowed modules {SAFE_MODULES}")
    # Longest importable module prefix, then attributes.
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for p in parts[cut:]:
            obj = getattr(obj, p)
        return obj
    raise ValueError(f"cannot resolve glue function {name!r}")


class BlockConverter:
    """Converts one finalized fx graph (walk or loop body) into an ``ir.Block``."""

    def __init__(
        self,
        tracer: WalkTracer,
        graph: fx.Graph,
        prefix: str,
        streams: list[ir.StreamEdge] | None = None,
    ) -> None:
        self.tracer = tracer
        self.graph = graph
        self.prefix = prefix
        self.names: dict[fx.Node, str] = {}
        self.streams: list[ir.StreamEdge] = [] if streams is None else streams

    def name_of(self, node: fx.Node) -> str:
        if node in self.names:
            return self.names[node]
        if node.target is _loop_channel:
            name = self.prefix + str(node.args[1])
        elif node.op == "placeholder":
            name = self.prefix + str(node.target)
        else:
            name = self.prefix + node.name
        self.names[node] = name
        return name

    def arg(self, a: Any) -> ir.Arg:
        if isinstance(a, fx.Node):
            if a.op == "get_attr":
                target = str(a.target)
                if target.startswith(CONST_PREFIX):
                    return ir.TensorConst(target[len(CONST_PREFIX) :])
                return ir.ModelAttr(target)
            return ir.Ref(self.name_of(a))
        if isinstance(a, (list, tuple)):
            items = [self.arg(x) for x in a]
            return ir.ListArg(items) if isinstance(a, list) else ir.TupleArg(items)
        if isinstance(a, dict):
            if not all(isinstance(k, str) for k in a):
                raise CaptureError("constant", "dict arguments need string keys")
            return ir.DictArg({k: self.arg(v) for k, v in a.items()})
        if isinstance(a, slice):
            return ir.SliceArg(self.arg(a.start), self.arg(a.stop), self.arg(a.step))
        return constant_arg(a, self.tracer)

    def convert(self) -> tuple[ir.Block, Any]:
        """(block, the output node's argument)."""
        params: list[str] = []
        nodes: list[ir.Node] = []
        output: Any = None
        for node in self.graph.nodes:
            source = node.meta.get("source")
            if node.op == "placeholder":
                params.append(self.name_of(node))
            elif node.op == "output":
                output = node.args[0]
            elif node.op == "get_attr" or node.target is _loop_channel:
                continue
            elif node.target is _loop_node:
                nodes.append(self.loop(node))
            elif node.op == "call_module":
                nodes.append(
                    ir.Op(
                        self.name_of(node),
                        "component",
                        str(node.target),
                        [self.arg(a) for a in node.args],
                        {k: self.arg(v) for k, v in node.kwargs.items()},
                        source,
                    )
                )
            elif node.op == "call_function":
                try:
                    target = "function:" + target_name(node.target)
                except ValueError as e:
                    raise CaptureError("glue-target", str(e), source) from None
                nodes.append(self._glue(node, target))
            elif node.op == "call_method":
                nodes.append(self._glue(node, f"method:{node.target}"))
            else:  # pragma: no cover - fx has no other node ops
                raise CaptureError("fx-node", f"unexpected fx node {node.op}", source)
        return ir.Block(params, nodes), output

    def _glue(self, node: fx.Node, target: str) -> ir.Op:
        return ir.Op(
            self.name_of(node),
            "glue",
            target,
            [self.arg(a) for a in node.args],
            {k: self.arg(v) for k, v in node.kwargs.items()},
            node.meta.get("source"),
        )

    def loop(self, node: fx.Node) -> ir.LoopNode:
        record = self.tracer.all_loops[node.args[0]]  # type: ignore[index]
        fin: Finalized = record.finalized
        deps: list[Any] = list(node.args[1])  # type: ignore[arg-type]
        name = self.prefix + record.name
        body_conv = BlockConverter(self.tracer, record.body, name + "/", self.streams)
        body, out = body_conv.convert()
        outs = list(out)
        stop = None
        if fin.stop_output is not None:
            stop_arg = body_conv.arg(outs[fin.stop_output])
            outs = outs[: fin.stop_output]
            stop = _require_ref(stop_arg, record.source, "stop")
        outputs = [_require_ref(body_conv.arg(o), record.source, "output") for o in outs]
        params = [
            ir.LoopParam(body_conv.name_of(ph), self._role(p, deps, fin))
            for p, ph in zip(self._ordered_params(fin, body_conv), self._placeholders(record.body))
        ]
        trips: ir.TripCount
        if fin.trips == "stream":
            trips = ir.StreamTrips(self._stream_name(fin))
            self.streams.append(self._stream_edge(fin, deps))
        elif fin.trips == "input":
            count = fin.trip_count
            if isinstance(count, ir.IntInput):
                trips = ir.InputTrips(count.name)
            elif isinstance(count, str):
                trips = ir.InputTrips(count)
            else:
                trips = ir.ExprTrips(count)  # type: ignore[arg-type]
        else:
            assert isinstance(fin.trip_count, int)
            trips = ir.FixedTrips(fin.trip_count)
        return ir.LoopNode(
            name=name,
            body=body,
            params=params,
            outputs=outputs,
            terminal={self.prefix + k: v for k, v in fin.terminal.items()},
            accumulated={self.prefix + k: v for k, v in fin.accumulated.items()},
            trips=trips,
            stop=stop,
            # A dynamic loop bounded by iterations(n) has the input n as its max_iters.
            max_iters=(
                record.spec.max_iters
                or (record.trip.name if isinstance(record.trip, ir.IntInput) else None)
            )
            if stop is not None
            else None,
            speculative=record.spec.speculative,
            source=record.source,
        )

    def _placeholders(self, graph: fx.Graph) -> list[fx.Node]:
        return [n for n in graph.nodes if n.op == "placeholder"]

    def _ordered_params(self, fin: Finalized, conv: BlockConverter) -> list[ParamPlan]:
        by_name = {p.name: p for p in fin.params}
        return [by_name[str(ph.target)] for ph in self._placeholders(fin.record.body)]

    def _stream_name(self, fin: Finalized) -> str:
        assert fin.record.stream is not None
        return f"{self.prefix}stream.{fin.record.name}"

    def _stream_edge(self, fin: Finalized, deps: list[Any]) -> ir.StreamEdge:
        info = fin.record.stream
        assert info is not None and fin.stream_dep is not None
        src = _require_ref(self.arg(deps[fin.stream_dep]), info.origin, "stream source")
        return ir.StreamEdge(
            self._stream_name(fin),
            src,
            self.prefix + fin.record.name,
            info.dim,
            info.policy.to_json(),
        )

    def _role(self, p: ParamPlan, deps: list[Any], fin: Finalized) -> ir.ParamRole:
        if p.role == "carried":
            return ir.Carried(self.arg(deps[p.dep]), p.output)  # type: ignore[index]
        if p.role == "invariant":
            return ir.Invariant(self.arg(deps[p.dep]))  # type: ignore[index]
        if p.role == "affine":
            return ir.PerStep(ir.AffineStep(p.start, p.step))
        if p.role == "table":
            return ir.PerStep(ir.TableStep([constant_arg(v, self.tracer) for v in p.table]))
        if p.role == "select":
            return ir.PerStep(ir.SelectStep(self.arg(deps[p.dep]), p.dim, p.start, p.step))  # type: ignore[index]
        part: Literal["data", "context"] = "data" if p.role == "chunk" else "context"
        source = _require_ref(self.arg(deps[p.dep]), fin.record.source, "stream source")  # type: ignore[index]
        return ir.PerStep(ir.ChunkStep(self._stream_name(fin), source, part))


def _require_ref(arg: ir.Arg, source: str | None, what: str) -> str:
    if not isinstance(arg, ir.Ref):
        raise CaptureError(
            "loop-output", f"a loop's {what} must be a traced value, not a constant", source
        )
    return arg.name


def constant_arg(a: Any, tracer: WalkTracer | None = None) -> ir.Arg:
    """A Python constant as an IR argument."""
    if a is None or isinstance(a, (bool, int, str)):
        return ir.Const(a)
    if isinstance(a, float):
        return ir.Const(a) if math.isfinite(a) else ir.FloatConst(repr(a))
    if isinstance(a, torch.dtype):
        return ir.DTypeArg(str(a).removeprefix("torch."))
    if isinstance(a, torch.device):
        return ir.DeviceArg(str(a))
    if a is Ellipsis:
        return ir.EllipsisArg()
    if isinstance(a, slice):
        return ir.SliceArg(
            constant_arg(a.start, tracer),
            constant_arg(a.stop, tracer),
            constant_arg(a.step, tracer),
        )
    if isinstance(a, (list, tuple)):
        items = [constant_arg(x, tracer) for x in a]
        return ir.ListArg(items) if isinstance(a, list) else ir.TupleArg(items)
    if isinstance(a, dict):
        if not all(isinstance(k, str) for k in a):
            raise CaptureError("constant", "dict arguments need string keys")
        return ir.DictArg({k: constant_arg(v, tracer) for k, v in a.items()})
    if isinstance(a, torch.Tensor) and tracer is not None:
        path = tracer.tensor_path(a)
        return (
            ir.TensorConst(path[len(CONST_PREFIX) :])
            if path.startswith(CONST_PREFIX)
            else ir.ModelAttr(path)
        )
    raise CaptureError(
        "constant", f"unsupported constant of type {type(a).__name__} in the graph: {a!r}"
    )
