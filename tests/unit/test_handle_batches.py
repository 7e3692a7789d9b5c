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
