"""The conductor's region items: a region handed to its rank as one item
(``_dispatch_region``), and the traffic of a region item before its exit: outputs known early
(``partial``), committed items of its streamed channels (``streamed``: a walk's client
streams, streams into another region of the frame, streams of the region walk itself), its
consumers' progress (``consumed``, turned into ``Credit`` for its producer), items fed to it
from another region (``feed``, ``Feed`` out of ``_flush``), and region items dropped before
their rank reported. ``Conductor`` (``runtime.conductor``) is a ``RegionItems``: the requests,
frames and items these methods read are its own (the hooks below)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from walkserve.capture.loopsem import LoopError
from walkserve.runtime.frames import Forward, Frame, Pending, RequestState
from walkserve.runtime.loopmaps import MapItems
from walkserve.runtime.walkspec import RegionSpec
from walkserve.runtime.workitem import UNLIMITED, Credit, Feed, StreamItem

__all__ = ["RegionItems"]


class RegionItems(MapItems):
    """The region-item half of ``Conductor``'s state machine (see the module docstring)."""

    # the conductor's state these methods read (set by Conductor.__init__)
    _requests: dict[str, RequestState]
    _feeds: list[Feed]
    _dropped: list[int]
    _fed: dict[str, frozenset[str]]

    # the conductor's hooks
    def _advance(self, req: RequestState) -> None:
        raise NotImplementedError

    def _fail_request(self, req: RequestState, error: str) -> None:
        raise NotImplementedError

    def _node_failed(self, p: Pending, error: str) -> None:
        raise NotImplementedError

    def _bind_results(self, p: Pending, value: Mapping[str, Any]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the interface

    def partial(self, item_id: int, values: Mapping[str, Any]) -> None:
        """Some outputs of a region item, before its exit: bound at once (``complete`` then
        brings the others). Items no longer wanted: ignored."""
        p = self._items.get(item_id)
        if p is None or p.region is None:
            return
        self._bind_results(p, {k: v for k, v in values.items() if k in p.ops})
        self._advance(p.request)

    def streamed(self, item_id: int, channel: str, index: int, value: Any) -> bool:
        """Iteration ``index`` of a region item's streamed channel ``channel`` committed (its
        walk-level client outputs stream it): ``streamed_run`` of one value."""
        return self.streamed_run(item_id, channel, index, (value,))

    def deferrable(self, item_id: int, channel: str) -> bool:
        """Whether a region item's committed items of ``channel`` may wait while its producer
        steps on, to be given to ``streamed_run`` several at once: its request streams
        nothing out and the channel goes to no other region, so that they feed only
        consumers in its frame, whose steps they ready are not urgent (see
        ``streamed_run``)."""
        p = self._items.get(item_id)
        if p is None or p.region is None or p.request.stream:
            return False
        if p.region.forwards.get(channel):
            return False
        return channel in p.region.emit or any(ch == channel for _, ch in p.region.feeds)

    def streamed_run(self, item_id: int, channel: str, index: int, values: Sequence[Any]) -> bool:
        """Iterations ``index, index + 1, ...`` of a region item's streamed channel
        ``channel`` committed, one of ``values`` each (its walk-level client outputs stream
        it); the state machine advances once for all of them. Items no longer wanted:
        ignored. Returns whether anything changed that the caller must look at beyond
        ``events()`` (a feed, a forwarded stream's items, items ready, a failure, an event of
        an advance): False for items that only became a client's stream items (``StreamItem``
        events, after the outputs that come before them: a rank's fast lane steps on while it
        reports them), for items that only joined a stream buffer without forming a chunk,
        after which ``ready()``, ``events()`` and ``feeds()`` have nothing new, and for ones
        that formed a chunk of a request that streams nothing out (``RequestState.stream``
        empty), when its advance made no event: its consumer's step is then ready, but not
        urgent."""
        p = self._items.get(item_id)
        if p is None or p.region is None:
            return False
        outs = p.region.emit.get(channel)
        streams = p.region.forwards.get(channel)
        feeds = [stream for stream, ch in p.region.feeds if ch == channel]
        if outs is None and streams is None and not feeds:
            self._node_failed(p, f"region {p.node} streamed {channel!r}, which it does not stream")
            return True
        req = p.request
        changed = False
        for out in [o for o in outs or () if req.streams(o)]:  # events alone: not ``changed``
            self._send_ready_outputs(req)
            self._events += [StreamItem(req.id, out, index + k, v) for k, v in enumerate(values)]
        for stream in streams or ():
            fwd = p.frame.forwards[stream]
            fwd.pending += values
            self._flush(req, fwd)
            changed = True
        if feeds:
            # An item that completes no chunk changes nothing a consumer waits for (a chunk
            # policy's ``ready`` depends only on the count and the end), so the request's
            # state machine is advanced only when a chunk formed: a window of 16 items every
            # 8 costs one advance per 8 items, not 8.
            formed = False
            try:
                for stream in feeds:
                    s = p.frame.streams[stream]
                    before = s.ready()
                    s.extend(values)
                    formed = formed or s.ready() != before
            except LoopError as e:
                self._fail_request(req, str(e))
                return True
            if formed:
                said = len(self._events)
                self._advance(req)
                # The consumer's step this chunk readied is urgent only where something of it
                # leaves the rank before the region's exit (a client's or a forwarded stream)
                # or the advance said something; else it may wait until the producer stops
                # (its end, its credit): the rank steps the producer back to back, then the
                # consumer's steps, instead of switching models every chunk (``RankScheduler``)
                changed = changed or bool(req.stream) or len(self._events) != said
        return changed

    def consumed(self, item_id: int, stream: str, base: int, received: int, closed: bool) -> None:
        """Consumer region item ``item_id`` has ``received`` pieces of ``stream`` and has
        released its items before ``base`` (``closed``: it takes no more): its producer may
        commit up to ``base + stream_buffer_limit`` items (``Credit``)."""
        p = self._items.get(item_id)
        if p is None or p.region is None or stream not in p.region.fed:
            return
        fwd = p.frame.forwards[stream]
        while fwd.received < received and fwd.sent:
            fwd.sent.popleft()
            fwd.received += 1
        credit = UNLIMITED if closed else base + self.stream_buffer_limit
        if fwd.producer is not None and credit != fwd.credit:
            fwd.credit = credit
            others = [
                g.credit if g.credit is not None else self.stream_buffer_limit
                for g in p.frame.forwards.values()
                if g.channel == fwd.channel
            ]
            self._credits.append(Credit(fwd.producer, p.request.id, fwd.channel, min(others)))

    def feed(self, request_id: str, stream: str, pieces: Sequence[Any], finished: bool) -> None:
        """Items of fed stream ``stream`` of a request's walk (its root frame), in order."""
        req = self._requests.get(request_id)
        if req is None:
            return
        s = req.root.streams.get(stream)
        if s is None or stream not in self._fed.get(req.walk, frozenset()):
            self._fail_request(req, f"walk {req.walk!r} is fed no stream {stream!r}")
            return
        try:
            for piece in pieces:
                s.append(piece)
        except LoopError as e:
            self._fail_request(req, str(e))
            return
        s.finished = s.finished or finished
        self._advance(req)

    def fed_progress(self, request_id: str) -> dict[str, tuple[int, bool]]:
        """(items released, consumer done) of every fed stream of the request."""
        req = self._requests.get(request_id)
        if req is None:
            return {}
        fed = self._fed.get(req.walk, frozenset())
        return {n: (s.base, s.closed) for n, s in req.root.streams.items() if n in fed}

    def credit(self, request_id: str, channel: str, items: int) -> None:
        """The request's walk-level loops may commit items of client channel ``channel`` up to
        ``items`` (counting iterations in flight as one item each), then wait for more."""
        if request_id not in self._requests:
            return
        self._credit.setdefault(request_id, {})[channel] = items
        self._advance(self._requests[request_id])

    def feeds(self) -> list[Feed]:
        """Stream items for consumer regions (drained)."""
        out, self._feeds = self._feeds, []
        return out

    def credits(self) -> list[Credit]:
        """Credit for producer regions (drained)."""
        out, self._credits = self._credits, []
        return out

    def dropped(self) -> list[int]:
        """Region items released (cancel, failure, a discarded speculative iteration) before
        their rank reported their exit: the runner may stop them. Drained."""
        out, self._dropped = self._dropped, []
        return out

    # ------------------------------------------------------------------ internals

    def _dispatch_region(self, req: RequestState, f: Frame, rs: RegionSpec) -> None:
        """Hand region ``rs`` to its rank: one item, its inputs in ``env``."""
        f.regions.remove(rs)
        env = {r: f.env[r] for r in rs.reads}
        for t in rs.trip_inputs:
            env[t] = req.walk_inputs[t]
        for r in rs.reads:
            self._consume(f, r)
        item = self._work_item(
            req, f, rs.name, "region", env=env, outputs=rs.outputs, stream=bool(req.stream)
        )
        self._issue(item, Pending(req, f, rs.name, rs.outputs, {}, item, rs))
        for stream in rs.fed:
            fwd = f.forwards[stream]
            fwd.consumer = item.id
            self._flush(req, fwd)
        for streams in rs.forwards.values():
            for stream in streams:
                f.forwards[stream].producer = item.id
        self._feeding(req, f, item.id, rs.feeds)  # into this frame's buffers, with credit

    def _flush(self, req: RequestState, fwd: Forward) -> None:
        if fwd.consumer is None or not (fwd.pending or (fwd.finished and not fwd.finish_sent)):
            return
        pieces = tuple(fwd.pending)
        fwd.sent.extend(pieces)
        fwd.pending = []
        fwd.finish_sent = fwd.finished
        self._feeds.append(Feed(fwd.consumer, req.id, fwd.stream, pieces, fwd.finished))
