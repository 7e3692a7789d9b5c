"""CUDA-graph replay of a batched component, one graph per batch bucket (CUDA only).

The CPU twin is ``batched.BatchedComponent``: same calling convention, same grouping, same
results (tests on a GPU compare the two). Imported lazily; nothing here records without CUDA.
A served node gets a ``GraphOnFirstCall`` (``callables.build_callables``, where the plan says
``cuda_graph``): eager until its first call on a CUDA device, whose arguments are the template.

For each bucket size ``b`` the component is recorded once on static input buffers shaped like
the template request with the batch dimension widened to ``b``:

    static inputs [b, ...] --graph replay--> static outputs [b, ...]

A call copies the group's concatenated inputs into the first rows of the smallest bucket that
holds it, replays, and copies the first rows of the outputs out (rows past the group are stale
and dropped; components are row-independent by contract). A group whose non-batch shapes or
shared arguments differ from the template, or that is larger than the largest bucket, runs
eagerly: a graph never computes something the eager call would not.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from walkserve.lowering.batched import (
    BatchedComponent,
    BatchStats,
    Call,
    _batch_size,
    _compatible,
    _split,
)

__all__ = ["GraphOnFirstCall", "GraphedComponent"]

log = logging.getLogger("walkserve.cudagraph")


class GraphedComponent(BatchedComponent):
    """A batched component replayed from CUDA graphs (see the module docstring)."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        in_dims: Sequence[Any],
        kw_dims: dict[str, Any],
        out_dim: Any,
        buckets: Sequence[int],
        template: Call,
    ) -> None:
        super().__init__(name, fn, in_dims, kw_dims, out_dim)
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.template = template
        self.sizes = sorted(buckets)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Call, Any]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            self.graphs[b] = self._record(b)
        self.replays = 0

    def _widen(self, value: Any, dim: Any, b: int) -> Any:
        if not isinstance(dim, int):
            return value
        reps = [1] * value.dim()
        reps[dim] = -(-b // value.shape[dim])
        return value.repeat(*reps).narrow(dim, 0, b).contiguous()

    def _record(self, b: int) -> tuple[torch.cuda.CUDAGraph, Call, Any]:
        args = [self._widen(a, d, b) for a, d in zip(self.template[0], self.in_dims)]
        kwargs = {k: self._widen(v, self.kw_dims.get(k), b) for k, v in self.template[1].items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm up kernels and allocator outside the graph
                self.fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            out = self.fn(*args, **kwargs)
        return graph, (args, kwargs), out

    def _run(self, calls: list[Call], sizes: list[int] | None = None) -> list[Any]:
        if sizes is None:
            sizes = [_batch_size(c, self.in_dims, self.kw_dims) for c in calls]
        total = sum(sizes)
        k = bisect.bisect_left(self.sizes, total)
        if k == len(self.sizes) or not self._matches_template(calls[0]):
            return super()._run(calls, sizes)
        graph, (args, kwargs), out = self.graphs[self.sizes[k]]
        for j, d in enumerate(self.in_dims):
            if isinstance(d, int):
                args[j].narrow(d, 0, total).copy_(torch.cat([c[0][j] for c in calls], dim=d))
            elif isinstance(args[j], torch.Tensor):
                args[j].copy_(calls[0][0][j])  # shared by the group: same value in every call
        for key in kwargs:
            d = self.kw_dims.get(key)
            if isinstance(d, int):
                kwargs[key].narrow(d, 0, total).copy_(torch.cat([c[1][key] for c in calls], dim=d))
            elif isinstance(kwargs[key], torch.Tensor):
                kwargs[key].copy_(calls[0][1][key])
        graph.replay()
        self.replays += 1
        return _split(_clone(out), self.out_dim, sizes)

    def _matches_template(self, call: Call) -> bool:
        """Same shapes as the recorded template; shared tensors may differ in value (they are
        copied into the graph's buffers), Python values and objects may not."""
        t_args, t_kwargs = self.template
        if len(call[0]) != len(t_args) or call[1].keys() != t_kwargs.keys():
            return False
        pairs = list(zip(call[0], t_args, self.in_dims)) + [
            (call[1][k], t_kwargs[k], self.kw_dims.get(k)) for k in call[1]
        ]
        for x, y, d in pairs:
            if (
                not isinstance(d, int)
                and isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
            ):
                if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
                    return False
            elif not _compatible(x, y, d):
                return False
        return True

    def joined(self, call: Call, count: int) -> Any:
        """A loop stepper's joined call (``BatchedComponent.joined``), from the graph of the
        smallest bucket that holds its rows (eager where none does or it does not match)."""
        if self.stats is not None:
            self.stats.add(self.name, count)
        return self._run([call])[0]

    def __call__(self, batch: Sequence[Call]) -> list[Any]:
        results: list[Any] = [None] * len(batch)
        for group in self._groups(batch):
            outs = self._run([batch[i] for i in group])
            for i, out in zip(group, outs):
                results[i] = out
        return results


class GraphOnFirstCall(BatchedComponent):
    """A component node the plan records as CUDA graphs: eager (``BatchedComponent``) until
    its first call whose tensors are on a CUDA device, which records one graph per bucket of
    ``graph_buckets`` with that call as the template (``GraphedComponent``); from then on its
    calls replay them where they match. A recording that fails (the component does something
    a graph cannot hold after all) leaves the node eager for good, said once in the log
    (``refused``). ``record`` makes the graphs (a test's stand-in on the CPU)."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        in_dims: Sequence[Any],
        kw_dims: dict[str, Any],
        out_dim: Any,
        *,
        graph_buckets: Sequence[int],
        stats: BatchStats | None = None,
        record: Callable[..., BatchedComponent] = GraphedComponent,
    ) -> None:
        super().__init__(name, fn, in_dims, kw_dims, out_dim, (), stats)
        self.graph_buckets = list(graph_buckets)
        self._record = record
        self.graphed: BatchedComponent | None = None
        self.refused: str | None = None

    def _graphs(self, call: Call) -> BatchedComponent | None:
        if self.graphed is None and self.refused is None and _on_cuda(call):
            try:
                self.graphed = self._record(
                    self.name,
                    self.fn,
                    self.in_dims,
                    self.kw_dims,
                    self.out_dim,
                    self.graph_buckets,
                    call,
                )
            except Exception as e:  # capture raises many types; the node runs eagerly
                self.refused = f"{type(e).__name__}: {e}"
                log.warning("node %s runs eagerly: its CUDA graphs failed: %s", self.name, e)
            else:
                self.graphed.stats = self.stats
        return self.graphed

    def counters(self) -> dict[str, int]:
        """Graph replays so far, and 1 under ``graphs_refused`` when its recording failed."""
        replays = getattr(self.graphed, "replays", 0)
        return {"graph_replays": replays, "graphs_refused": int(self.refused is not None)}

    def __call__(self, batch: Sequence[Call]) -> list[Any]:
        graphed = self._graphs(batch[0]) if batch else None
        return super().__call__(batch) if graphed is None else graphed(batch)

    def joined(self, call: Call, count: int) -> Any:
        graphed = self._graphs(call)
        return super().joined(call, count) if graphed is None else graphed.joined(call, count)


def _on_cuda(call: Call) -> bool:
    """Whether the first tensor argument of ``call`` is on a CUDA device."""
    for x in [*call[0], *call[1].values()]:
        if isinstance(x, torch.Tensor):
            return x.is_cuda
    return False


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out
