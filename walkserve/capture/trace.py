"""``trace(model, sample_inputs)``: capture a decorated model's walks as a ``WalkGraph``.

Each walk method is traced with ``WalkTracer`` (components are leaves, loop bodies traced
once), its loops finalized (``loops``), translated to IR (``convert``), then run once on the
sample inputs through the reference interpreter with every loop cut to two iterations, which
records each value's shape and dtype and checks that carried values keep their type. Walks are
traced in an order where each walk's inputs exist: sample inputs first, then the outputs of
walks already run (a decode walk gets the cache its prefill made).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typeguard import typechecked

from walkserve.capture import dataflow, ir, rng, shims
from walkserve.capture.api import ACTIVE_HOOK, WalkSpec, walk_specs
from walkserve.capture.convert import BlockConverter
from walkserve.capture.errors import CaptureError, traced_value_error
from walkserve.capture.inputs import EmbeddingProbe, InputError, check_inputs, input_specs
from walkserve.capture.interpret import Interpreter, InterpreterError
from walkserve.capture.lint import lint
from walkserve.capture.loops import finalize_scope
from walkserve.capture.loopsem import LoopError
from walkserve.capture.model import CapturedModel
from walkserve.capture.records import Scope
from walkserve.capture.serialize import tensor_to_data
from walkserve.capture.tracer import CONST_PREFIX, WalkTracer

META_LOOP_ITERATIONS = 2


@typechecked
def trace(
    model: nn.Module, sample_inputs: Mapping[str, Any], walks: Sequence[str] | None = None
) -> CapturedModel:
    """Capture ``model``'s walks (all, or those named in ``walks``). ``sample_inputs`` holds
    a value for every input of the entry walks (extra keys are ignored)."""
    specs = walk_specs(model)
    if not specs:
        raise CaptureError("no-walks", f"{type(model).__name__} declares no @walk method")
    names = list(walks) if walks is not None else list(specs)
    unknown = [w for w in names if w not in specs]
    if unknown:
        raise CaptureError(
            "unknown-walk", f"unknown walks {unknown}; the model declares {list(specs)}"
        )

    graph = ir.WalkGraph(
        model=f"{type(model).__module__}.{type(model).__qualname__}",
        components={},
        walks={},
        custom_transition=callable(getattr(model, "next_walk", None)),
    )
    captured = CapturedModel(graph, model)
    captured.sample_inputs = dict(sample_inputs)
    state: dict[str, Any] = dict(sample_inputs)
    pending = list(names)
    with torch.no_grad():
        while pending:
            name = next((w for w in pending if _inputs_ready(model, specs[w][0], state)), None)
            if name is None:
                first = pending[0]
                defaults = _walk_defaults(model, specs[first][0])
                need = [
                    p
                    for p in _walk_params(model, specs[first][0])
                    if p not in state and p not in defaults
                ]
                raise CaptureError(
                    "walk-inputs",
                    f"walk {first!r} needs inputs {need}: give them in sample_inputs or produce them "
                    "as outputs of a walk that runs before it",
                )
            pending.remove(name)
            method, spec = specs[name]
            graph.walks[name] = _trace_walk(model, method, spec, graph)
            traced = graph.walks[name]
            record: dict[str, ir.ValueMeta] = {}
            probe = EmbeddingProbe({i.name: state.get(i.name) for i in traced.inputs})
            runner = Interpreter(
                captured,
                loop_limit=META_LOOP_ITERATIONS,
                record=record,
                check_carried=True,
                observe_op=probe.observe_op,
            )
            with probe:
                outputs = _sample_run(runner, traced, state)
            traced.values = record
            traced.inputs = input_specs(
                ir.Walk(
                    **{
                        **_fields(traced),
                        "inputs": [
                            ir.WalkInput(i.name, record.get(i.name), i.default)
                            for i in traced.inputs
                        ],
                    }
                ),
                {k: decl.resolve(model) for k, decl in spec.inputs},
                probe.found,
            )
            _check_sample(traced, sample_inputs)
            state.update(outputs)
    for w in graph.walks.values():
        if w.next is not None and w.next not in graph.walks:
            raise CaptureError(
                "unknown-walk",
                f"walk {w.name!r} names next={w.next!r}, which is not captured",
                w.source,
            )
    lint(graph)
    return captured


def _fields(walk: ir.Walk) -> dict[str, Any]:
    return {f: getattr(walk, f) for f in walk.__struct_fields__}


def _sample_run(runner: Interpreter, walk: ir.Walk, state: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``walk`` on the sample state (loops cut short); a loop that cannot run on it is a
    capture error naming the loop's line."""
    try:
        return runner.run_walk(walk.name, state)
    except LoopError as e:
        loop = next(
            (
                n
                for n in dataflow.iter_nodes(walk.body)
                if isinstance(n, ir.LoopNode) and f"loop {n.name} " in str(e)
            ),
            None,
        )
        raise CaptureError(
            "sample-loop",
            f"running walk {walk.name!r} on the sample inputs failed: {e}",
            loop.source if loop is not None else walk.source,
        ) from e
    except InterpreterError as e:
        raise CaptureError(
            "sample-run",
            f"running walk {walk.name!r} on the sample inputs failed: {e}; capture runs every "
            "walk once on sample_inputs, which must be a request the model can serve",
            e.source or walk.source,
        ) from e


def _check_sample(walk: ir.Walk, sample_inputs: Mapping[str, Any]) -> None:
    """The sample request must pass its own walk's input checks (declarations included)."""
    try:
        check_inputs(
            walk, {i.name: sample_inputs[i.name] for i in walk.inputs if i.name in sample_inputs}
        )
    except InputError as e:
        raise CaptureError(
            "walk-inputs", f"the sample request breaks the walk's input rules: {e}", walk.source
        ) from None


def _walk_params(model: nn.Module, method: str) -> list[str]:
    import inspect

    fn = getattr(type(model), method)
    return list(inspect.signature(fn).parameters)[1:]


def _walk_defaults(model: nn.Module, method: str) -> dict[str, int | float | bool]:
    """The walk method's scalar parameter defaults (inputs a request may leave out)."""
    import inspect

    fn = getattr(type(model), method)
    found: dict[str, int | float | bool] = {}
    for name, p in list(inspect.signature(fn).parameters.items())[1:]:
        if p.default is p.empty:
            continue
        if not isinstance(p.default, int | float | bool):
            raise CaptureError(
                "walk-inputs",
                f"walk parameter {name!r} has default {p.default!r}: a walk input's default "
                "must be an int, float or bool",
            )
        found[name] = p.default
    return found


def _inputs_ready(model: nn.Module, method: str, state: Mapping[str, Any]) -> bool:
    defaults = _walk_defaults(model, method)
    return all(p in state or p in defaults for p in _walk_params(model, method))


def _trace_walk(model: nn.Module, method: str, spec: WalkSpec, graph: ir.WalkGraph) -> ir.Walk:
    tracer = WalkTracer(model, const_prefix=f"{spec.name}.")
    tracer.traced_func_name = method
    token = ACTIVE_HOOK.set(tracer)
    try:
        with shims.patched(_model_functions(model)), rng.DrawMode(tracer):
            fx_graph = tracer.trace(model)
    except CaptureError:
        raise
    except (TypeError, RuntimeError, ValueError, AttributeError, IndexError) as e:
        raise traced_value_error(e) from e
    finally:
        ACTIVE_HOOK.reset(token)
    scope = tracer.scopes.get(id(fx_graph)) or Scope(fx_graph)
    finalize_scope(tracer, scope)
    conv = BlockConverter(tracer, fx_graph, "")
    block, out = conv.convert()
    source = _method_source(model, method)
    defaults = _walk_defaults(model, method)
    if out is None or (isinstance(out, dict) and not out):
        raise CaptureError(
            "walk-output", f"walk {spec.name!r} returns no output; return a dict of tensors", source
        )
    if isinstance(out, dict):
        outputs = {str(k): conv.arg(v) for k, v in out.items()}
    else:
        outputs = {"output": conv.arg(out)}
    missing_state = [s for s in spec.state if s not in outputs]
    if missing_state:
        raise CaptureError(
            "walk-state",
            f"walk {spec.name!r} declares state {missing_state} that it does not return",
            source,
        )
    for path, (module, cspec) in tracer.components.items():
        graph.components[path] = ir.ComponentInfo(
            path,
            f"{type(module).__module__}.{type(module).__qualname__}",
            cspec.engine,
            cspec.batch_dim,
            cspec.speculative,
            sum(p.numel() for p in module.parameters()),
        )
    for path, tensor in tracer.constants.items():
        graph.constants[path[len(CONST_PREFIX) :]] = tensor_to_data(tensor)
    return ir.Walk(
        name=spec.name,
        inputs=[ir.WalkInput(p, default=defaults.get(p)) for p in block.params],
        body=block,
        outputs=outputs,
        streams=conv.streams,
        next=spec.next,
        state=list(spec.state),
        source=source,
    )


def _model_functions(model: nn.Module) -> list[Any]:
    """The functions of the model's classes (walks, loop bodies, helpers)."""
    return [
        v
        for klass in type(model).__mro__
        if klass.__module__ != "builtins" and not klass.__module__.startswith("torch.")
        for v in vars(klass).values()
        if inspect.isfunction(v)
    ]


def _method_source(model: nn.Module, method: str) -> str | None:
    import inspect
    import os

    fn = getattr(type(model), method)
    try:
        path = inspect.getsourcefile(fn) or "?"
        line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return None
    rel = os.path.relpath(path)
    return f"{rel if not rel.startswith('..') else path}:{line}"
