"""Region traffic: the worker pool's side of region runs, streams between regions and the
lifetime of values that stay on their rank.

Owns, per rank, the region items in flight (and their input slots), the stats queries waiting
for answers and the releases of held values (``ObjectRef``) the server process dropped. What
crosses its boundary: ``StartRegions``, ``FeedStream``, ``GrantCredit``, ``DropRuns``,
``StatsQuery`` and ``Release`` out, ``RegionEvents`` and ``RankStatsReply`` in (typed messages,
values through the pool's transports). Region events reach ``on_regions(rank, events)`` on the
pool's io thread, their values already copied out; a rank that dies fails its runs there too.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from walkserve.runtime.messages import (
    Ack,
    DropRuns,
    FeedStream,
    GrantCredit,
    RankStatsReply,
    RegionDone,
    RegionEvent,
    RegionEvents,
    RegionFailed,
    RegionOutput,
    RegionStart,
    RegionStreamed,
    Release,
    StartRegions,
    StatsQuery,
    Value,
    encode,
)
from walkserve.runtime.poolstate import GONE, RankState, describe_exit, unreachable
from walkserve.runtime.transport import Token, shm_handles
from walkserve.runtime.wirevalues import ObjectRef

if TYPE_CHECKING:
    from walkserve.runtime.pool import WorkerPool


class RegionTraffic:
    """See the module docstring; ``pool.regions``."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.on_regions: Callable[[int, list[RegionEvent]], None] = lambda rank, events: None
        self._regions: dict[int, dict[int, str]] = {}  # rank -> region item -> request
        self._region_handles: dict[Token, int] = {}  # input slots of region starts -> rank
        self._stats_replies: dict[int, tuple[threading.Event, dict[int, RankStatsReply]]] = {}
        self._releases: collections.deque[tuple[int, str, str]] = collections.deque()
        self._stats_seq = itertools.count()
        self._bursts: set[int] = set()  # ranks told that more starts follow (``start``)

    def running(self, rank: int) -> bool:
        """Whether ``rank`` runs a region item now (the caller holds the pool's lock)."""
        return bool(self._regions.get(rank))

    def owns(self, handle: Token) -> bool:
        """Whether ``handle`` is an input slot of a region start or feed (then released)."""
        with self.pool._lock:
            return self._region_handles.pop(handle, None) is not None

    def start(
        self,
        rank: int,
        starts: Iterable[tuple[int, str, str, str, Mapping[str, Any], bool]],
        burst: bool = False,
    ) -> None:
        """Start region runs on ``rank``: (item id, request id, walk, region, inputs by
        name). What they do arrives at ``on_regions(rank, events)`` (on the io thread),
        their exits included; a rank that dies fails its runs there too. ``burst``: more
        starts for ``rank`` may follow from this conductor pass (``runtime.burst``), which
        ends with ``end_bursts``."""
        self.flush()
        state = self.pool._rank(rank)
        transport = self.pool._transport_for(rank)
        wire: list[RegionStart] = []
        handles: list[Token] = []
        try:
            for item, request_id, walk, region, inputs, stream in starts:
                values: dict[str, Value] = {}
                for name, value in inputs.items():
                    values[name] = payload = transport.send(value, request_id)
                    handles += shm_handles(payload)
                wire.append(RegionStart(item, request_id, walk, region, values, stream))
            data = encode(StartRegions(wire, more=burst))
        except BaseException:
            transport.release(handles)
            raise
        with self.pool._lock:
            dead = self.pool._closed or state.status in GONE
            if not dead:
                self._regions.setdefault(rank, {}).update({s.item: s.request_id for s in wire})
                for h in handles:
                    self._region_handles[h] = rank
        if dead:
            transport.release(handles)
            error = f"worker rank {rank} is dead ({describe_exit(state.exitcode)})"
            self.on_regions(rank, [RegionFailed(s.item, error) for s in wire])
            return
        if burst:
            self._bursts.add(rank)
        else:
            self._bursts.discard(rank)
        try:
            self.pool._send(state, data)
        except zmq.ZMQError as e:
            self.fail_rank(rank, unreachable(state, e))

    def end_bursts(self) -> None:
        """The conductor pass that sent region starts with ``burst`` is over: the ranks whose
        last starts said more would follow are told that none do (an empty ``StartRegions``),
        so that they step what they hold at once."""
        while self._bursts:
            state = self.pool._rank(self._bursts.pop())
            if state.status not in GONE:
                with contextlib.suppress(zmq.ZMQError):
                    self.pool._send(state, encode(StartRegions([])))

    def feed(
        self,
        rank: int,
        item: int,
        request_id: str,
        stream: str,
        pieces: Sequence[Any],
        finished: bool,
    ) -> None:
        """Items of a stream from one region to region item ``item`` on ``rank``: held values
        (``ObjectRef``) that rank pulls from their producer itself."""
        state = self.pool._rank(rank)
        transport = self.pool._transport_for(rank)
        values: list[Value] = []
        handles: list[Token] = []
        try:
            for piece in pieces:
                values.append(payload := transport.send(piece, request_id))
                handles += shm_handles(payload)
            data = encode(FeedStream(item, request_id, stream, values, finished))
        except BaseException:
            transport.release(handles)
            raise
        with self.pool._lock:
            for h in handles:
                self._region_handles[h] = rank
        if state.status not in GONE:
            with contextlib.suppress(zmq.ZMQError):
                self.pool._send(state, data)

    def grant(self, rank: int, item: int, channel: str, items: int) -> None:
        """Producer region item ``item`` on ``rank`` may commit ``channel`` up to ``items``."""
        state = self.pool._rank(rank)
        if state.status not in GONE:
            with contextlib.suppress(zmq.ZMQError):
                self.pool._send(state, encode(GrantCredit(item, channel, items)))

    def drop(self, rank: int, items: Sequence[int]) -> None:
        """Region runs on ``rank`` nobody waits for any more: the rank may stop them."""
        state = self.pool._rank(rank)
        with self.pool._lock:
            live = self._regions.get(rank, {})
            items = [i for i in items if live.pop(i, None) is not None]
        if items and state.status not in GONE:
            with contextlib.suppress(zmq.ZMQError):
                self.pool._send(state, encode(DropRuns(list(items))))

    def stats(self, timeout: float = 10.0) -> dict[int, RankStatsReply]:
        """Every live rank's scheduler and stores, as each answered a ``StatsQuery`` sent after
        every command before this call (ranks that do not answer in ``timeout`` are left out)."""
        seq = next(self._stats_seq)
        done = threading.Event()
        replies: dict[int, RankStatsReply] = {}
        with self.pool._lock:
            live = [s for s in self.pool._ranks.values() if s.status == "ready"]
            self._stats_replies[seq] = (done, replies)
        try:
            for state in live:
                with contextlib.suppress(zmq.ZMQError):
                    self.pool._send(state, encode(StatsQuery(seq)))
            deadline = time.monotonic() + timeout
            while len(replies) < len(live) and time.monotonic() < deadline:
                done.wait(max(0.0, deadline - time.monotonic()))
                done.clear()
            return dict(replies)
        finally:
            with self.pool._lock:
                self._stats_replies.pop(seq, None)

    def on_events(self, state: RankState, msg: RegionEvents) -> None:
        """Copy the values out (acking their slots at once) and hand the events on."""
        transport = self.pool._transport_for(state.rank)
        handles: list[Token] = []
        events: list[RegionEvent] = []
        with self.pool._lock:
            live = self._regions.setdefault(state.rank, {})
        for event in msg.events:
            request = live.get(event.item, "")
            try:
                if isinstance(event, RegionStreamed):
                    value, tokens = transport.receive(event.value, "")
                    handles += tokens
                    events.append(msgspec.structs.replace(event, value=value))
                elif isinstance(event, (RegionOutput, RegionDone)):
                    outputs = {}
                    for name, payload in event.outputs.items():
                        outputs[name], tokens = transport.receive(payload, "")
                        handles += tokens
                    self.track(outputs, request)
                    events.append(msgspec.structs.replace(event, outputs=outputs))
                else:
                    events.append(event)
            except Exception as e:
                error = (
                    f"region item {event.item}'s values from rank {state.rank} are unreadable: {e}"
                )
                events.append(RegionFailed(event.item, error))
            if isinstance(events[-1], (RegionDone, RegionFailed)):
                with self.pool._lock:
                    live.pop(event.item, None)
        if handles:
            with contextlib.suppress(zmq.ZMQError):
                self.pool._send(state, encode(Ack(handles)))
        self.on_regions(state.rank, events)

    def track(self, values: Mapping[str, Any], request: str) -> None:
        """Release each held value of ``values`` (an ``ObjectRef``) on its rank once this
        process drops its last reference to it: its last reader is done."""
        todo = list(values.values())
        while todo:
            v = todo.pop()
            if isinstance(v, ObjectRef):
                weakref.finalize(v, self._releases.append, (v.rank, request, v.key))
            elif isinstance(v, (list, tuple)):
                todo += v

    def flush(self) -> None:
        """Send the ``Release`` of every held value dropped since the last flush (the
        finalizers only queue them: they may run in any thread, holding any lock)."""
        by: dict[tuple[int, str], list[str]] = {}
        while self._releases:
            rank, request, key = self._releases.popleft()
            by.setdefault((rank, request), []).append(key)
        for (rank, request), keys in by.items():
            state = self.pool._ranks.get(rank)
            if request and state is not None and state.status == "ready":
                with contextlib.suppress(zmq.ZMQError):
                    self.pool._send(state, encode(Release(request, keys)))

    def on_stats(self, state: RankState, msg: RankStatsReply) -> None:
        with self.pool._lock:
            waiting = self._stats_replies.get(msg.seq)
        if waiting is not None:
            waiting[1][state.rank] = msg
            waiting[0].set()

    def fail_rank(self, rank: int, error: str) -> None:
        """Every region run of ``rank`` fails with ``error`` (its worker died)."""
        with self.pool._lock:
            items = self._regions.pop(rank, {})
            mine = [h for h, r in self._region_handles.items() if r == rank]
            for h in mine:
                del self._region_handles[h]
        for h in mine:
            self.pool._release(h)
        if items:
            self.on_regions(rank, [RegionFailed(item, error) for item in items])
