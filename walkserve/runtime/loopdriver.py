"""The conductor's loops: a loop of a frame started (its carried and fixed values, or one
``kind="loop"`` item for a rank's fast path), its iterations started as their carried values
exist (speculatively while the previous stop is unknown), settled as stops arrive, committed
in order (accumulations, streams fed, ``StreamItem`` events), and finished (its channels bound
in the parent frame). ``Conductor`` (``runtime.conductor``) is a ``LoopDriver``: the frames
it drives these through are ``FrameDriver``'s (``runtime.framedriver``), the requests its own
(the hooks below)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from walkserve.capture import ir
from walkserve.capture.chunk import ChunkSpan
from walkserve.capture.interpret import Interpreter
from walkserve.capture.loopsem import (
    LoopError,
    int_input,
    loop_bound,
    loop_channels,
    step_value,
    truth,
)
from walkserve.runtime.frames import (
    Frame,
    LoopRun,
    Pending,
    RequestFailed,
    RequestState,
    Stream,
    first_error,
    piece_items,
)
from walkserve.runtime.walkspec import (
    BlockSpec,
    LoopSpec,
)
from walkserve.runtime.workitem import (
    UNLIMITED,
    Credit,
    Event,
    LoopStart,
    NodeKind,
    StreamItem,
    WorkItem,
)

__all__ = ["LoopDriver"]


class LoopDriver:
    """The loop half of ``Conductor``'s state machine (see the module docstring)."""

    # the conductor's state these methods step (set by Conductor.__init__)
    speculate: bool
    stream_buffer_limit: int
    _interp: Interpreter
    _items: dict[int, Pending]
    _queue: list[WorkItem]
    _events: list[Event]
    _ids: Iterator[int]
    _next_id: int
    _speculated: int
    _wasted: int
    _credits: list[Credit]
    _credit: dict[str, dict[str, int]]
    _produced: dict[str, dict[str, int]]
    _maps: frozenset[tuple[str, str]]  # (walk, node): a map's iterations go out as one item

    # FrameDriver's hooks (runtime.framedriver)
    def _new_frame(
        self, spec: BlockSpec, path: tuple[int, ...], parent: Frame | None, values: dict[str, Any]
    ) -> Frame:
        raise NotImplementedError

    def _pump(self, req: RequestState, f: Frame) -> bool:
        raise NotImplementedError

    def _kill(self, f: Frame) -> int:
        raise NotImplementedError

    # MapItems' (runtime.loopmaps): a map's windows started as items
    def _pump_map(self, req: RequestState, run: LoopRun) -> bool:
        raise NotImplementedError

    # the conductor's hooks
    def _send_ready_outputs(self, req: RequestState) -> None:
        raise NotImplementedError

    def _node_failed(self, p: Pending, error: str) -> None:
        raise NotImplementedError

    def _work_item(
        self,
        req: RequestState,
        f: Frame,
        node: str,
        kind: NodeKind,
        ops: tuple[str, ...] = (),
        path: tuple[int, ...] | None = None,
        **fields: Any,
    ) -> WorkItem:
        """A new item of ``req`` in frame ``f`` (at ``path`` when not the frame's own: a map
        item's first iteration), speculative where ``f`` is; ``fields``: the rest of it."""
        return WorkItem(
            id=next(self._ids),
            request=req.id,
            walk=req.walk,
            node=node,
            kind=kind,
            ops=ops,
            frame=f.path if path is None else path,
            speculative=f.in_speculation(),
            **fields,
        )

    def _issue(self, item: WorkItem, pending: Pending) -> None:
        """Queue ``item`` for ``ready()``, with what the conductor keeps of it (``pending``:
        its request, frame and spec); its frame counts it in flight."""
        self._next_id = item.id + 1
        self._items[item.id] = pending
        pending.frame.inflight.add(item.id)
        pending.frame.dispatched += 1
        self._queue.append(item)

    @staticmethod
    def _bind(f: Frame, name: str, value: Any) -> None:
        if f.uses.get(name, 0) > 0 or name in f.spec.pinned:
            f.env[name] = value

    @staticmethod
    def _consume(f: Frame, name: str) -> None:
        left = f.uses.get(name, 0) - 1
        f.uses[name] = left
        if left <= 0 and name not in f.spec.pinned:
            f.env.pop(name, None)

    def _start_loop(self, req: RequestState, f: Frame, ls: LoopSpec) -> None:
        if ls.fast:
            self._dispatch_loop(req, f, ls)
            return
        node = ls.node
        carried = {
            p.name: self._interp.value(p.role.init, f.env)
            for p in node.params
            if isinstance(p.role, ir.Carried)
        }
        fixed = {
            p.name: self._interp.value(p.role.value, f.env)
            for p in node.params
            if isinstance(p.role, ir.Invariant)
        }
        bound: int | None = None
        cap: int | None = None
        if not isinstance(node.trips, ir.StreamTrips):
            bound = loop_bound(node, req.walk_inputs, None)
        elif isinstance(node.max_iters, int):
            cap = node.max_iters
        elif node.max_iters is not None:
            cap = int_input(req.walk_inputs, node.max_iters)
        run = LoopRun(ls, f, carried, fixed, bound, cap)
        run.collected = {ch: [] for ch in ls.visible.accumulated}
        f.waiting.remove(ls)
        f.runs.append(run)
        for r in ls.need:
            if r not in ls.step_reads:
                self._consume(f, r)

    def _dispatch_loop(self, req: RequestState, f: Frame, ls: LoopSpec) -> None:
        """Hand simple loop ``ls`` to the runner: one item, its start values in ``loop``."""
        node = ls.node
        value = self._interp.value
        carried, fixed, sources = {}, {}, {}
        for p in node.params:
            role = p.role
            if isinstance(role, ir.Carried):
                carried[p.name] = value(role.init, f.env)
            elif isinstance(role, ir.Invariant):
                fixed[p.name] = value(role.value, f.env)
            elif isinstance(role.source, ir.SelectStep):
                sources[p.name] = value(role.source.source, f.env)
            elif isinstance(role.source, ir.TableStep):
                sources[p.name] = [value(v, f.env) for v in role.source.values]
        channels, spec = ls.fast_item
        start = LoopStart(
            node.name,
            loop_bound(node, req.walk_inputs, None),
            carried,
            fixed,
            sources,
            channels,
            tuple(
                dict.fromkeys(
                    [
                        *(ch for ch, outs in ls.emit.items() if any(map(req.streams, outs))),
                        *(ch for _, ch in ls.feeds),
                    ]
                )
            ),
        )
        f.waiting.remove(ls)
        for r in ls.need:
            self._consume(f, r)
        item = self._work_item(req, f, node.name, "loop", outputs=channels, loop=start)
        self._issue(item, Pending(req, f, node.name, channels, {}, item, spec))
        self._feeding(req, f, item.id, ls.feeds)

    def _feeding(
        self, req: RequestState, f: Frame, item: int, feeds: Sequence[tuple[str, str]]
    ) -> None:
        """Item ``item`` (a fast loop, a region) produces ``feeds`` (stream, channel) of frame
        ``f``: it gets the streams' credit, now and as their consumers take items."""
        for stream, ch in feeds:
            s = f.streams[stream]
            s.producer_item = item
            self._credits.append(Credit(item, req.id, ch, self._credit_of(s)))

    def _credit_of(self, s: Stream) -> int:
        """What the producer item of ``s`` may commit: a buffer's worth beyond what its
        consumer released, or everything when the consumer is done or cannot start before the
        producer ends (no backpressure: waiting for it would wait forever)."""
        if s.closed or not s.spec.backpressure:
            return UNLIMITED
        return s.base + self.stream_buffer_limit

    def _grant(self, f: Frame, s: Stream) -> None:
        """Credit for a stream's producer its runner steps (a fast loop item, a region)."""
        item = s.producer_item
        if item is None or item not in self._items:
            return
        ch = s.spec.edge.source
        self._credits.append(Credit(item, self._items[item].request.id, ch, self._credit_of(s)))

    def _pump_loop(self, req: RequestState, run: LoopRun) -> bool:
        changed = self._settle(req, run)
        if run not in run.parent.runs:
            return changed
        ls = run.spec
        if ls.map_node is not None and (req.walk, ls.map_node.name) in self._maps:
            return self._pump_map(req, run) or changed
        while self._can_start(req, run):  # every iteration that may start: a map's windows
            frame = self._start_iteration(run)
            if ls.flat and self._pump(req, frame) and not any(frame.todo.values()):
                frame.quiet = True  # its one node dispatched: nothing to pump until it ends
            changed = True
        for sub in list(run.frames.values()):
            if sub.alive and not sub.quiet:
                changed |= self._pump(req, sub)
        return self._settle(req, run) or changed

    def _can_start(self, req: RequestState, run: LoopRun) -> bool:
        ls, i = run.spec, run.started
        live = len(run.frames) + run.flying  # started, not committed
        if run.stop_at is not None or live >= ls.ahead:
            return False
        if (run.bound is not None and i >= run.bound) or (run.cap is not None and i >= run.cap):
            return False
        trips = ls.node.trips
        if isinstance(trips, ir.StreamTrips) and run.parent.streams[trips.stream].ready() <= i:
            return False
        if ls.node.stop is not None:
            ahead = 1 if (self.speculate and ls.speculative) else 0
            if i > run.known + ahead:
                return False
        prev = run.frames.get(i - 1)
        if prev is not None:
            outs = ls.node.outputs
            needed = [outs[p.role.output] for p in ls.node.params if isinstance(p.role, ir.Carried)]
            if not all(o in prev.env for o in needed):
                return False
        for stream, _ in ls.feeds:  # iterations in flight count as one item each
            s = run.parent.streams[stream]
            full = s.buffered + live >= self.stream_buffer_limit
            if s.spec.backpressure and not s.closed and full:
                return False
        credit = self._credit.get(req.id)
        if credit and ls.emit:
            produced = self._produced.get(req.id, {})
            for ch in ls.emit:
                if ch in credit and produced.get(ch, 0) + live >= credit[ch]:
                    return False
        return True

    def _start_iteration(self, run: LoopRun) -> Frame:
        ls, i, parent = run.spec, run.started, run.parent
        node = ls.node
        values, chunked = self._iteration_values(run)
        self._release_chunks(parent, chunked, i + 1)
        speculative = node.stop is not None and i > run.known
        if speculative:
            self._speculated += 1
        frame = self._new_frame(ls.body, (*parent.path, i), parent, values)
        frame.speculative = speculative
        run.frames[i] = frame
        run.started += 1
        return frame

    def _iteration_values(self, run: LoopRun) -> tuple[dict[str, Any], list[str]]:
        """The values of the next iteration's parameters, and the streams it cut a chunk of
        (for ``_release_chunks`` once the iterations that cut them are started)."""
        ls, i, parent = run.spec, run.started, run.parent
        node = ls.node
        prev = run.frames.get(i - 1)
        values: dict[str, Any] = {}
        chunks: dict[str, tuple[torch.Tensor, ChunkSpan]] = {}
        for p in node.params:
            role = p.role
            if isinstance(role, ir.Carried):
                values[p.name] = (
                    prev.env[node.outputs[role.output]] if prev is not None else run.carried[p.name]
                )
            elif isinstance(role, ir.Invariant):
                values[p.name] = run.fixed[p.name]
            elif isinstance(role.source, ir.ChunkStep):
                src = role.source
                if src.stream not in chunks:
                    chunks[src.stream] = parent.streams[src.stream].chunk(i)
                data, span = chunks[src.stream]
                values[p.name] = data if src.part == "data" else span.context
            else:
                values[p.name] = step_value(
                    role, i, lambda a: self._interp.value(a, parent.env), None
                )
        return values, list(chunks)

    def _release_chunks(self, f: Frame, streams: Iterable[str], before: int) -> None:
        """Release the items of ``streams`` (of frame ``f``) that no chunk from iteration
        ``before`` on reads, and grant their producers the credit that frees."""
        for stream in streams:
            s = f.streams[stream]
            s.release(s.spec.policy.retain_from(before))
            self._grant(f, s)

    def _settle(self, req: RequestState, run: LoopRun) -> bool:
        """Evaluate stops in order, commit complete iterations in order, finish the loop."""
        changed = False
        node = run.spec.node
        while node.stop is not None and run.stop_at is None:
            k = run.known
            f = run.frames.get(k)
            if f is None or node.stop not in f.env:
                break
            changed = True
            if truth(f.env[node.stop], node):
                run.stop_at = k + 1
                for j in [j for j in run.frames if j > k]:
                    if self._kill(run.frames.pop(j)):
                        self._wasted += 1
                run.started = k + 1
            else:
                run.known = k + 1
                nxt = run.frames.get(k + 1)
                if nxt is not None:
                    nxt.speculative = False
                    if not nxt.in_speculation():
                        error = first_error(nxt)
                        if error is not None:
                            raise RequestFailed(error)
        while True:
            outs = run.results.pop(run.committed, None)  # a map item's iteration
            if outs is not None:
                self._commit(req, run, outs)
                changed = True
                continue
            f = run.frames.get(run.committed)
            if f is None or not f.done():
                break
            outs = [f.env[o] for o in node.outputs]
            del run.frames[run.committed]
            self._kill(f)
            self._commit(req, run, outs)
            changed = True
        if run.bound is None and isinstance(node.trips, ir.StreamTrips):
            s = run.parent.streams[node.trips.stream]
            if s.finished:
                run.bound = loop_bound(node, req.walk_inputs, s.ready())
        end = run.stop_at if run.stop_at is not None else run.bound
        if end is not None and run.committed >= end:
            self._finish_loop(run)
            changed = True
        return changed

    def _commit(self, req: RequestState, run: LoopRun, outs: list[Any]) -> None:
        """Commit iteration ``run.committed``, whose body outputs are ``outs``."""
        ls, i = run.spec, run.committed
        node = ls.node
        credit = self._credit.get(req.id)
        for ch, acc in node.accumulated.items():
            piece = outs[acc.output]
            if ch in run.collected:
                run.collected[ch].append(piece)
            if credit and ch in credit:
                produced = self._produced.setdefault(req.id, {})
                produced[ch] = produced.get(ch, 0) + piece_items(piece, acc)
            for out in ls.emit.get(ch, ()):
                if req.streams(out):
                    self._send_ready_outputs(req)
                    self._events.append(StreamItem(req.id, out, i, piece))
        for stream, ch in ls.feeds:
            run.parent.streams[stream].append(outs[node.accumulated[ch].output])
        run.last = outs
        run.carried = {
            p.name: outs[p.role.output] for p in node.params if isinstance(p.role, ir.Carried)
        }
        run.committed += 1

    def _finish_loop(self, run: LoopRun) -> None:
        node, parent = run.spec.node, run.parent
        if run.committed == 0 and node.accumulated:  # as the interpreter, kept or not
            ch = next(iter(node.accumulated))
            raise LoopError(f"loop {node.name} ran no iteration, so {ch} is empty")
        channels = loop_channels(run.spec.visible, run.carried, run.last, run.collected)
        for ch, value in channels.items():
            self._bind(parent, ch, value)
        for stream, _ in run.spec.feeds:
            parent.streams[stream].finished = True
        for r in run.spec.step_reads:
            self._consume(parent, r)
        if isinstance(node.trips, ir.StreamTrips):
            s = parent.streams[node.trips.stream]
            s.closed = True
            s.release(s.n)
            self._grant(parent, s)
            if s.spec.producer is None:
                self._consume(parent, s.spec.edge.source)
        parent.runs.remove(run)
