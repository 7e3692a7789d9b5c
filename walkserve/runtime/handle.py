"""A submitted request as its caller holds it: ``RequestHandle`` (outputs, streamed items,
their asyncio forms, cancel), filled by conductor passes from the events of its request;
``RequestFailed`` when the request ends in an error."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from walkserve.runtime.conductor import Event, Failed, Finished, Output, StreamItem

if TYPE_CHECKING:
    from walkserve.runtime.server import Server

__all__ = ["RequestFailed", "RequestHandle"]

_END = object()  # the last item of a handle's stream queue


class RequestFailed(RuntimeError):
    """A request failed: a node raised, a worker died, or the request was cancelled."""


@dataclass
class RequestHandle:
    """One submitted request. ``result()`` blocks for the client outputs; ``stream()``
    yields ``StreamItem`` events as the request's loops commit iterations. ``aresult()`` and
    ``astream()`` are the same for asyncio code: they wait on the caller's event loop (woken
    from a conductor pass), holding no thread while they wait."""

    request_id: str
    _server: Server = field(repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _outputs: dict[str, Any] = field(default_factory=dict, repr=False)
    _error: str | None = field(default=None, repr=False)
    _items: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue, repr=False)
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(
        default_factory=list, repr=False
    )
    _waiters_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        if not self._done.is_set():
            self._server.admit_waiting()  # its submission, and all queued with it
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        if self._error is not None:
            raise RequestFailed(self._error)
        return dict(self._outputs)

    def stream(self, timeout: float | None = None) -> Iterator[StreamItem]:
        """Stream items in commit order until the request ends."""
        self._server.admit_waiting()
        while True:
            item = self._items.get(timeout=timeout)
            if item is _END:
                return
            yield item

    async def aresult(self) -> dict[str, Any]:
        async with self._wake() as wake:
            while not self._done.is_set():
                wake.clear()
                if not self._done.is_set():  # set after the clear: the wake is not lost
                    await wake.wait()
        return self.result(0)

    async def astream(self) -> AsyncIterator[StreamItem]:
        async for batch in self.abatches():
            for item in batch:
                yield item

    async def abatches(self) -> AsyncIterator[list[StreamItem]]:
        """``astream``'s items, as lists of those that came together: every item there at a
        wake (a server writes each list to its client at once: one write, not one per
        item)."""
        async with self._wake() as wake:
            while True:
                batch: list[StreamItem] = []
                while True:
                    try:
                        item = self._items.get_nowait()
                    except queue.Empty:
                        break
                    if item is _END:
                        if batch:
                            yield batch
                        return
                    batch.append(item)
                if batch:
                    yield batch
                    continue
                wake.clear()
                if self._items.empty():  # an item put after the clear sets the wake
                    await wake.wait()

    def outputs(self) -> dict[str, Any]:
        """The outputs received so far (a copy): those a walk sends before its stream ends."""
        return dict(self._outputs)

    def cancel(self) -> None:
        self._server.cancel(self.request_id)

    def done(self) -> bool:
        return self._done.is_set()

    @contextlib.asynccontextmanager
    async def _wake(self) -> AsyncIterator[asyncio.Event]:
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._waiters_lock:
            self._waiters.append(waiter)
        try:
            yield waiter[1]
        finally:
            with self._waiters_lock:
                self._waiters.remove(waiter)

    def _notify(self) -> None:
        wake_waiters([self])

    def _event(self, event: Event, notify: bool = True) -> None:
        """Take ``event``; ``notify=False``: a stream item or an end whose asyncio waiters
        the caller wakes itself (``wake_waiters``), once for all the handles and items of a
        pass, not once per item (each wake is a write to its event loop's pipe)."""
        if isinstance(event, Output):
            self._outputs[event.name] = event.value
        elif isinstance(event, StreamItem):
            self._items.put(event)
            if notify:
                self._notify()
        elif isinstance(event, Finished):
            self._finish(None, notify)
        elif isinstance(event, Failed):
            self._finish(event.error, notify)

    def _finish(self, error: str | None, notify: bool = True) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()
        self._items.put(_END)
        if notify:
            self._notify()


def wake_waiters(handles: Iterable[RequestHandle]) -> None:
    """Wake the asyncio waiters of ``handles``: one call into each event loop among them,
    which sets all its waiters' events. A call is a write to that loop's pipe, a syscall that
    leaves the GIL: one per handle gave the loop's thread the GIL again and again in the
    middle of the pass that woke them (16 streams: 16 writes a pass)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for handle in handles:
        with handle._waiters_lock:
            for loop, event in handle._waiters:
                by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            loop.call_soon_threadsafe(_set_all, events)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
