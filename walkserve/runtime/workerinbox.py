"""A worker's inbox: what its io thread does with each command of the conductor that carries
values (``worker.Worker`` is a ``WorkerInbox``).

A node batch (``RunBatch``), region starts (``StartRegions``) and fed stream pieces
(``FeedStream``) have their inputs read here, on the io thread, while the main thread runs the
engine loop: values held by other ranks are pulled from them first (``peers``, one round trip
per rank), shared-memory inputs are acknowledged at once (they were copied out), and the work
goes to the engine (``EngineLoop.put``). An input that cannot be read fails its items or runs
here, with a report, and nothing reaches the engine. ``Ack`` releases this rank's output slots;
``Probe`` is a link measurement.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from walkserve.runtime.engine import Command, EngineLoop
    from walkserve.runtime.messages import Message, RunBatch, StartRegions
    from walkserve.runtime.peers import PeerClient
    from walkserve.runtime.transport import ShmTransport

__all__ = ["WorkerInbox"]

log = logging.getLogger("walkserve.worker")


class WorkerInbox:
    """The io thread's handlers of value-carrying commands (see the module docstring)."""

    # the worker's state these handlers use (set by Worker)
    rank: int
    engine: EngineLoop
    transport: ShmTransport
    peers: PeerClient | None

    def _send(self, msg: Message) -> None:
        raise NotImplementedError

    def _receive(self, inputs: Any, request_id: str, handles: list[Any]) -> dict[str, Any]:
        """The values of ``inputs`` (payloads by name): held ones of other ranks pulled from
        them first (``peers``), in one round trip per rank."""
        from walkserve.runtime.messages import ObjectRef, Seq

        remote: list[ObjectRef] = []
        todo = list(inputs.values())
        while todo:
            p = todo.pop()
            if isinstance(p, ObjectRef) and p.rank != self.rank:
                remote.append(p)
            elif isinstance(p, Seq):
                todo += p.items
        if remote:
            if self.peers is None:
                raise ValueError(
                    f"values held by ranks {sorted({r.rank for r in remote})} "
                    "cannot reach this rank (no peer sockets)"
                )
            self.transport.fetched = self.peers.fetch(request_id, remote)
        try:
            env = {}
            for name, payload in inputs.items():
                env[name], tokens = self.transport.receive(payload, request_id)
                handles += tokens
            return env
        finally:
            self.transport.fetched = {}

    def _prepare(self, msg: RunBatch) -> None:
        """Decode a batch's inputs (while the main thread runs), ack the shared-memory inputs
        at once (they were copied out), hand the batch to the engine loop."""
        from walkserve.runtime.engine import NodeBatch
        from walkserve.runtime.messages import Ack, BatchFailed, ItemError

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
        from walkserve.runtime.engine import StartRun
        from walkserve.runtime.messages import Ack, RegionEvent, RegionEvents, RegionFailed

        handles: list[Any] = []
        failed: list[RegionEvent] = []
        runs: list[Command] = []
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
        self.engine.put_all(runs)  # together: runs that came together start together
        if handles:
            self._send(Ack(handles))
        if failed:
            self._send(RegionEvents(self.rank, failed))

    def _feed(self, msg: Any) -> None:
        """Pull a fed stream's pieces from the rank that made them, then hand them on."""
        from walkserve.runtime.engine import FeedItems
        from walkserve.runtime.messages import Ack, RegionEvents, RegionFailed

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
