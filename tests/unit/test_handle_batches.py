"""``RequestHandle.abatches`` (what an SSE route writes at once) and ``astream`` (built on it):
items put by another thread in bursts, with the handle's wakes as a conductor pass makes them
(once per burst), come out in order, none lost or repeated, each batch non-empty, and a burst
put before the consumer looks comes out as one batch."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.conductor import Finished, StreamItem
from walkserve.runtime.handle import RequestHandle


def _items(n: int, at: int = 0) -> list[StreamItem]:
    return [StreamItem("r", "c", at + k, k) for k in range(n)]


def test_a_burst_put_before_the_consumer_looks_is_one_batch() -> None:
    handle = RequestHandle("r", None)  # type: ignore[arg-type]  # abatches needs no server
    for item in _items(5):
        handle._event(item, notify=False)
    handle._event(Finished("r"))

    async def take() -> list[list[StreamItem]]:
        return [batch async for batch in handle.abatches()]

    assert asyncio.run(take()) == [_items(5)]


@settings(max_examples=30, deadline=None)
@given(bursts=st.lists(st.integers(1, 5), min_size=0, max_size=6), single=st.booleans())
def test_items_put_from_another_thread_come_out_in_order_in_batches(
    bursts: list[int], single: bool
) -> None:
    handle = RequestHandle("r", None)  # type: ignore[arg-type]
    sent: list[StreamItem] = []

    async def consume() -> Any:
        loop_started.set()
        if single:
            return [item async for item in handle.astream()]
        return [batch async for batch in handle.abatches()]

    loop_started = threading.Event()

    def produce() -> None:
        loop_started.wait()
        for n in bursts:  # each burst: its items, then one wake, as a pass routes them
            burst = _items(n, len(sent))
            sent.extend(burst)
            for item in burst:
                handle._event(item, notify=False)
            handle._notify()
        handle._event(Finished("r"))

    producer = threading.Thread(target=produce)
    producer.start()
    got = asyncio.run(consume())
    producer.join()
    if single:
        assert got == sent
    else:
        assert all(got) and [item for batch in got for item in batch] == sent


def test_a_pass_wakes_the_waiters_of_many_handles_with_one_call_per_event_loop() -> None:
    """``wake_waiters``: the asyncio waiters of several handles, on two event loops, are woken
    by one ``call_soon_threadsafe`` per loop (each a write to its pipe), which sets them all."""
    from walkserve.runtime.handle import wake_waiters

    class Loop:  # records what a pass asks of it
        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
            self.calls.append((fn, *args))

    loops = [Loop(), Loop()]
    handles = [RequestHandle(f"r{k}", None) for k in range(5)]  # type: ignore[arg-type]
    events: list[tuple[Loop, asyncio.Event]] = []
    for k, handle in enumerate(handles):
        for loop in loops[: 1 + k % 2]:  # every handle on loop 0, the odd ones on loop 1 too
            event = asyncio.Event()
            handle._waiters.append((loop, event))  # type: ignore[arg-type]
            events.append((loop, event))
    wake_waiters(handles)
    assert [len(loop.calls) for loop in loops] == [1, 1]
    for loop in loops:
        fn, *args = loop.calls[0]
        fn(*args)
    assert all(event.is_set() for _, event in events)
    wake_waiters([])  # nothing to wake: no call
    assert [len(loop.calls) for loop in loops] == [1, 1]
