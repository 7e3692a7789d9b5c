"""A worker's inbox: the conductor's commands, read by the engine's own thread (``worker.Worker``
is a ``WorkerInbox``; ``EngineLoop.run`` calls ``read`` when it would wait and between steps, and
asks ``waiting`` between fast-lane steps), so a command reaches the engine with no hand-off
between threads. They come on the rank's link (``LinkCommands``: a rank the conductor spawned,
``runtime.ranklink``) or a remote rank's ZeroMQ command socket (``ZmqCommands``)::

    engine.run(stopping, inbox=worker)     # read(wait=True): poll the commands and the wake pipe
    worker._wake()                         # any thread (a stop): the poll returns

A wait first polls without sleeping for ``idle_spin_s`` after the engine's last work
(``WorkerConfig.idle_spin_s``): a command that follows soon, such as the next request of a
client that waited for this one, is read at once, instead of after the wake-up of a core that
went idle and the cold caches it wakes to. On a 2-core VM that wake cost ~140 us per request,
and the first step after it ran ~1.5x slower than a warm one (``bench_loops``).

A node batch (``RunBatch``), region starts (``StartRegions``) and fed stream pieces
(``FeedStream``) have their inputs read here: values held by other ranks are pulled from them
first (``peers``, one round trip per rank), shared-memory inputs are acknowledged at once (they
were copied out), and the work is queued for the engine (``EngineLoop.put``; a message's region
starts together, ``put_starts``, with whether more of a burst follow). An input that cannot be
read fails its items or runs here, with a report, and nothing reaches the engine. ``Wake`` (work
on its way, sent while the rank slept) only restarts the idle spin. ``Ack`` releases this
rank's output slots; ``Probe`` is a link measurement; ``Shutdown`` stops the loop.
"""

from __future__ import annotations

import logging
import math
import os
import select
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from walkserve.runtime.doorbell import Doorbell
from walkserve.runtime.wakepipe import WakePipe

if TYPE_CHECKING:
    import torch
    import zmq

    from walkserve.runtime.engine import EngineLoop
    from walkserve.runtime.messages import Message, RunBatch, StartRegions
    from walkserve.runtime.peers import PeerClient
    from walkserve.runtime.ranklink import Link
    from walkserve.runtime.transport import ShmTransport

__all__ = ["Commands", "LinkCommands", "WorkerInbox", "ZmqCommands"]

log = logging.getLogger("walkserve.worker")

WAIT_MS = 500  # longest wait for a command: a stop that no wake announced is seen by then


class WorkerInbox:
    """The command socket's reader and handlers (see the module docstring)."""

    # the worker's state these handlers use (set by Worker)
    rank: int
    engine: EngineLoop
    transport: ShmTransport
    peers: PeerClient | None
    pull: Callable[[Any], Any] | None  # a held tensor of another host, by its ``at``
    objects: Any  # transport.ObjectStore
    _rx: Commands
    _poller: zmq.Poller
    _handlers: dict[type, Callable[[Any], object]]
    _wakes: WakePipe | None = None
    idle_spin_s: float = 0.0  # poll without sleeping this long after the last work
    device: torch.device | None = None  # the rank's, where not the CPU: inputs go there
    _busy_at: float = 0.0  # when the engine last read while busy, or got a command

    def _send(self, msg: Message) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _conductor_closed(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the socket

    def _open_inbox(self, rx: Commands) -> None:
        import zmq

        from walkserve.runtime.messages import (
            Ack,
            Cancel,
            DropRuns,
            FeedStream,
            GrantCredit,
            Probe,
            Release,
            RunBatch,
            Shutdown,
            StartRegions,
            StatsQuery,
            Wake,
        )
        from walkserve.runtime.rankcommands import CancelRequest, CreditItems, DropItems, StatsAsk

        self._rx = rx
        self._wakes = WakePipe()
        self._poller = zmq.Poller()
        self._poller.register(rx.target, zmq.POLLIN)
        self._poller.register(self._wakes.fd, zmq.POLLIN)
        engine = self.engine
        self._handlers = {
            RunBatch: self._prepare,
            StartRegions: self._start_regions,
            Ack: self._on_ack,
            Cancel: lambda m: engine.put_all([CancelRequest(r) for r in m.request_ids]),
            DropRuns: lambda m: engine.put(DropItems(list(m.items))),
            StatsQuery: lambda m: engine.put(StatsAsk(m.seq)),
            Release: lambda m: self.objects.release(m.request_id, m.keys),
            FeedStream: self._feed,
            GrantCredit: lambda m: engine.put(CreditItems(m.item, m.channel, m.items)),
            Shutdown: lambda m: self._stop(),
            Probe: self._on_probe,
            Wake: lambda m: None,  # its read restarted the idle spin: nothing else to do
        }

    def _close_inbox(self) -> None:
        if self._wakes is not None:
            self._wakes.close()

    def _wake(self) -> None:
        """Make a waiting ``read`` return (any thread; before the inbox opens, nothing)."""
        if self._wakes is not None:
            self._wakes.set()

    def read(self, wait: bool, within_s: float | None = None) -> None:
        """Handle every command waiting on the socket; ``wait``: first wait (at most
        ``within_s``, or ``WAIT_MS``) for one, or for a wake from another thread."""
        from walkserve.runtime.messages import MessageError, decode

        if not wait:
            self._busy_at = time.perf_counter()
        elif ready := self._wait(within_s):
            self._busy_at = time.perf_counter()
            wakes = self._wakes
            if wakes is not None and any(fd == wakes.fd for fd, _ in ready):
                wakes.clear()  # a wake came: taken (a read of the pipe for it alone)
        handlers = self._handlers
        for data in self._rx.messages():
            try:
                msg: Message = decode(data)
            except MessageError as e:
                log.warning("rank %d: ignoring a bad message: %s", self.rank, e)
                continue
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("rank %d: unexpected %s", self.rank, type(msg).__name__)
            else:
                handler(msg)
        if self._rx.closed:  # the conductor closed its end: it is gone
            self._conductor_closed()

    def _wait(self, within_s: float | None = None) -> list[tuple[Any, int]]:
        """Wait for a command or a wake: polled without sleeping until ``idle_spin_s`` after
        the last work (yielding the core to any other thread that wants it), then asleep for
        at most ``WAIT_MS`` (``within_s`` in all, when given). What came: the poll's ready
        (socket or fd, event) pairs, empty if nothing."""
        poll = self._poller.poll
        now = time.perf_counter()
        end = now + within_s if within_s is not None else None
        until = self._busy_at + self.idle_spin_s
        if end is not None:
            until = min(until, end)
        while now < until:
            if ready := poll(0):
                return ready
            os.sched_yield()
            now = time.perf_counter()
        if end is None:
            return poll(WAIT_MS)
        return poll(max(0, math.ceil((end - now) * 1e3)))

    def waiting(self) -> bool:
        """Whether a command waits (cheap: asked between fast-lane steps)."""
        return self._rx.waiting()

    # ------------------------------------------------------------------ the handlers

    def _receive(self, inputs: Any, request_id: str, handles: list[Any]) -> dict[str, Any]:
        """The values of ``inputs`` (payloads by name): held ones of other ranks pulled from
        them first: from a rank of this host through its peer socket (``peers``, one round
        trip per rank), from another host's by one Mooncake read of the block the reference
        names (``pull``)."""
        from walkserve.runtime.wirevalues import ObjectRef, Seq

        remote: list[ObjectRef] = []
        pulled: list[ObjectRef] = []
        near = self.peers.peers if self.peers is not None else {}
        todo = list(inputs.values())
        while todo:
            p = todo.pop()
            if isinstance(p, ObjectRef) and p.rank != self.rank:
                if p.rank not in near and p.at is not None and self.pull is not None:
                    pulled.append(p)
                else:
                    remote.append(p)
            elif isinstance(p, Seq):
                todo += p.items
        fetched: dict[tuple[int, str], Any] = {}
        if remote:
            if self.peers is None:
                raise ValueError(
                    f"values held by ranks {sorted({r.rank for r in remote})} "
                    "cannot reach this rank (no peer sockets)"
                )
            fetched = self.peers.fetch(request_id, remote)
        if pulled:
            assert self.pull is not None
            fetched |= {(r.rank, r.key): self.pull(r.at) for r in pulled}
        self.transport.fetched = fetched
        try:
            env = {}
            for name, payload in inputs.items():
                env[name], tokens = self.transport.receive(payload, request_id)
                handles += tokens
            if self.device is not None:  # a GPU rank's inputs go there (``runtime.device``)
                from walkserve.runtime.device import to_device

                env = {name: to_device(value, self.device) for name, value in env.items()}
            return env
        finally:
            self.transport.fetched = {}

    def _prepare(self, msg: RunBatch) -> None:
        """Decode a batch's inputs, ack the shared-memory inputs at once (they were copied
        out), hand the batch to the engine loop."""
        from walkserve.runtime.messages import Ack, BatchFailed, ItemError
        from walkserve.runtime.rankcommands import NodeBatch

        items: list[tuple[int, str, dict[str, Any]]] = []
        handles: list[Any] = []
        error = None
        try:
            for item in msg.items:
                env = self._receive(item.inputs, item.request_id, handles)
                items.append((item.item, item.request_id, env))
        except Exception as e:
            error = f"inputs of {msg.walk}:{msg.node} could not be read on rank {self.rank}: {e}"
        if handles:
            self._send(Ack(handles))
        if error is not None:
            errors = [ItemError(item.item, error) for item in msg.items]
            self._send(BatchFailed(msg.batch, self.rank, errors))
            return
        self.engine.put(NodeBatch(msg.batch, msg.walk, msg.node, items, msg.ops, msg.outputs))

    def _start_regions(self, msg: StartRegions) -> None:
        from walkserve.runtime.messages import Ack, RegionEvent, RegionEvents, RegionFailed
        from walkserve.runtime.rankcommands import StartRun

        handles: list[Any] = []
        failed: list[RegionEvent] = []
        runs: list[StartRun] = []
        for start in msg.starts:
            try:
                env = self._receive(start.inputs, start.request_id, handles)
            except Exception as e:
                error = f"inputs of region {start.region} could not be read on rank {self.rank}"
                failed.append(RegionFailed(start.item, f"{error}: {e}"))
                continue
            runs.append(
                StartRun(start.item, start.request_id, start.walk, start.region, env, start.stream)
            )
        self.engine.put_starts(runs, msg.more)  # together: runs that came together start together
        if handles:
            self._send(Ack(handles))
        if failed:
            self._send(RegionEvents(self.rank, failed))

    def _feed(self, msg: Any) -> None:
        """Pull a fed stream's pieces from the rank that made them, then hand them on."""
        from walkserve.runtime.messages import Ack, RegionEvents, RegionFailed
        from walkserve.runtime.rankcommands import FeedItems

        handles: list[Any] = []
        try:
            env = self._receive(
                {str(k): v for k, v in enumerate(msg.pieces)}, msg.request_id, handles
            )
        except Exception as e:
            error = f"stream {msg.stream} could not be read on rank {self.rank}: {e}"
            self._send(RegionEvents(self.rank, [RegionFailed(msg.item, error)]))
            return
        finally:
            if handles:
                self._send(Ack(handles))
        pieces = [env[str(k)] for k in range(len(msg.pieces))]
        self.engine.put(FeedItems(msg.item, msg.stream, pieces, msg.finished))

    def _on_probe(self, msg: Any) -> None:
        """A link measurement (``runtime.net.link``): read the value, then say so."""
        from walkserve.runtime.messages import ProbeReply

        try:
            self.transport.receive(msg.value, "probe")
        except Exception as e:  # the conductor's timing is off, nothing else
            log.warning("rank %d: unreadable probe: %s", self.rank, e)
        self._send(ProbeReply(msg.seq, self.rank))

    def _on_ack(self, msg: Any) -> None:
        from walkserve.runtime.shm import ShmError

        for handle in msg.handles:
            try:
                self.transport.release([handle])
            except ShmError as e:
                log.warning("rank %d: bad ack: %s", self.rank, e)


class Commands(Protocol):
    """Where a worker's commands come from: its ZeroMQ command socket (``ZmqCommands``: a
    remote rank) or its rank link (``LinkCommands``: a rank the conductor spawned)."""

    target: Any  # what the inbox's poller watches: the socket, or a file descriptor

    @property
    def closed(self) -> bool: ...  # the conductor closed its end

    def poll(self, timeout_ms: int) -> bool: ...  # whether a command waits (after a wait)

    def recv(self) -> bytes | bytearray | None: ...  # the next command (None: none whole yet)

    def messages(self) -> Iterable[bytes | bytearray]: ...  # every waiting command, in order

    def waiting(self) -> bool: ...  # cheap

    def close(self) -> None: ...


class ZmqCommands:
    """A ZeroMQ command socket as ``Commands``."""

    @property
    def closed(self) -> bool:
        return False  # a remote conductor's end is watched otherwise (``rejoin``)

    def __init__(self, rx: zmq.Socket[bytes]) -> None:
        import zmq

        self.target = self.sock = rx
        # the socket's signal: readable once something reached it since its events were last
        # read (``waiting``)
        self._signal = select.poll()
        self._signal.register(int(rx.get(zmq.FD)), select.POLLIN)  # type: ignore[arg-type]
        self._pending = True  # until its events are read: what came before may wait

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def recv(self) -> bytes | None:
        return _recv(self.sock)

    def messages(self) -> Iterator[bytes]:
        self._pending = False  # every command is taken below (the events read last say so)
        while (data := _recv(self.sock)) is not None:
            yield data

    def waiting(self) -> bool:
        """The socket's fd (its signal, as ``zmq_poll`` uses it) turns readable when something
        reaches the socket after its events were last read, and reading them clears it; every
        read of this socket, which only this thread reads, ends with such a read (``_recv``
        reads until the events say no message is left). So while the fd is not readable and no
        command was seen waiting since the last ``messages``, none can wait, and the events (a
        call into the socket: ~2 us against ~0.5 us for the fd's poll on this VM) are read only
        when it is."""
        if self._pending or self._signal.poll(0):
            self._pending = _readable(self.sock)  # a command waits until ``messages`` takes it
        return self._pending

    def close(self) -> None:
        self.sock.close()


class LinkCommands:
    """A rank link (``runtime.ranklink``) as ``Commands``. ``bell``: the path of the doorbell
    the conductor rings after each write to it (``doorbell``), watched once a message came
    (the conductor makes it before it writes anything): ``waiting()`` then reads it instead of
    polling the socket."""

    def __init__(self, link: Link, bell: str | None = None) -> None:
        self.link = link
        self.target = link.fileno()
        self._held: list[bytes | bytearray] = []  # read with one ``recv`` wanted, not yet taken
        self._bell = bell  # its path, until it is watched (or found missing)

    def _read(self) -> list[bytes | bytearray]:
        got = self.link.recv()
        if got and self._bell is not None:
            bell, self._bell = Doorbell.open(self._bell), None
            if bell is not None:
                self.link.watch(bell)
        return got

    @property
    def closed(self) -> bool:
        return self.link.closed and not self._held

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._held) or self.link.waiting(timeout_ms)

    def recv(self) -> bytes | bytearray | None:
        if not self._held:
            self._held = self._read()
        return self._held.pop(0) if self._held else None

    def messages(self) -> list[bytes | bytearray]:
        held, self._held = self._held, []
        return held + self._read() if held else self._read()

    def waiting(self) -> bool:
        return bool(self._held) or self.link.waiting()

    def close(self) -> None:
        self.link.close()


_POLLIN = 1  # zmq.POLLIN, as an int: the flag enum's ``&`` costs more than the read


def _readable(sock: zmq.Socket[bytes]) -> bool:
    import zmq

    return bool(int(sock.get(zmq.EVENTS)) & _POLLIN)


def _recv(sock: zmq.Socket[bytes]) -> bytes | None:
    """The next message, or None when none is waiting (asked of the socket's events first:
    raising ``zmq.Again`` for every empty read costs more than the read)."""
    import zmq

    if not _readable(sock):
        return None
    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
