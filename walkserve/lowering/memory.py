"""Memory estimate per rank of a resolved placement (review section 6: weights alone are not a
feasibility check; live KV state, stream buffers and workspaces count too).

Owns ``MemoryLimits`` (the request-side bounds an estimate assumes), ``MemoryEstimate`` (one
rank's bytes by kind, with its largest contributors) and ``estimate_memory()``, which also
checks each rank's budget. In: a ``ResolvedPlacement``, the ``CapturedModel`` (its modules give
weight bytes, its IR gives value shapes). Out: ``dict[rank, MemoryEstimate]``::

    total(rank) = weights + KV pool + stream buffers + workspace

    weights         parameter + buffer bytes of each component with a node on the rank, once
                    per rank however often it is called, plus the model attributes and tensor
                    constants read by nodes on the rank. At tensor-parallel degree N, one
                    shard's bytes: a Hugging Face model's parameters as its own TP plan splits
                    them (sharded ones / N, replicated ones whole: norms, routers, row-parallel
                    biases, K/V projections whose heads are replicated, ``runtime.tp.heads``);
                    any other tensor / N
    KV pool         each kv_cache component on the rank: a component that sizes its own pool
                    (``kv_pool_nbytes(tensor_parallel)``: the paged pool, this rank's KV heads)
                    says so; otherwise the bytes of the growing carried state (a loop parameter
                    with a None dim: the KV cache) its nodes read, per request, x
                    max_concurrent_requests (/ its tensor-parallel degree)
    stream buffers  each streaming edge whose consumer reads chunks on the rank: the producer
                    loop's per-iteration bytes x its maximum trips x max_concurrent_requests
    workspace       workspace_fraction x weights (activations, graph-capture workspaces)

Unknown lengths (a None dim, a trip count that a request input or a stream sets) count as
``limits.max_len``. Shapes are the sample request's (one sequence), so bytes are per request.
A rank over its budget is a ``PlacementError`` that names the rank's biggest contributor and
what would shrink it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from typeguard import typechecked

from walkserve.capture import dataflow, ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.placement import PlacementError, check_field_types, format_size
from walkserve.lowering.resolved import NodePlacement, ResolvedPlacement
from walkserve.lowering.valueflow import ValueFlow

__all__ = ["MemoryEstimate", "MemoryLimits", "estimate_memory", "format_memory"]


@dataclass(frozen=True)
class MemoryLimits:
    """What the estimate assumes about requests: ``max_len`` stands for every length the IR
    leaves open (None dims, request-set trip counts); ``max_concurrent_requests`` is how many
    requests hold KV state and stream buffers at once, per rank; ``workspace_fraction`` of the
    weights is reserved for activations and graph workspaces."""

    max_len: int = 4096
    max_concurrent_requests: int = 8
    workspace_fraction: float = 0.1

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if not 0 <= self.workspace_fraction <= 10:
            raise ValueError(
                f"workspace_fraction must be in [0, 10], got {self.workspace_fraction}"
            )


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's estimated bytes by kind; ``contributors`` are (what, bytes), largest first."""

    rank: int
    weights: int
    kv_pool: int
    stream_buffers: int
    workspace: int
    budget: int | None
    contributors: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.stream_buffers + self.workspace

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.total > self.budget


@typechecked
def estimate_memory(
    resolved: ResolvedPlacement,
    captured: CapturedModel,
    limits: MemoryLimits | None = None,
    *,
    check_budget: bool = True,
) -> dict[int, MemoryEstimate]:
    """The estimate of every rank (see the module docstring). With ``check_budget``, a rank
    over its budget raises ``PlacementError`` naming the rank, its total, its budget and its
    largest contributors."""
    limits = limits or MemoryLimits()
    parts: dict[int, dict[str, dict[str, int]]] = {
        rank: {"weights": {}, "kv": {}, "streams": {}} for rank in range(resolved.placement.ranks)
    }
    for rank, label, nbytes in _weights(resolved, captured):
        parts[rank]["weights"][label] = nbytes
    for rank, label, nbytes in _kv_pools(resolved, captured, limits):
        parts[rank]["kv"][label] = nbytes
    for rank, label, nbytes in _stream_buffers(resolved, captured, limits):
        parts[rank]["streams"][label] = nbytes
    budgets = resolved.placement.memory_budget_bytes or {}
    estimates = {
        rank: _estimate(rank, kinds, limits, budgets.get(rank)) for rank, kinds in parts.items()
    }
    over = [e for e in estimates.values() if e.over_budget]
    if check_budget and over:
        raise PlacementError("\n".join(_over_budget_message(e) for e in over))
    return estimates


def _estimate(
    rank: int, kinds: Mapping[str, Mapping[str, int]], limits: MemoryLimits, budget: int | None
) -> MemoryEstimate:
    weights = sum(kinds["weights"].values())
    workspace = math.ceil(weights * limits.workspace_fraction)
    contributors = [
        *kinds["weights"].items(),
        *kinds["kv"].items(),
        *kinds["streams"].items(),
        ("workspace", workspace),
    ]
    contributors.sort(key=lambda item: -item[1])
    return MemoryEstimate(
        rank=rank,
        weights=weights,
        kv_pool=sum(kinds["kv"].values()),
        stream_buffers=sum(kinds["streams"].values()),
        workspace=workspace,
        budget=budget,
        contributors=tuple(c for c in contributors if c[1] > 0),
    )


def _over_budget_message(e: MemoryEstimate) -> str:
    largest = ", ".join(f"{what} {format_size(n)}" for what, n in e.contributors[:3])
    biggest, nbytes = e.contributors[0] if e.contributors else ("nothing", 0)
    return (
        f"rank {e.rank} needs an estimated {format_size(e.total)} ({e.total} bytes) but its "
        f"memory budget is {format_size(e.budget or 0)} ({e.budget} bytes); the biggest "
        f"contributor is {biggest} ({format_size(nbytes)}, {100 * nbytes // max(e.total, 1)}% "
        f"of the total): {_remedy(biggest)}. Largest contributors: {largest}"
    )


def _remedy(what: str) -> str:
    if what.startswith("weights "):
        return (
            "shard its component over more ranks (a higher tensor_parallel), move it to a "
            "rank with room, or raise the budget"
        )
    if what.startswith("KV pool "):
        return (
            "give its component a smaller KV pool (kv_pool_tokens), lower max_len / "
            "max_concurrent_requests, or shard it over more ranks"
        )
    if what.startswith("stream "):
        return "lower max_len / max_concurrent_requests, or consume the stream on another rank"
    if what == "workspace":
        return "lower workspace_fraction, or shard the weights over more ranks"
    return "move the nodes that read it to another rank, or raise the budget"


# ------------------------------------------------------------------------------ weights


def _weights(
    resolved: ResolvedPlacement, captured: CapturedModel
) -> Iterator[tuple[int, str, int]]:
    """(rank, "weights <component>", bytes) per component on each rank, and one
    "model attributes" entry per rank for the attributes and constants its nodes read."""
    seen: dict[int, set[int]] = defaultdict(set)  # rank -> tensors counted (shared: once)
    for rank, path, degree in _components_on_ranks(resolved):
        module = captured.model.get_submodule(path)
        shard = _shard_bytes(module, degree)
        tensors = _module_tensors(module)
        nbytes = sum(shard.get(id(t), _nbytes(t)) for t in tensors if id(t) not in seen[rank])
        seen[rank].update(id(t) for t in tensors)
        yield rank, _weights_label(path, degree), nbytes
    for rank, nbytes in _attribute_bytes(resolved, captured).items():
        yield rank, "model attributes", nbytes


def _components_on_ranks(resolved: ResolvedPlacement) -> list[tuple[int, str, int]]:
    """(rank, component path, tensor-parallel degree) for every component with a node on a
    rank; the smallest degree when its nodes differ (the largest share of its weights)."""
    degrees: dict[tuple[int, str], int] = {}
    for p in resolved.nodes():
        if p.kind == "component":
            for rank in p.ranks:
                degrees[rank, p.target] = min(
                    degrees.get((rank, p.target), p.tensor_parallel), p.tensor_parallel
                )
    return [(rank, path, degree) for (rank, path), degree in sorted(degrees.items())]


def _weights_label(path: str, degree: int) -> str:
    return f"weights {path}" + (f" (1/{degree} shard)" if degree > 1 else "")


# styles of transformers' TP plans that keep a parameter whole on every rank
_REPLICATED_STYLES = frozenset(
    {"replicate", "replicated_with_grad_allreduce", "sequence_parallel", "moe_identity_expert"}
)


def _shard_bytes(module: torch.nn.Module, degree: int) -> dict[int, int]:
    """id(tensor) -> its bytes on one of ``degree`` shards; tensors not listed count
    ``ceil(bytes / degree)``. Parameters of a Hugging Face model inside ``module`` (one with a
    ``tp_plan``) follow that plan: a style that splits them, / degree; a replicated style, a
    row-parallel bias, no rule at all or a buffer, whole; K/V projections whose heads are
    replicated (fewer KV heads than ranks), this rank's heads only. A parameter without a TP
    rule that the model's ``ep_plan`` shards (MoE experts: transformers 5.25 names them there
    only, and ``tp.shard`` then splits whole experts across the ranks), / degree."""
    if degree == 1:
        return {id(t): _nbytes(t) for t in _module_tensors(module)}
    out: dict[int, int] = {id(t): math.ceil(_nbytes(t) / degree) for t in _module_tensors(module)}
    done: set[int] = set()
    for _, sub in module.named_modules():
        plan = getattr(sub, "tp_plan", None)
        if not isinstance(plan, Mapping) or not plan or id(sub) in done:
            continue
        kv_share = _kv_share(sub, degree)
        ep_plan = getattr(sub, "ep_plan", None)
        ep_plan = ep_plan if isinstance(ep_plan, Mapping) else {}
        for name, param in sub.named_parameters():
            style = _plan_style(name, plan) or _plan_style(name, ep_plan)
            nbytes = _nbytes(param)
            if (
                style is None
                or style in _REPLICATED_STYLES
                or (style == "rowwise" and name.endswith(".bias"))
            ):
                out[id(param)] = nbytes
            elif kv_share is not None and name.rsplit(".", 2)[-2] in ("k_proj", "v_proj"):
                out[id(param)] = math.ceil(nbytes * kv_share)
            else:
                out[id(param)] = math.ceil(nbytes / degree)
        for buffer in sub.buffers():  # rotary tables and the like: every rank's own copy
            out[id(buffer)] = _nbytes(buffer)
        done.update(id(m) for m in sub.modules())
    return out


def _plan_style(name: str, plan: Mapping[str, str]) -> str | None:
    """The plan's style for parameter ``name`` (layer numbers match ``*``), its own or its
    module's, as transformers looks it up."""
    generic = re.sub(r"\.\d+\.", ".*.", name)
    generic = re.sub(r"\.\d+\.", ".*.", generic)  # adjacent numbers (experts.3.0.)
    if generic in plan:
        return plan[generic]
    return plan.get(generic.rsplit(".", 1)[0]) if "." in generic else None


def _kv_share(model: torch.nn.Module, degree: int) -> float | None:
    """The share of the K/V projections one rank holds when KV heads are replicated (fewer
    than ranks); None when they split evenly like every other sharded matrix."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv, int) or kv % degree == 0:
        return None
    return 1 / kv


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _attribute_bytes(resolved: ResolvedPlacement, captured: CapturedModel) -> dict[int, int]:
    """Bytes of model attributes (``ModelAttr``) and tensor constants read by the op nodes on
    each rank, and by loop parameters (on the ranks of the ops reading the parameter)."""
    needed: dict[int, set[ir.ModelAttr | ir.TensorConst]] = defaultdict(set)
    for name, walk in captured.walks.items():
        placed, flow = resolved.walks[name], ValueFlow(walk)
        for op in flow.ops.values():
            for rank in placed[op.name].ranks:
                needed[rank].update(_tensor_args([*op.args, *op.kwargs.values()]))
        for loop in (n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.LoopNode)):
            for param in loop.params:
                attrs = _tensor_args(dataflow.role_args(param.role))
                for reader in flow.readers[param.name]:
                    for rank in placed[reader].ranks:
                        needed[rank].update(attrs)
    return {rank: sum(_arg_bytes(a, captured) for a in args) for rank, args in needed.items()}


def _tensor_args(args: Iterable[ir.Arg]) -> set[ir.ModelAttr | ir.TensorConst]:
    found: set[ir.ModelAttr | ir.TensorConst] = set()
    for arg in args:
        if isinstance(arg, (ir.ModelAttr, ir.TensorConst)):
            found.add(arg)
        elif isinstance(arg, (ir.ListArg, ir.TupleArg)):
            found |= _tensor_args(arg.items)
        elif isinstance(arg, ir.DictArg):
            found |= _tensor_args(arg.items.values())
        elif isinstance(arg, ir.SliceArg):
            found |= _tensor_args([arg.start, arg.stop, arg.step])
    return found


def _arg_bytes(arg: ir.ModelAttr | ir.TensorConst, captured: CapturedModel) -> int:
    if isinstance(arg, ir.ModelAttr):
        return _nbytes(captured.attr(arg.path))
    return len(captured.graph.constants[arg.name].data)


# ------------------------------------------------------------------------------ KV pools


def _kv_pools(
    resolved: ResolvedPlacement, captured: CapturedModel, limits: MemoryLimits
) -> Iterator[tuple[int, str, int]]:
    """(rank, "KV pool <component>", bytes) for each kv_cache component on each rank. A
    component's per-request state is the largest over the loops that call it (walks of one
    request reuse one cache: a prefill's cache is the decode loop's carried state)."""
    per_request: dict[str, int] = defaultdict(int)
    for walk in captured.walks.values():
        for loop in (n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.LoopNode)):
            for path, nbytes in _loop_kv_bytes(loop, walk, captured, limits).items():
                per_request[path] = max(per_request[path], nbytes)
    for rank, path, degree in _components_on_ranks(resolved):
        sized = getattr(captured.model.get_submodule(path), "kv_pool_nbytes", None)
        label = f"KV pool {path}" + (f" (1/{degree} shard)" if degree > 1 else "")
        if callable(sized):
            yield rank, label, int(sized(degree))
        elif per_request.get(path):
            pool = per_request[path] * limits.max_concurrent_requests
            yield rank, label, math.ceil(pool / degree)


def _loop_kv_bytes(
    loop: ir.LoopNode, walk: ir.Walk, captured: CapturedModel, limits: MemoryLimits
) -> dict[str, int]:
    """Component path -> bytes of the growing carried parameters (a None dim) that the loop
    body's kv_cache component ops read directly."""
    growing = {
        p.name: meta
        for p in loop.params
        if isinstance(p.role, ir.Carried)
        and isinstance(meta := walk.values.get(p.name), ir.TensorMeta)
        and None in meta.shape
    }
    out: dict[str, int] = defaultdict(int)
    for op in loop.body.nodes:
        info = captured.graph.components.get(op.target) if isinstance(op, ir.Op) else None
        if isinstance(op, ir.Op) and info is not None and info.engine == "kv_cache":
            read = dict.fromkeys(v for v in dataflow.node_inputs(op) if v in growing)
            out[op.target] += sum(_meta_bytes(growing[v], limits.max_len) for v in read)
    return out


def _meta_bytes(meta: ir.TensorMeta, max_len: int) -> int:
    """Bytes of a tensor of this metadata, a None dim counting as ``max_len``."""
    dtype: torch.dtype = getattr(torch, meta.dtype)  # the IR names dtypes as torch does
    return math.prod(max_len if d is None else d for d in meta.shape) * dtype.itemsize


# ------------------------------------------------------------------------------ streams


def _stream_buffers(
    resolved: ResolvedPlacement, captured: CapturedModel, limits: MemoryLimits
) -> Iterator[tuple[int, str, int]]:
    """(rank, "stream <name>", bytes) for each streaming edge, on the ranks of the consumer
    ops that read its chunks. The buffer can hold the producer's whole accumulated channel:
    its per-iteration bytes x the producer loop's maximum trips."""
    for name, walk in captured.walks.items():
        loops = {n.name: n for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.LoopNode)}
        for stream in walk.streams:
            producer = next(lp for lp in loops.values() if stream.source in lp.accumulated)
            step = walk.values.get(producer.outputs[producer.accumulated[stream.source].output])
            if not isinstance(step, ir.TensorMeta):
                continue
            nbytes = _meta_bytes(step, limits.max_len) * _max_trips(producer, limits.max_len)
            nbytes *= limits.max_concurrent_requests
            for rank in _chunk_reader_ranks(loops[stream.consumer], stream, resolved.walks[name]):
                yield rank, f"stream {stream.name}", nbytes


def _max_trips(loop: ir.LoopNode, max_len: int) -> int:
    if isinstance(loop.trips, ir.FixedTrips):
        return loop.trips.count
    return loop.max_iters if isinstance(loop.max_iters, int) else max_len


def _chunk_reader_ranks(
    consumer: ir.LoopNode, stream: ir.StreamEdge, placed: Mapping[str, NodePlacement]
) -> list[int]:
    chunks = {
        p.name
        for p in consumer.params
        if isinstance(p.role, ir.PerStep)
        and isinstance(p.role.source, ir.ChunkStep)
        and p.role.source.stream == stream.name
    }
    ranks: set[int] = set()
    for op in dataflow.iter_nodes(consumer.body):
        if isinstance(op, ir.Op) and chunks & set(dataflow.node_inputs(op)):
            ranks.update(placed[op.name].ranks)
    return sorted(ranks)


# ------------------------------------------------------------------------------ table


def format_memory(estimates: Mapping[int, MemoryEstimate]) -> str:
    """A per-rank table: weights, KV pool, stream buffers, workspace, total, budget."""
    header = ("rank", "weights", "KV pool", "streams", "workspace", "total", "budget")
    rows = [header] + [
        (
            str(e.rank),
            format_size(e.weights),
            format_size(e.kv_pool),
            format_size(e.stream_buffers),
            format_size(e.workspace),
            format_size(e.total),
            "-" if e.budget is None else format_size(e.budget) + (" OVER" if e.over_budget else ""),
        )
        for e in sorted(estimates.values(), key=lambda e: e.rank)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
