"""Compile and graph-capture plans, and the check that a node can be graph-captured.

On CUDA a capturable component node gets ``torch.compile`` and one CUDA graph per batch
bucket (static input/output buffers; see ``cudagraph``). On CPU the plan is still produced and
checked: a node is *capturable* when ``torch.compile(fullgraph=True)`` traces it into one graph
with a backend that only records (no compilation): host synchronizations (``.item()``,
``.tolist()``) and data-dependent shapes (``nonzero``) break the graph and are reported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from walkserve.lowering.plan import CompilePlan


def check_capturable(
    module: nn.Module, args: list[Any], kwargs: dict[str, Any]
) -> tuple[bool, str | None]:
    """(True, None) if one fullgraph dynamo trace covers ``module(*args, **kwargs)``."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, fullgraph=True, backend=record, dynamic=False)
        with torch.no_grad():
            compiled(*args, **kwargs)
    except Exception as e:  # dynamo raises many types; the first line says what broke
        return False, (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    finally:
        torch._dynamo.reset()
    if len(graphs) != 1:
        return False, f"{len(graphs)} graphs"
    return _graph_is_static(graphs[0])


def _graph_is_static(gm: torch.fx.GraphModule) -> tuple[bool, str | None]:
    """Dynamo may trace ``.item()`` and boolean masks into a graph as *unbacked* symbols (a
    value known only on the device); a CUDA graph can hold neither a host sync nor a shape
    that depends on data, so any such symbol makes the node not capturable."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if value is not None and free_unbacked_symbols(value):
            kind = "host sync" if not isinstance(value, torch.Tensor) else "data-dependent shape"
            return False, f"{kind} at {node.format_node()}"[:200]
    return True, None


def compile_plan(
    device: str, capturable: bool | None, reason: str | None, compile_on_cpu: bool = False
) -> CompilePlan:
    on_cuda = device.startswith("cuda")
    return CompilePlan(
        torch_compile=on_cuda or compile_on_cpu,
        cuda_graph=on_cuda and bool(capturable),
        capturable=capturable,
        reason=reason,
    )
