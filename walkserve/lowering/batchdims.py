"""Batch-dimension analysis: which dimension of every value is the request's batch dimension.

The IR does not say where the batch dimension of a value is: a KV cache is ``[layers, B, heads,
T, head_dim]``, a latent ``[B, C, H, W]``, a stop flag has none. We find out by running each
walk twice through the reference interpreter (loops cut to two iterations): once on the sample
request, once on the sample request doubled (every tensor input concatenated with itself along
dim 0, the batch dimension of walk inputs by convention). A dimension whose size doubles is the
batch dimension; a value with no such dimension has none (it is shared by the requests of a
batch only when equal). Nested tuples and lists get a tree of dimensions:

    sample     k_cache [2, 1, 4, 9, 8]      doubled [2, 2, 4, 9, 8]    -> 1
    sample     (logits [1,1,64], k [...])   doubled (..)               -> (0, 1)
    sample     done [] (bool)               doubled []                 -> None

The same runs record one sample argument list per component op (for compile checks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.interpret import Interpreter
from walkserve.capture.model import CapturedModel

BatchDim = int | None | tuple["BatchDim", ...]

ANALYSIS_LOOP_ITERATIONS = 2


@dataclass
class BatchAnalysis:
    """Per walk: value name -> batch dim tree; op name -> sample (args, kwargs)."""

    dims: dict[str, dict[str, BatchDim]] = field(default_factory=dict)
    samples: dict[str, dict[str, tuple[list[Any], dict[str, Any]]]] = field(default_factory=dict)


def batch_dim_of(single: Any, double: Any) -> BatchDim:
    """The dimension along which ``double`` is twice ``single`` (recursively for tuples)."""
    if isinstance(single, torch.Tensor) and isinstance(double, torch.Tensor):
        if single.dim() != double.dim():
            return None
        hits = [
            d
            for d in range(single.dim())
            if double.shape[d] == 2 * single.shape[d] and single.shape[d] > 0
        ]
        others_equal = all(
            single.shape[d] == double.shape[d] for d in range(single.dim()) if d not in hits
        )
        return hits[0] if len(hits) == 1 and others_equal else None
    if (
        isinstance(single, (tuple, list))
        and isinstance(double, (tuple, list))
        and len(single) == len(double)
    ):
        return tuple(batch_dim_of(a, b) for a, b in zip(single, double))
    return None


def _merge(a: BatchDim, b: BatchDim) -> BatchDim:
    """Two observations of one value (two loop iterations) agree, else no batch dim."""
    return a if a == b else None


def double_request(inputs: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: torch.cat([v, v], dim=0) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
        for k, v in inputs.items()
    }


def analyze(captured: CapturedModel, sample_inputs: Mapping[str, Any]) -> BatchAnalysis:
    """Batch dimensions of every value of every walk, following the walks' transitions from the
    entry walks so that later walks see the state earlier ones produced."""
    result = BatchAnalysis()
    graph = captured.graph
    single_state: dict[str, Any] = dict(sample_inputs)
    double_state: dict[str, Any] = double_request(sample_inputs)
    order = _walk_order(graph)
    with torch.no_grad():
        for walk in order:
            seen1: dict[str, list[Any]] = {}
            seen2: dict[str, list[Any]] = {}
            samples: dict[str, tuple[list[Any], dict[str, Any]]] = {}

            def first_args(
                op: ir.Op, args: list[Any], kwargs: dict[str, Any], samples: dict = samples
            ) -> None:
                samples.setdefault(op.name, (list(args), dict(kwargs)))

            run1 = Interpreter(
                captured,
                loop_limit=ANALYSIS_LOOP_ITERATIONS,
                observe=_collector(seen1),
                observe_op=first_args,
            )
            run2 = Interpreter(
                captured, loop_limit=ANALYSIS_LOOP_ITERATIONS, observe=_collector(seen2)
            )
            out1 = run1.run_walk(walk, single_state)
            out2 = run2.run_walk(walk, double_state)
            dims: dict[str, BatchDim] = {}
            for name, values in seen1.items():
                pairs = list(zip(values, seen2.get(name, [])))
                if not pairs:
                    dims[name] = None
                    continue
                dim = batch_dim_of(*pairs[0])
                for a, b in pairs[1:]:
                    dim = _merge(dim, batch_dim_of(a, b))
                dims[name] = dim
            result.dims[walk] = dims
            result.samples[walk] = samples
            single_state.update(out1)
            double_state.update(out2)
    return result


def _collector(seen: dict[str, list[Any]]) -> Callable[[str, Any], None]:
    def observe(name: str, value: Any) -> None:
        seen.setdefault(name, []).append(value)

    return observe


def _walk_order(graph: ir.WalkGraph) -> list[str]:
    order: list[str] = []
    for entry in graph.entry_walks():
        current: str | None = entry
        while current is not None and current not in order:
            order.append(current)
            current = graph.walks[current].next
    order += [w for w in graph.walks if w not in order]
    return order
