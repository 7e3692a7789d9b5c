"""A rank's engine loop: the worker's main thread, stepping everything delegated to its rank.

Owns the loop and the translation between messages and the pure parts; the parts are separate
objects (``rankscheduler.RankScheduler`` decides, ``runner.NodeRunner`` runs)::

    while not stopping:
        apply(commands())                        # region starts, node batches, cancels, ...
        if a burst's rest is coming: continue    # ``burst.BurstHold``: wait for it, step nothing
        for step in scheduler.schedule():        # every ready item of every run, by node
            scheduler.update(step, runner.run(step.walk, step.node, step.items))
        if lane := scheduler.lane():             # the fast lane, while no command waits
            with runner.lane(lane.walk, lane.node, lane.item) as run:
                while (r := lane.steps(run, stop=a_command_waits)) and lane.commit(r): ...
        send(reports)                            # RegionEvents, BatchDone: what others need

The fast lane: when all the rank runs is one cohort of a simple loop (``loopcohort``) and no
command waits, its steps are made by ``scheduler.lane()`` instead of a whole ``schedule()`` each
(a rollout or a decode of one request, or of requests that joined it, steps with no scheduling
pass per iteration); any command ends the lane until ``schedule()`` has seen it. A client's
stream items that its steps make do not end it: the loop takes them as reports as it steps
(``scheduler.reporting()``), and they leave coalesced as below. Steps whose commits change
nothing but the cohort are made in one loop over local values (``cohortburst``); whether a
command waits is asked between any two, of a rank link's doorbell (``doorbell``), not its
socket.

It blocks for commands only when the last step ran nothing, so region runs advance back to back
with no process crossing per iteration: a decode loop of 96 tokens is 96 steps here, one
``StartRegions`` and a ``RegionEvents`` every ``coalesce_s`` (2 ms) at most on the socket: its
streamed tokens of consecutive steps, batched across requests, leave together; outputs, exits,
failures and credit leave at once, and everything pending before the loop waits. Commands come
from the loop's ``Inbox`` (a worker's command socket, read on this same thread: the handlers
turn payloads into values and ``put`` them) and from ``put`` on any thread.

What a report carries: a value as the worker's transport encodes it (tensors inline or in this
worker's shared-memory pool, objects such as a KV cache kept in the per-request object store
and named by an ``ObjectRef``). A value that cannot be encoded fails its item, never the loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime import messages as m
from walkserve.runtime.burst import BURST_HOLD_S, BurstHold
from walkserve.runtime.rankcommands import (
    CancelRequest,
    Command,
    CreditItems,
    DropItems,
    FeedItems,
    Inbox,
    NodeBatch,
    StartRun,
    Starts,
)
from walkserve.runtime.rankreports import (
    Lane,
    NodeBatchDone,
    RegionConsumed,
    RegionDone,
    RegionFailed,
    RegionOutput,
    RegionStreamed,
    Report,
    Step,
)
from walkserve.runtime.rankscheduler import RankScheduler
from walkserve.runtime.runner import ItemResult, NodeRunner, RunItem
from walkserve.runtime.transport import ObjectStore, Token, Transport, shm_handles

log = logging.getLogger("walkserve.engine")

TINY = 256  # bytes: a tensor this small (a token, a stop flag) always travels with its report

__all__ = ["EngineLoop"]


_STOP = None


class EngineLoop:
    """One rank's loop (see the module docstring). ``send`` puts a message on the report
    socket (thread-safe); ``transport`` encodes report values; ``objects``: the per-request
    store behind it (dropped on cancel)."""

    def __init__(
        self,
        rank: int,
        plan: ExecutablePlan,
        runner: NodeRunner,
        scheduler: RankScheduler,
        transport: Transport,
        objects: ObjectStore,
        send: Callable[[m.Message], None],
        *,
        hold: bool = False,
        here: frozenset[int] | None = None,
        coalesce_s: float = 0.002,
        burst_hold_s: float = BURST_HOLD_S,
        counters: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.rank = rank
        self.counters = counters  # the components' counters, for StatsAsk
        self.runner = runner
        self.scheduler = scheduler
        self.transport = transport
        self.objects = objects
        self.send = send
        self._nodes = {(w, n.name): n for w in plan.walks for n in plan.nodes(w)}
        # What stays here: with ``hold`` (other ranks can pull from this one), every tensor of
        # more than TINY bytes that neither a client nor the conductor needs the bytes of.
        self.hold = hold
        self._conductor_values = {w: frozenset(v) for w, v in plan.conductor_values.items()}
        # A held tensor is also exported (``ObjectStore.hold``) only when a rank that may read
        # it (``ExecutablePlan.readers``) is not ``here``, the ranks whose values this one
        # reads in place or through shared memory (None: export everything held).
        self._here = here
        self._readers = {
            w: {v: frozenset(ranks) for v, ranks in values.items()}
            for w, values in plan.readers.items()
        }
        self._walk_of = scheduler.regions.walk_of
        self._commands: queue.SimpleQueue[Command | list[Command] | Starts | None] = (
            queue.SimpleQueue()
        )
        self._requests: dict[int, str] = {}  # region item -> request (for encoding)
        self._region_walk: dict[int, str] = {}
        self._batches: dict[int, NodeBatch] = {}
        self.node_batch_sizes: dict[int, int] = {}
        # Streamed items (a token, an audio chunk) of consecutive steps leave together, at
        # most ``coalesce_s`` late: one message per burst instead of one per step.
        self.coalesce_s = coalesce_s
        self._unsent: list[m.RegionEvent] = []
        self._first_unsent = 0.0
        self._inbox: Inbox | None = None  # run()'s
        self._hold = BurstHold(burst_hold_s)  # a burst's first chunks wait for the rest

    def put(self, command: Command) -> None:
        """Queue a command: from any thread when the loop runs without an inbox; with one, from
        the loop's own thread (the inbox's handlers), since only the inbox wakes a waiting
        loop (``stop`` is seen at the next wake, or within the inbox's longest wait)."""
        self._commands.put(command)

    def put_all(self, commands: list[Command]) -> None:
        """Queue commands that the loop takes together, in one pass (a message's cancels)."""
        if commands:
            self._commands.put(commands)

    def put_starts(self, runs: list[StartRun], more: bool = False) -> None:
        """Queue region starts that the loop takes together, in one pass: the starts of one
        message, so that runs that arrived together start at the same iteration and form one
        cohort (put one by one, the first could be stepped alone before the rest are read).
        ``more``: the conductor pass that sent them sends this rank more (``burst``): the loop
        holds its steps for them where it has nothing else to run."""
        self._commands.put(Starts(runs, more))

    def stop(self) -> None:
        self._commands.put(_STOP)

    def run(self, stopping: threading.Event, inbox: Inbox | None = None) -> None:
        """The loop, until ``stop()`` or ``stopping`` is set. ``inbox``: where commands come
        from besides ``put`` (a worker's command socket, read on this thread: ``read`` when
        the loop would wait and before each pass, ``waiting`` between fast-lane steps);
        without one, the loop waits on ``put`` alone."""
        self._inbox = inbox
        wait, hold = True, 0.0
        while not stopping.is_set():
            taken: list[Command | list[Command] | Starts | None] = []
            if inbox is not None:
                inbox.read(wait and self._commands.empty(), hold or None)
            elif wait:
                with contextlib.suppress(queue.Empty):  # a hold's deadline
                    taken.append(self._commands.get(timeout=hold or None))
            while True:
                try:
                    taken.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            commands: list[Command | None] = []
            for c in taken:
                if isinstance(c, Starts):
                    self._hold.starts(c.more, idle=self.scheduler.idle() and not commands)
                    commands += c.runs
                elif isinstance(c, list):
                    commands += c
                else:
                    commands.append(c)
            if _STOP in commands:
                return
            for command in commands:
                assert command is not None
                self._apply(command)
            hold = self._hold.left()
            if hold:  # the rest of a burst is on its way: step nothing before it comes
                self._report(self.scheduler.reports())
                self._flush()
                wait = True
                continue
            steps = self.scheduler.schedule()
            self._steps(steps, stopping)
            self._report(self.scheduler.reports())
            wait = not steps
            if wait or self._due():
                self._flush()

    # ------------------------------------------------------------------ commands

    def _apply(self, command: Command) -> None:
        if isinstance(command, StartRun):
            self._requests[command.item] = command.request
            self._region_walk[command.item] = command.walk
            self.scheduler.start(
                command.item,
                command.request,
                command.walk,
                command.region,
                command.inputs,
                command.stream,
            )
        elif isinstance(command, NodeBatch):
            self._batches[command.batch] = command
            node = self._nodes.get((command.walk, command.node))
            ops = tuple(command.ops) if command.ops is not None else tuple(node.ops if node else ())
            if command.outputs is not None:
                outputs = tuple(command.outputs)
            else:  # the whole node: what it makes for others; part of it: all it makes
                outputs = tuple(node.outputs if node else ()) if command.ops is None else ops
            items = [RunItem(item, ops, env, outputs) for item, _, env in command.items]
            self.node_batch_sizes[len(items)] = self.node_batch_sizes.get(len(items), 0) + 1
            self.scheduler.add_batch(command.batch, command.walk, command.node, items)
        elif isinstance(command, CancelRequest):
            self.scheduler.cancel(command.request)
            self.objects.drop(command.request)
        elif isinstance(command, DropItems):
            self.scheduler.drop(command.items)
        elif isinstance(command, FeedItems):
            self.scheduler.feed(command.item, command.stream, command.pieces, command.finished)
        elif isinstance(command, CreditItems):
            self.scheduler.credit(command.item, command.channel, command.items)
        else:
            stats = self.scheduler.stats()
            sizes = dict(stats.batch_sizes)
            for k, v in self.node_batch_sizes.items():
                sizes[k] = sizes.get(k, 0) + v
            self.send(
                m.RankStatsReply(
                    command.seq,
                    self.rank,
                    stats.runs,
                    stats.live_values,
                    len(self.objects),
                    stats.speculated_steps,
                    stats.wasted_steps,
                    sizes,
                    self.scheduler.loops.counters()
                    | self.objects.counters()
                    | {"burst/holds": self._hold.holds}
                    | (self.counters() if self.counters is not None else {}),
                )
            )

    def _steps(self, steps: list[Step], stopping: threading.Event) -> None:
        """Run ``steps``, then the fast lane. (A method, so that no step outlives it: a
        finished step must not keep its values, such as a KV cache whose pages its release
        frees.)"""
        if len(steps) == 1 and (lane := self.scheduler.lane_of(steps[0])) is not None:
            self._lane(stopping, lane)  # a loop just started, alone: its first step too
            return
        for step in steps:
            self._step(step)
        if steps:
            self._lane(stopping)

    def _lane(self, stopping: threading.Event, lane: Lane | None = None) -> None:
        """The fast lane: a lone cohort steps back to back while no command waits, each step
        one runner call and one commit (``RankScheduler.lane``); ``lane``: one that took over
        the pass's step (``RankScheduler.lane_of``), whose first step is made whatever
        waits."""
        commands, inbox = self._commands, self._inbox
        if lane is None:
            lane = self.scheduler.lane()
            if lane is None or not commands.empty() or stopping.is_set():
                return
            if inbox is not None and inbox.waiting():
                return
        steps, commit, end = lane.steps, lane.commit, lane.end
        reporting, reports = self.scheduler.reporting, self.scheduler.reports

        def stop() -> bool:  # asked between the lane's steps
            if self._unsent and self._due():
                self._flush()
            if not commands.empty() or stopping.is_set():
                return True
            return inbox is not None and inbox.waiting()  # a rank link's: its doorbell

        with self.runner.lane(lane.walk, lane.node, lane.item) as run:
            try:
                while True:
                    try:
                        result = steps(run, stop)  # quick steps, then one to commit
                        if result is None:  # stop() said so after a quick step
                            return
                        more = commit(result)
                    except Exception as e:  # a bug of ours: its requests fail, the rank goes on
                        log.exception(
                            "rank %d: lane step of %s:%s", self.rank, lane.walk, lane.node
                        )
                        end()
                        error = f"rank {self.rank}: {type(e).__name__}: {e}"
                        self.scheduler.fail_step(lane.step(), error)
                        return
                    if reporting():  # a client's stream items: coalesced, sent when due
                        self._report(reports())
                    if not more or stop():
                        return
            finally:
                end()  # what its quick commits left to report, before anything else

    def _step(self, step: Step) -> None:
        results = self._run(step.walk, step.node, step.items)
        try:
            self.scheduler.update(step, results)
        except Exception as e:  # a bug of ours: its requests fail, the rank goes on
            log.exception("rank %d: results of %s:%s", self.rank, step.walk, step.node)
            self.scheduler.fail_step(step, f"rank {self.rank}: {type(e).__name__}: {e}")

    def _run(self, walk: str, node: str, items: Sequence[Any]) -> list[ItemResult]:
        try:
            return self.runner.run(walk, node, items)
        except KeyError as e:
            error = str(e.args[0]) if e.args else str(e)
            return [ItemResult(it.id, error=error) for it in items]
        except Exception as e:  # a bug of ours, not the model's: only this step's items
            log.exception("rank %d: step of %s:%s", self.rank, walk, node)
            return [ItemResult(it.id, error=f"{type(e).__name__}: {e}") for it in items]

    # ------------------------------------------------------------------ reports

    def _report(self, reports: list[Report]) -> None:
        events: list[m.RegionEvent] = []
        for rep in reports:
            if isinstance(rep, NodeBatchDone):
                self.send(self._batch_done(rep))
            elif isinstance(rep, RegionStreamed):  # a client's stream, or a forwarded one
                request = self._requests[rep.item]
                walk = self._region_walk[rep.item]
                value = self._encode({rep.channel: rep.value}, request, walk)
                if isinstance(value, str):
                    events.append(m.RegionFailed(rep.item, value))
                else:
                    events.append(
                        m.RegionStreamed(rep.item, rep.channel, rep.index, value[rep.channel])
                    )
            elif isinstance(rep, RegionConsumed):
                events.append(
                    m.RegionConsumed(rep.item, rep.stream, rep.base, rep.received, rep.closed)
                )
            elif isinstance(rep, (RegionOutput, RegionDone)):
                request = self._requests[rep.item]
                outputs = self._encode(rep.outputs, request, self._region_walk[rep.item])
                if isinstance(rep, RegionDone):
                    del self._requests[rep.item]
                    del self._region_walk[rep.item]
                if isinstance(outputs, str):
                    events.append(m.RegionFailed(rep.item, outputs))
                elif isinstance(rep, RegionDone):
                    events.append(m.RegionDone(rep.item, outputs))
                else:
                    events.append(m.RegionOutput(rep.item, outputs))
            else:
                assert isinstance(rep, RegionFailed)
                self._requests.pop(rep.item, None)
                self._region_walk.pop(rep.item, None)
                events.append(m.RegionFailed(rep.item, f"rank {self.rank}: {rep.error}"))
        if not events:
            return
        if not self._unsent:
            self._first_unsent = time.monotonic()
        self._unsent += events
        if any(not isinstance(e, m.RegionStreamed) for e in events):
            self._flush()  # outputs, exits, failures and credit unblock others: at once

    def _due(self) -> bool:
        return bool(self._unsent) and time.monotonic() - self._first_unsent >= self.coalesce_s

    def _flush(self) -> None:
        """Send the region events not sent yet, as one message."""
        if self._unsent:
            events, self._unsent = self._unsent, []
            self.send(m.RegionEvents(self.rank, events))

    def _batch_done(self, rep: NodeBatchDone) -> m.BatchDone | m.BatchFailed:
        job = self._batches.pop(rep.batch)
        where = f"{job.walk}:{job.node} on rank {self.rank}"
        requests = {item: request for item, request, _ in job.items}
        outputs: list[m.ItemOutput] = []
        deferred: list[int] = []
        errors: list[m.ItemError] = []
        for r in rep.results:
            if r.deferred:
                deferred.append(r.item)
            elif r.error is not None:
                errors.append(m.ItemError(r.item, f"{where}: {r.error}"))
            else:
                assert r.values is not None
                encoded = self._encode(r.values, requests[r.item], job.walk)
                if isinstance(encoded, str):
                    errors.append(m.ItemError(r.item, f"{where}: {encoded}"))
                else:
                    outputs.append(m.ItemOutput(r.item, encoded))
        if errors and not outputs and not deferred:
            return m.BatchFailed(rep.batch, self.rank, errors)
        return m.BatchDone(rep.batch, self.rank, outputs, deferred, errors)

    def _encode(
        self, values: Mapping[str, Any], request: str, walk: str | None
    ) -> dict[str, m.Value] | str:
        """``values`` (of ``walk``; None: a client's) on the wire, or the error that says why
        they cannot go (nothing of them stays held then)."""
        written: list[Token] = []
        out: dict[str, m.Value] = {}
        needed = self._conductor_values.get(walk, frozenset()) if walk is not None else None
        try:
            for name, value in values.items():
                if needed is not None and self._holds(name, value, needed):
                    ref = self.objects.hold(request, value, self._read_elsewhere(walk, name))
                    if ref is not None:  # else no room where other hosts read: the bytes go
                        out[name] = ref
                        continue
                out[name] = payload = self.transport.send(value, request)
                written += shm_handles(payload)
        except Exception as e:
            self.transport.release(written)
            return f"outputs could not be sent: {type(e).__name__}: {e}"
        return out

    def _read_elsewhere(self, walk: str | None, name: str) -> bool:
        """Whether a rank that is not ``here`` may read value ``name`` of ``walk``."""
        if self._here is None or walk is None:
            return True
        ranks = self._readers.get(walk, {}).get(name)
        return ranks is None or not ranks <= self._here

    def _holds(self, name: str, value: Any, needed: frozenset[str]) -> bool:
        return (
            self.hold
            and name not in needed
            and isinstance(value, torch.Tensor)
            and value.numel() * value.element_size() > TINY
        )
