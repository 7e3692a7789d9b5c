"""What crossing hosts costs: the link model ``t(bytes) = alpha + bytes / beta`` (review eq. 8),
fitted from timed transfers, and the edges of a plan that cross hosts with their estimates.

Owns ``LinkModel``, ``fit_link`` (least squares over (bytes, seconds) samples) and
``cross_host_edges``. What crosses its boundary: samples in, frozen dataclasses out; no
process or socket here (``WorkerPool.measure_link`` times the probes at start-up).

Through the conductor (inline data between hosts), an edge from a node on rank ``a`` to one on
rank ``b`` is two hops, ``host(a) -> conductor`` and ``conductor -> host(b)``; each hop that
leaves the conductor's host costs ``alpha + bytes / beta`` of the link of the remote rank on
it. ``direct`` (Mooncake between ranks: the consumer pulls the value from its producer) makes
it one hop, ``host(a) -> host(b)``: none between ranks of one host, the remote rank's link
where one end is the conductor's host, and the slower of the two measured links between two
other hosts (each link is measured to the conductor's host). A value the conductor itself
holds (a client's input) is one hop either way. Bytes come from the value shapes the capture
observed on the sample inputs (a dimension that varies counts as ``max_len``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from walkserve.capture import ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.placement import LOCAL_HOST, Placement
from walkserve.lowering.plan import ExecutablePlan

PROBE_SIZES = (1 << 10, 64 << 10, 1 << 20)


@dataclass(frozen=True)
class LinkModel:
    """``alpha_s``: fixed cost of one transfer (s); ``beta_bytes_per_s``: bandwidth."""

    alpha_s: float
    beta_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.beta_bytes_per_s > 0):
            raise ValueError(
                f"a link needs alpha >= 0 and beta > 0, got {self.alpha_s}, {self.beta_bytes_per_s}"
            )

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s

    def __str__(self) -> str:
        return f"alpha {self.alpha_s * 1e6:.0f} us, beta {self.beta_bytes_per_s / 1e9:.3f} GB/s"


def fit_link(samples: Sequence[tuple[int, float]]) -> LinkModel:
    """``seconds = alpha + bytes / beta`` over (bytes, seconds) samples of at least two sizes,
    by least squares of the *relative* error (each sample weighted by 1 / seconds): sizes span
    orders of magnitude, and a plain fit would let the largest transfer decide alpha too.
    A negative alpha is clipped to 0; a flat or falling slope (noise swamping the bytes)
    gives beta from the largest sample alone."""
    sizes = {n for n, _ in samples}
    if len(sizes) < 2:
        raise ValueError(f"fitting alpha and beta needs samples of two sizes, got {sorted(sizes)}")
    if any(t <= 0 for _, t in samples):
        raise ValueError("transfer times must be positive")
    # normal equations of min sum((alpha + slope * n - t) / t)^2
    w = [1.0 / (t * t) for _, t in samples]
    s00 = sum(w)
    s01 = sum(wi * n for wi, (n, _) in zip(w, samples))
    s11 = sum(wi * n * n for wi, (n, _) in zip(w, samples))
    r0 = sum(wi * t for wi, (_, t) in zip(w, samples))
    r1 = sum(wi * n * t for wi, (n, t) in zip(w, samples))
    det = s00 * s11 - s01 * s01
    alpha = (s11 * r0 - s01 * r1) / det
    slope = (s00 * r1 - s01 * r0) / det
    if slope <= 0:
        big = max(samples)
        return LinkModel(max(0.0, min(t for _, t in samples)), big[0] / max(big[1], 1e-9))
    return LinkModel(max(0.0, alpha), 1.0 / slope)


@dataclass(frozen=True)
class CrossHostEdge:
    """Value ``value`` of walk ``walk`` made by node ``producer`` (on ``src_host``, None: the
    conductor, for walk inputs and loop plumbing) and read by node ``consumer`` (on
    ``dst_host``); ``nbytes`` per request and the estimated seconds of its hops."""

    walk: str
    value: str
    producer: str | None
    consumer: str
    src_host: str
    dst_host: str
    nbytes: int
    seconds: float


def cross_host_edges(
    captured: CapturedModel,
    plan: ExecutablePlan,
    placement: Placement,
    links: Mapping[int, LinkModel],
    default: LinkModel | None = None,
    max_len: int = 1,
    direct: bool = False,
) -> list[CrossHostEdge]:
    """The edges of ``plan`` whose value leaves a host (see the module docstring). ``links``:
    the measured link per remote rank; ``default`` for ranks without one (else their
    estimate is nan); ``direct``: values go rank to rank, not through the conductor."""

    def hop(rank: int, nbytes: int) -> float:
        if placement.host_of(rank) == LOCAL_HOST:
            return 0.0
        model = links.get(rank, default)
        return math.nan if model is None else model.seconds(nbytes)  # nan: not measured

    out: list[CrossHostEdge] = []
    for walk_name in plan.walks:
        walk = captured.graph.walks[walk_name]
        made: dict[str, tuple[str, int]] = {}
        nodes = plan.nodes(walk_name)
        for node in nodes:
            for op in node.ops:
                made[op] = (node.name, node.ranks[0])
        for node in nodes:
            dst = node.ranks[0]
            for value in node.inputs:
                producer, src = made.get(value, (None, None))
                src_host = LOCAL_HOST if src is None else placement.host_of(src)
                dst_host = placement.host_of(dst)
                if src_host == dst_host and (direct or src_host == LOCAL_HOST):
                    continue
                nbytes = _value_bytes(walk.values.get(value), max_len)
                if src is None:
                    seconds = hop(dst, nbytes)
                elif direct:  # one hop; between two other hosts, the slower measured link
                    seconds = max(hop(src, nbytes), hop(dst, nbytes))
                else:
                    seconds = hop(src, nbytes) + hop(dst, nbytes)
                out.append(
                    CrossHostEdge(
                        walk_name, value, producer, node.name, src_host, dst_host, nbytes, seconds
                    )
                )
    return out


def format_edges(edges: Sequence[CrossHostEdge]) -> str:
    lines = [
        f"{e.walk}: {e.value} ({e.producer or 'conductor'} on {e.src_host} -> {e.consumer} on "
        f"{e.dst_host}): {e.nbytes} B, ~{e.seconds * 1e3:.3f} ms"
        for e in edges
    ]
    return "\n".join(lines) if lines else "no edge crosses hosts"


def _value_bytes(meta: ir.ValueMeta | None, max_len: int) -> int:
    if isinstance(meta, ir.TensorMeta):
        import torch

        itemsize: int = getattr(torch, meta.dtype).itemsize
        return math.prod(max_len if d is None else d for d in meta.shape) * itemsize
    return 8  # a scalar; opaque objects never cross processes


__all__ = [
    "PROBE_SIZES",
    "CrossHostEdge",
    "LinkModel",
    "cross_host_edges",
    "fit_link",
    "format_edges",
]
