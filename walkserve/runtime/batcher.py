"""The batching rule: which ready work items leave together, to which rank, and when.

Pure (no sockets, threads or processes); the server calls it with the conductor's ready items
and tells it when a batch comes back; tests call it with fabricated items::

    batches = batcher.batches(conductor.ready(), wanted=conductor.wanted)
    ... send each batch to batch.rank ...
    batcher.returned(batch)                # its reply arrived

Rules:

- node items group by (walk, node, ops, outputs) and rank: one ``RunBatch`` each. A node with
  replicas (``replicas``) sends an item that reads a value held on one of them (an
  ``ObjectRef``: a request's KV cache stays on the replica that made it) to that replica;
  any other item to the least loaded replica: the fewest items and region runs out there
  (those chosen in the same call included, so a crowd of new requests spreads over the
  replicas; not batches, or a replica whose batch returned first would take every held
  item), then the fewest of that node's batches in flight, ties in turn; a dead replica gets none (its requests
  with state there fail, the others go on);
- a KV-cache node whose component runs a batch as one forward (``merging``: PagedLM) has at
  most ``max_inflight`` batches out per rank; its items that become ready meanwhile are held
  and leave together with the next batch when one returns, so requests that fell out of step
  share a forward again. Other nodes' items leave at once: a stateless component costs about
  the same per request batched or not, and a pipeline's stages stay busy;
- region items (``kind="region"``) group by rank: one message starts them all; they are never
  held (the rank batches their steps itself, across requests). A region of replicas goes to
  one of them as a node item would (sticky to held values, else the least loaded: its
  region runs count until ``region_returned``).

Held items that are no longer ``wanted`` (their request was cancelled, their iteration
discarded) are dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from walkserve.lowering.plan import NodePlan, RegionPlan
from walkserve.runtime.conductor import WorkItem
from walkserve.runtime.wirevalues import ObjectRef

__all__ = ["Batch", "Batcher"]


@dataclass(frozen=True)
class Batch:
    """Items that leave together for ``rank``: node items of one node (``kind="node"``), or
    region items (``kind="regions"``, ``node`` empty)."""

    rank: int
    kind: Literal["node", "regions"]
    walk: str
    node: str
    ops: tuple[str, ...]
    outputs: tuple[str, ...]
    items: tuple[WorkItem, ...]


class Batcher:
    """See the module docstring. ``nodes``: every plan node by (walk, node); ``regions``:
    every region by (walk, region name); ``merging``: the (walk, node) keys held back while
    ``max_inflight`` of their batches are out on a rank; ``alive``: whether a rank (a
    replica) may be given new work."""

    def __init__(
        self,
        nodes: Mapping[tuple[str, str], NodePlan],
        regions: Mapping[tuple[str, str], RegionPlan],
        merging: Collection[tuple[str, str]] = (),
        max_inflight: int = 1,
        alive: Callable[[int], bool] = lambda rank: True,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.nodes = nodes
        self.regions = regions
        self.merging = frozenset(merging)
        self.max_inflight = max_inflight
        self.alive = alive
        self.sizes: dict[int, int] = {}  # node batch size -> how many were sent
        self.per_rank: dict[int, int] = {}  # rank -> batches sent there (nodes, region starts)
        self.items_per_rank: dict[int, int] = {}  # rank -> items in them
        self._load: dict[int, int] = {}  # rank -> node items out there (or chosen, this call)
        self._inflight: dict[tuple[int, str, str], int] = {}  # (rank, walk, node) -> batches
        self._held: list[WorkItem] = []
        self._turn = itertools.count()

    @property
    def held(self) -> int:
        return len(self._held)

    def quiet(self) -> bool:
        """Whether no item is out on any rank (no node item, no region item)."""
        return not any(self._load.values())

    def inflight(self, rank: int, walk: str, node: str) -> int:
        return self._inflight.get((rank, walk, node), 0)

    def batches(
        self, ready: Sequence[WorkItem], wanted: Callable[[int], bool] = lambda _: True
    ) -> list[Batch]:
        """The batches to send now, for ``ready`` items and those held before."""
        items = [it for it in self._held if wanted(it.id)] + list(ready)
        self._held = []
        groups: dict[tuple[int, str, str, tuple[str, ...], tuple[str, ...]], list[WorkItem]] = {}
        starts: dict[int, list[WorkItem]] = {}
        for item in items:
            if item.kind == "region":
                starts.setdefault(self._region_rank(item), []).append(item)
                continue
            rank = self._rank(item)
            groups.setdefault((rank, item.walk, item.node, item.ops, item.outputs), []).append(item)
        out = [
            Batch(rank, "regions", "", "", (), (), tuple(group)) for rank, group in starts.items()
        ]
        for rank, group in starts.items():
            self.per_rank[rank] = self.per_rank.get(rank, 0) + 1
            self.items_per_rank[rank] = self.items_per_rank.get(rank, 0) + len(group)
        for (rank, walk, node, ops, outputs), group in groups.items():
            key = (rank, walk, node)
            if (walk, node) in self.merging and self._inflight.get(key, 0) >= self.max_inflight:
                self._held += group
                self._load[rank] -= len(group)
                continue
            self._inflight[key] = self._inflight.get(key, 0) + 1
            self.sizes[len(group)] = self.sizes.get(len(group), 0) + 1
            self.per_rank[rank] = self.per_rank.get(rank, 0) + 1
            self.items_per_rank[rank] = self.items_per_rank.get(rank, 0) + len(group)
            out.append(Batch(rank, "node", walk, node, ops, outputs, tuple(group)))
        return out

    def returned(self, batch: Batch) -> None:
        """``batch``'s reply arrived (or its rank died): one fewer in flight."""
        if batch.kind == "node":
            key = (batch.rank, batch.walk, batch.node)
            self._inflight[key] -= 1
            self._load[batch.rank] -= len(batch.items)

    def region_returned(self, rank: int) -> None:
        """A region item on ``rank`` ended (done, failed or dropped)."""
        self._load[rank] = self._load.get(rank, 1) - 1

    def _region_rank(self, item: WorkItem) -> int:
        region = self.regions[(item.walk, item.node)]
        return self._choose(item, region.ranks, "", "")

    def _rank(self, item: WorkItem) -> int:
        return self._choose(item, self.nodes[(item.walk, item.node)].ranks, item.walk, item.node)

    def _choose(self, item: WorkItem, ranks: Sequence[int], walk: str, node: str) -> int:
        """The item's rank; counted in ``_load`` at once, so that the items of one call
        spread over the replicas."""
        rank = ranks[0] if len(ranks) == 1 else _held_on(item, ranks)  # sticky: state there
        if rank is None:
            ranks = [r for r in ranks if self.alive(r)] or ranks  # a dead replica gets no more
            turn = next(self._turn)  # replicas: the least loaded, ties in turn
            order = [ranks[(turn + k) % len(ranks)] for k in range(len(ranks))]
            rank = min(
                order,
                key=lambda r: (self._load.get(r, 0), self._inflight.get((r, walk, node), 0)),
            )
        self._load[rank] = self._load.get(rank, 0) + 1
        return rank


def _held_on(item: WorkItem, ranks: Sequence[int]) -> int | None:
    """The first of ``ranks`` holding a value ``item`` reads, or None."""
    todo: list[Any] = list(item.env.values())
    if item.call is not None:
        todo += [*item.call[0], *item.call[1].values()]
    while todo:
        value = todo.pop()
        if isinstance(value, ObjectRef):
            if value.rank in ranks:
                return value.rank
        elif isinstance(value, (list, tuple)):
            todo += value
        elif isinstance(value, dict):
            todo += value.values()
    return None
