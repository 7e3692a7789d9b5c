"""The commands a rank's engine loop takes (``engine.EngineLoop``), and where they come from
(``Inbox``: the worker's sockets, ``workerinbox``). Each is what one message asks of the rank,
its inputs already read (``StartRun``, ``NodeBatch``, ``FeedItems``) or a change to what it
runs (cancel, drop, credit), or a question (``StatsAsk``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "CancelRequest",
    "Command",
    "CreditItems",
    "DropItems",
    "FeedItems",
    "Inbox",
    "NodeBatch",
    "StartRun",
    "Starts",
    "StatsAsk",
]


@dataclass(frozen=True)
class StartRun:
    item: int
    request: str
    walk: str
    region: str
    inputs: dict[str, Any]
    stream: bool = True


@dataclass(frozen=True)
class NodeBatch:
    """A node batch of the conductor's: ``items`` as (item id, request id, inputs by name)."""

    batch: int
    walk: str
    node: str
    items: list[tuple[int, str, dict[str, Any]]]
    ops: list[str] | None
    outputs: list[str] | None


@dataclass(frozen=True)
class CancelRequest:
    request: str


@dataclass(frozen=True)
class DropItems:
    items: list[int]


@dataclass(frozen=True)
class StatsAsk:
    seq: int


@dataclass(frozen=True)
class FeedItems:
    item: int
    stream: str
    pieces: list[Any]
    finished: bool


@dataclass(frozen=True)
class CreditItems:
    item: int
    channel: str
    items: int


@dataclass(frozen=True)
class Starts:
    """The region starts of one message, taken together (``EngineLoop.put_starts``); ``more``:
    more of the same conductor pass follow (``burst``)."""

    runs: list[StartRun]
    more: bool = False


Command = StartRun | NodeBatch | CancelRequest | DropItems | StatsAsk | FeedItems | CreditItems


class Inbox(Protocol):
    """A source of commands that the loop reads on its own thread (``workerinbox``)."""

    def read(self, wait: bool, within_s: float | None = None) -> None:
        """Take what has arrived (its commands reach the loop through ``put``); ``wait``:
        first wait a while for something, at most ``within_s`` when given."""

    def waiting(self) -> bool:
        """Whether something has arrived that ``read`` would take."""
