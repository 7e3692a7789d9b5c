r"""What a rank scheduler (``rankscheduler``) hands its engine and is handed back: the
``Step`` to run and the fast ``Lane``, and its ``Report``\ s (a region's streamed items,
outputs, exit, failure, consumer progress; a conductor's node batch done) and ``RankStats``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from walkserve.runtime.runner import ItemResult, LaneStep, RunItem, Runnable

__all__ = [
    "Lane",
    "NodeBatchDone",
    "RankStats",
    "RegionConsumed",
    "RegionDone",
    "RegionFailed",
    "RegionOutput",
    "RegionStreamed",
    "Report",
    "Step",
]


@dataclass(frozen=True)
class RegionStreamed:
    """Iteration ``index`` of region item ``item``'s streamed channel ``channel`` committed."""

    item: int
    channel: str
    index: int
    value: Any


@dataclass(frozen=True)
class RegionOutput:
    """Outputs of region item ``item`` known before its exit (sent as soon as they exist)."""

    item: int
    outputs: dict[str, Any]


@dataclass(frozen=True)
class RegionDone:
    """Region item ``item`` finished; ``outputs``: the outputs no ``RegionOutput`` brought."""

    item: int
    outputs: dict[str, Any]


@dataclass(frozen=True)
class RegionFailed:
    item: int
    error: str


@dataclass(frozen=True)
class RegionConsumed:
    """Region item ``item`` has received ``received`` pieces of fed stream ``stream`` and
    released its items before ``base`` (``closed``: its consumer loop is done)."""

    item: int
    stream: str
    base: int
    received: int
    closed: bool


@dataclass(frozen=True)
class NodeBatchDone:
    """The conductor's node batch ``batch`` ran: one result per item, in the batch's order."""

    batch: int
    results: list[ItemResult]


Report = RegionStreamed | RegionOutput | RegionDone | RegionFailed | RegionConsumed | NodeBatchDone


@dataclass(frozen=True)
class Lane:
    """The engine's fast lane (``RankScheduler.lane``): one cohort's steps back to back.
    ``steps(run, stop)`` steps it with the runner's lane step ``run`` (``NodeRunner.lane``, for
    ``item``): those steps whose commits change nothing but the cohort in one loop, asking
    ``stop()`` after each (None: it said to stop), then one more, whose result it returns for
    ``commit(result)``; a commit that returns False ends the lane (call ``schedule``). What has
    to be reported is reported as ``update`` reports it, by ``end()`` at the latest: the engine
    calls it whenever it leaves the lane (before ``fail_step`` too), and before anything else
    of the scheduler's."""

    walk: str
    node: str
    item: RunItem  # its ops, outputs and the runs it joins; no call (each step makes its own)
    steps: Callable[[LaneStep, Callable[[], bool]], Any]
    commit: Callable[[Any], bool]  # a step's values (a dict) or the runner's ``ItemResult``
    end: Callable[[], None] = lambda: None

    def step(self) -> Step:
        """The lane as a ``Step`` (``fail_step`` takes it)."""
        return Step(self.walk, self.node, [self.item], None, True)


@dataclass(frozen=True)
class Step:
    """Items of one node to run as one batch; ``external``: the conductor's batch id (a node
    batch it sent), None for items of this rank's region runs; ``loops``: items of simple
    loops the loop stepper runs."""

    walk: str
    node: str
    items: Sequence[Runnable]
    external: int | None = None
    loops: bool = False


@dataclass(frozen=True)
class RankStats:
    runs: int  # region runs live
    live_values: int  # values the runs hold
    speculated_steps: int
    wasted_steps: int
    batch_sizes: Mapping[int, int]  # items per step of region runs -> how many steps
