"""The worker pool's io thread: the one reader of the *reports* socket, where every worker
message arrives, and the thread that notices a worker's death and makes the server's
conductor pass after each read. ``WorkerPool`` (``runtime.pool``) is an ``IoLoop``::

    pool.on_io_pass = passes.pump     run at the end of every pass of the loop (the server's)
    pool.nudge(within_s=None)         any thread: wake the loop for an ``on_io_pass`` (within
                                      ``within_s`` at the latest: it polls no longer)
    pool.on_io_thread()               whether the caller is the io thread (``passes``)

One pass of the loop:

    poll      *reports*, the stop socket (``close``), the nudge pipe, every worker's
              ``Process.sentinel``: a dead worker is noticed at once, not at a heartbeat
              timeout; the wait is short while setups or restarts are due; the rank links
              and their listener (``poollinks``: the ranks this process spawned)
    read      every waiting report (of *reports* and of the links), dispatched by type
              (``_handlers``, a table; a message for another rank is dropped, logged); each
              refreshes its rank's ``last_seen``; a peer the pool does not know is a remote
              rank's (new) process (``poolremote``)
    sentinel  the rank's last words (a ``Fatal``) are read first, then ``_on_exit``
    then      setups not yet routable sent again, ``on_io_pass``, region events flushed
              (``poolregions``), supervision ticked (``poolsupervision``)

Futures and region events complete on this thread: what they call back should not block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from walkserve.runtime.messages import (
    Ack,
    AttachPools,
    BatchDone,
    BatchFailed,
    Fatal,
    Heartbeat,
    Hello,
    Join,
    Message,
    MessageError,
    ProbeReply,
    RankStatsReply,
    RegionEvents,
    decode,
)
from walkserve.runtime.poolranks import RankLife
from walkserve.runtime.poolstate import RankState, recv_multipart
from walkserve.runtime.wakepipe import WakePipe

__all__ = ["IoLoop"]

log = logging.getLogger("walkserve.pool")


class IoLoop(RankLife):
    """The io thread of ``WorkerPool`` (see the module docstring)."""

    def _open_io(self) -> None:
        """The loop's state, before anything starts: ``nudge`` works from now on."""
        # run at the end of every pass of the io thread (the server's conductor pass), and
        # what wakes that thread for it from any other (``nudge``): a pipe, thread-safe
        self.on_io_pass: Callable[[], None] = lambda: None
        self._nudge = WakePipe()
        self._pass_by = float("inf")  # an on_io_pass is due by then at the latest (``nudge``)
        self._io: threading.Thread | None = None

    def _start_io(self) -> None:
        """Start the io thread: the ranks exist, *reports* is bound."""
        self._wake_rx = self._ctx.socket(zmq.PULL)  # close() stops the io thread through it
        self._wake_rx.bind("inproc://wake")
        self._wake = self._ctx.socket(zmq.PUSH)
        self._wake.connect("inproc://wake")
        self._handlers: dict[type, Callable[[RankState, Any], None]] = {
            Join: self._on_join,
            AttachPools: self._on_attach,
            Hello: self._on_hello,
            Heartbeat: self._on_heartbeat,  # every message refreshes last_seen
            BatchDone: self._on_done,
            BatchFailed: self._on_failed,
            Ack: self._on_ack,
            Fatal: self._on_fatal,
            ProbeReply: self._on_probe_reply,
            RegionEvents: self.regions.on_events,
            RankStatsReply: self.regions.on_stats,
        }
        self._io = threading.Thread(target=self._io_loop, name="walkserve-pool-io", daemon=True)
        self._io.start()

    def _stop_io(self) -> None:
        """Stop the io thread (``close``; from a future callback, on that thread, it ends
        after this pass)."""
        if self._io is not None:
            self._wake.send(b"stop")
            if threading.current_thread() is not self._io:  # close() from a future callback
                self._io.join()

    def _io_loop(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._reports, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._nudge.fd, zmq.POLLIN)
        self._listen_links(poller)
        sentinels = self._sentinels = {s.process.sentinel: s for s in self._ranks.values()}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        deadline = self.config.supervision.hang_deadline_s
        tick = 1000 if deadline is None else max(10, min(1000, int(deadline * 250)))
        while True:
            wait = 5 if self._setups_due or self.supervision.due else tick
            if self._pass_by < float("inf"):
                wait = min(wait, max(0, int((self._pass_by - time.monotonic()) * 1000) + 1))
            self._watch_links(poller)
            for sock, events in poller.poll(wait):
                if sock is self._reports:
                    while (frames := recv_multipart(self._reports)) is not None:
                        self._dispatch(frames)
                elif sock is self._wake_rx:
                    return
                elif sock == self._nudge.fd:
                    self._nudge.clear()
                elif isinstance(sock, int) and sock in sentinels:
                    poller.unregister(sock)
                    self._drain_reports()  # its last words (a Fatal) come first
                    self._on_exit(sentinels.pop(sock), closing=self._closed)
                elif isinstance(sock, int):
                    self._on_link_event(sock, events)
            for rank, setup in list(self._setups_due.items()):
                self._send_setup(self._ranks[rank], setup)
            if time.monotonic() >= self._pass_by:
                self._pass_by = float("inf")
            self.on_io_pass()
            self.regions.flush()
            self.supervision.tick()

    def nudge(self, within_s: float | None = None) -> None:
        """Wake the io thread for an ``on_io_pass`` (any thread); ``within_s``: for one within
        that time at the latest (it wakes now, and polls no longer than that)."""
        if within_s is not None:
            self._pass_by = min(self._pass_by, time.monotonic() + within_s)
        self._nudge.set()

    def on_io_thread(self) -> bool:
        return threading.current_thread() is self._io

    def _drain_reports(self, wait_ms: int = 20) -> None:
        """Dispatch what the workers sent so far, waiting up to ``wait_ms`` for stragglers."""
        self._drain_links()  # a process that ended has written all it will
        while self._reports.poll(wait_ms):
            while (frames := recv_multipart(self._reports)) is not None:
                self._dispatch(frames)
            wait_ms = 2

    def _dispatch(self, frames: list[bytes]) -> None:
        state = self._by_identity.get(frames[0])
        if state is None or len(frames) != 2:
            self._from_unknown(frames)  # a remote rank's (new) process joins: poolremote
            return
        self._handle(state, frames[1])

    def _handle(self, state: RankState, data: bytes | bytearray) -> None:
        """A message of ``state``'s process (from its ROUTER frames, or its rank link)."""
        state.last_seen = now = time.monotonic()
        try:
            msg: Message = decode(data)
        except MessageError as e:
            log.warning("rank %d sent a bad message: %s", state.rank, e)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("rank %d sent an unexpected %s", state.rank, type(msg).__name__)
            return
        if type(msg) is not Heartbeat:
            state.busy_at = now
        if getattr(msg, "rank", state.rank) != state.rank:
            log.warning("rank %d sent a message for rank %s", state.rank, msg.rank)  # type: ignore[union-attr]
            return
        handler(state, msg)

    def _on_heartbeat(self, state: RankState, msg: Heartbeat) -> None:
        state.kv = list(msg.kv)
