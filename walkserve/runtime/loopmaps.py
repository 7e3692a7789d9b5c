"""A map's iterations as items: a loop with no carried value and no stop whose body is one
component call (a window decoder over a stream's windows) starts every iteration that may
start in one pass, each as a call of that component, and sends them as items of at most
``_map_calls`` calls (``Conductor(maps=)``); their values come back together, one mapping per
iteration, and are kept until their commit in order. A ``MapItems`` is the ``LoopDriver``
(``runtime.loopdriver``) that starts, settles and commits the loop; ``RegionItems`` extends
it."""

from __future__ import annotations

from typing import Any

from walkserve.runtime.frames import LoopRun, Pending, RequestState
from walkserve.runtime.loopdriver import LoopDriver

__all__ = ["MapItems"]

Call = tuple[list[Any], dict[str, Any]]


class MapItems(LoopDriver):
    """``LoopDriver`` with its maps' items (see the module docstring)."""

    _map_calls: int  # most calls in one map item (set by Conductor.__init__)

    # ------------------------------------------------------------------ maps

    def _pump_map(self, req: RequestState, run: LoopRun) -> bool:
        """Start every window of map ``run`` that may start, as items of at most
        ``_map_calls`` calls; release what their chunks no longer need, and grant the
        producers the credit that frees, once after the last. Whether anything changed."""
        items: list[list[Call]] = [[]]
        chunked: set[str] = set()
        while self._can_start(req, run):  # every window that is ready: one item
            if len(items[-1]) == self._map_calls:  # each at most a step's calls
                items.append([])
            items[-1].append(self._map_call(run, chunked))
        changed = False
        if items[0]:
            self._release_chunks(run.parent, chunked, run.started)  # once for all of them
            first = run.started - sum(map(len, items))
            for calls in items:
                self._issue_map(req, run, first, calls)
                first += len(calls)
            changed = True
        return self._settle(req, run) or changed

    def _map_call(self, run: LoopRun, chunked: set[str]) -> Call:
        """Start the next iteration of a map as a call of its node's component (its item is
        ``_issue_map``'s): its arguments, from its parameters' values; the streams it cut a
        chunk of join ``chunked`` (``_pump_map`` releases them)."""
        values, cut = self._iteration_values(run)
        chunked.update(cut)
        run.started += 1
        run.flying += 1
        assert run.spec.map_node is not None
        op = run.spec.map_node.ops[0].op
        value = self._interp.value
        return [value(a, values) for a in op.args], {
            k: value(a, values) for k, a in op.kwargs.items()
        }

    def _issue_map(self, req: RequestState, run: LoopRun, first: int, calls: list[Call]) -> None:
        """Map iterations just started, ``first`` on (their ``calls``, in order), as one item
        of its node; their values come back together (``_bind_map``)."""
        node = run.spec.map_node
        assert node is not None
        parent = run.parent
        ops = tuple(s.op.name for s in node.ops)
        item = self._work_item(
            req,
            parent,
            node.name,
            "component",
            ops,
            path=(*parent.path, first),
            outputs=tuple(dict.fromkeys(run.spec.node.outputs)),
            calls=tuple(calls),
        )
        self._issue(item, Pending(req, parent, node.name, ops, {}, item, window=(run, first)))

    def _bind_map(self, p: Pending, value: Any) -> RequestState | None:
        """A map item's values (one mapping per iteration, in order) kept for their commit;
        its request, to advance (None: failed)."""
        assert p.window is not None
        run, first = p.window
        n = len(p.item.calls or ())
        outputs = run.spec.node.outputs
        if not isinstance(value, list) or len(value) != n:
            got = len(value) if isinstance(value, list) else type(value).__name__
            self._node_failed(p, f"a map item of {n} iterations got results for {got}")
            return None
        for k, values in enumerate(value):
            missing = [o for o in outputs if o not in values]
            if missing:
                self._node_failed(p, f"result has no value for ops {missing}")
                return None
            run.results[first + k] = [values[o] for o in outputs]
        run.flying -= n
        return p.request
