"""The conductor's frames: a frame made for a block instance (a walk body, one iteration of a
loop body) with its values bound (``_new_frame``), one pass over it (``_pump``: whole-value
streams filled, loops started, ops and regions dispatched, its loops stepped), the node items
it dispatches (``_dispatch``), and its release with everything under it (``_kill``). What it
starts it hands on: loops to ``LoopDriver`` (``runtime.loopdriver``), regions to
``RegionItems`` (``runtime.regionitems``), items to ``ready()`` (``LoopDriver._issue``).
``Conductor`` (``runtime.conductor``) is a ``FrameDriver``: the requests it pumps frames for
are its own.

Dispatch units: a plan node is one dispatch, but a frame splits it where the plan's grouping
would delay work: of a node's undispatched ops it dispatches those whose inputs exist (or come
from earlier ops of the same item), in order. A component node whose fused glue reads a
parallel branch's output thus dispatches the component at once and the glue later (as a
``glue`` item of the same node), and a glue group mixing early and late inputs runs in parts::

    node n = [component c, glue g(c, b)]       b: a parallel branch's output, not yet there
    pass 1   c's inputs exist, g needs b   -> item (n, component, ops=(c,))
    pass 2   b bound                       -> item (n, glue, ops=(g,)), env = {c, b}
"""

from __future__ import annotations

from typing import Any

from walkserve.runtime.frames import Forward, Frame, Pending, RequestState, Stream
from walkserve.runtime.regionitems import RegionItems
from walkserve.runtime.walkspec import BlockSpec, NodeSpec
from walkserve.runtime.workitem import NodeKind

__all__ = ["FrameDriver"]


class FrameDriver(RegionItems):
    """The frame half of ``Conductor``'s state machine (see the module docstring); the loops
    and region items its passes start are its bases'."""

    def _new_frame(
        self, spec: BlockSpec, path: tuple[int, ...], parent: Frame | None, values: dict[str, Any]
    ) -> Frame:
        f = Frame(spec, path, parent, uses=dict(spec.uses))
        f.todo = {n.name: list(range(len(n.ops))) for n in spec.nodes}
        f.regions = list(spec.regions)
        for rs in spec.regions:
            for ch, streams in rs.forwards.items():
                for stream in streams:
                    f.forwards[stream] = Forward(stream, ch)
        f.waiting = list(spec.loops)
        f.streams = {name: Stream(s) for name, s in spec.streams.items()}
        for name, value in values.items():
            self._bind(f, name, value)
        return f

    def _pump(self, req: RequestState, f: Frame) -> bool:
        """One pass over a frame: fill whole-value streams, start loops, dispatch ops,
        advance its loops. True if anything changed."""
        changed = False
        fed = self._fed.get(req.walk, frozenset())
        for s in f.streams.values():
            if s.spec.edge.name in fed:
                continue
            if s.spec.producer is None and not s.finished and s.spec.edge.source in f.env:
                s.append(f.env[s.spec.edge.source])
                s.finished = changed = True
        for ls in list(f.waiting):
            if all(r in f.env for r in ls.need):
                self._start_loop(req, f, ls)
                changed = True
        for node in f.spec.nodes:
            if f.todo[node.name]:
                changed |= self._dispatch(req, f, node)
        for rs in list(f.regions):
            if all(r in f.env for r in rs.reads):
                self._dispatch_region(req, f, rs)
                changed = True
        for run in list(f.runs):
            changed |= self._pump_loop(req, run)
        return changed

    def _dispatch(self, req: RequestState, f: Frame, node: NodeSpec) -> bool:
        """Queue the node's undispatched ops whose inputs exist, as one item."""
        chosen: list[int] = []
        made: set[str] = set()
        internal: dict[str, int] = {}
        for k in f.todo[node.name]:
            spec = node.ops[k]
            if all(r in f.env or r in made for r in spec.reads):
                chosen.append(k)
                made.add(spec.op.name)
        if not chosen:
            return False
        ops = [node.ops[k] for k in chosen]
        f.todo[node.name] = [k for k in f.todo[node.name] if k not in chosen]
        first = ops[0].op
        kind: NodeKind = "component" if first.kind == "component" else "glue"
        call = None
        if kind == "component":
            call = (
                [self._interp.value(a, f.env) for a in first.args],
                {k: self._interp.value(a, f.env) for k, a in first.kwargs.items()},
            )
        env: dict[str, Any] = {}
        produced: set[str] = set()
        for spec in ops:
            for r in spec.reads:
                if r in produced:
                    internal[r] = internal.get(r, 0) + 1
                elif spec.op.kind == "glue":
                    env[r] = f.env[r]
            produced.add(spec.op.name)
        for spec in ops:  # release after materializing: an op may read a value twice
            for r in spec.reads:
                if r not in produced:
                    self._consume(f, r)
        outputs = tuple(  # what complete() keeps: read after this item, or pinned
            s.op.name
            for s in ops
            if f.uses.get(s.op.name, 0) - internal.get(s.op.name, 0) > 0
            or s.op.name in f.spec.pinned
        )
        item = self._work_item(
            req,
            f,
            node.name,
            kind,
            tuple(s.op.name for s in ops),
            call=call,
            env=env,
            outputs=outputs,
        )
        self._issue(item, Pending(req, f, node.name, item.ops, internal, item))
        return True

    def _kill(self, f: Frame) -> int:
        """Release a frame and everything under it; returns how many items it dispatched."""
        f.alive = False
        for item_id in f.inflight:
            p = self._items.pop(item_id, None)
            if p is not None and p.region is not None:
                self._dropped.append(item_id)
        f.inflight.clear()
        n = f.dispatched
        for run in f.runs:
            for sub in run.frames.values():
                n += self._kill(sub)
            run.frames.clear()
        f.runs.clear()
        f.env.clear()
        f.streams.clear()
        return n
