"""Server-sent events and streamed bodies: ``sse(data)`` frames one JSON event, ``merge`` joins
the event streams of several choices as they come, ``ClosingStream`` runs its cleanup however
the response ends (finished, client gone, cancelled)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from walkserve.api.jsonsafe import dumps

SSE_DONE = b"data: [DONE]\n\n"


def sse(data: Any) -> bytes:
    return b"data: " + dumps(data) + b"\n\n"


async def merge(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The chunks of every stream as they come, each stream's own order kept (the choices of
    an ``n > 1`` completion). The first error ends the merge and is raised."""
    if len(streams) == 1:
        async for data in streams[0]:
            yield data
        return
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue(
        4 * len(streams)
    )

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for data in stream:
                await queue.put((data, None))
            await queue.put((None, None))
        except Exception as e:
            await queue.put((None, e))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class ClosingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (finished, client gone,
    cancelled)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
