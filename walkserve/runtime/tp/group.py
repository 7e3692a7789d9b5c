"""Tensor-parallel process groups: where the ranks of a group meet, the ``torch.distributed``
groups they then share, and their teardown.

Owns ``tp_groups`` (the groups a ``Placement`` asks for), ``Rendezvous`` (the meeting point,
made and held by the server: a ``TCPStore`` on a free port of 127.0.0.1 that the server itself
binds, or a ``FileStore`` in a private temporary directory), ``TPSetup`` (what one worker rank
is told: a msgspec struct, so it travels in a typed setup message) and ``TPGroup`` (one rank's
membership, a context manager). What crosses the boundary: a ``Placement`` in; ``TPSetup``
values out to the workers; in each worker a ``TPGroup`` whose ``device_group`` carries the
model's collectives and whose ``cpu_group`` carries control messages (``runner.py``).

One group is one ``torch.distributed`` world::

    server                              worker rank 2            worker rank 3
    groups = tp_groups(placement)       (group rank 0)           (group rank 1)
      -> [TPGroupSpec(ranks=(2, 3))]
    rdv = Rendezvous.tcp()  ----------> TPGroup.join(setup)      TPGroup.join(setup)
      (binds 127.0.0.1:<free port>)        init_process_group(store=PrefixStore("tp/2-3/", ...),
    rdv.setup(spec, 2) / (spec, 3)                            rank=group rank, world_size=2)
    ...                                 group.close()            group.close()
    rdv.close()                            destroy_process_group()

The default process group of a worker is its TP group (its world is the group's ranks, not
every worker): transformers' tensor-parallel loader builds its device mesh over the default
group, and a dead rank then breaks only its own group. Hence a worker rank belongs to at most
one TP group: several components may share one group (same ranks), but two groups with
different rank sets may not overlap (``tp_groups`` refuses it).

Backends: gloo on CPU; NCCL on CUDA for the model's collectives, with a second gloo group
over the same ranks for control messages (bytes on the host; NCCL moves device tensors).
Every collective has ``timeout_s``: a rank whose peer died gets an error, not a hang (gloo
usually reports a closed peer at once).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from walkserve.lowering.placement import Placement

__all__ = ["Rendezvous", "TPGroup", "TPGroupSpec", "TPSetup", "tp_groups"]

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TPGroupSpec:
    """The worker ranks of one TP group, in group-rank order (``ranks[0]`` is the leader: the
    rank the conductor dispatches to and whose results come back)."""

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) < 2 or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a TP group needs two or more distinct ranks, got {self.ranks}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def key(self) -> str:
        """The group's name in the rendezvous store: ``"tp/2-3/"``."""
        return "tp/" + "-".join(map(str, self.ranks)) + "/"

    def group_rank(self, rank: int) -> int:
        return self.ranks.index(rank)


def tp_groups(placement: Placement) -> list[TPGroupSpec]:
    """The TP groups of ``placement`` (``Placement.tp_groups``) as specs. Raises
    ``PlacementError`` when a rank would be in two different groups."""
    return [TPGroupSpec(ranks) for ranks in placement.tp_groups()]


Backend = Literal["gloo", "nccl"]


class TPSetup(msgspec.Struct, frozen=True):
    """What one worker rank needs to join its group: ``ranks`` (the group's worker ranks),
    ``rank`` (this worker's), the store (``store="tcp"``: ``address`` is ``host:port``;
    ``"file"``: a path), the model collectives' ``backend`` and ``device`` ("cpu", "cuda:1")."""

    ranks: tuple[int, ...]
    rank: int
    store: Literal["tcp", "file"]
    address: str
    backend: Backend = "gloo"
    device: str = "cpu"
    timeout_s: float = 60.0

    @property
    def spec(self) -> TPGroupSpec:
        return TPGroupSpec(self.ranks)


@dataclass
class Rendezvous:
    """The meeting point of every TP group of one server; the server makes it, hands each
    worker rank ``setup(spec, rank)`` and closes it at shutdown.

    ``tcp()``: the server binds a ``TCPStore`` on a free port of 127.0.0.1 and keeps it open
    (no other process can take the port between choosing and using it; workers connect as
    clients). ``file(dir)``: a ``FileStore`` per group in a fresh 0700 directory of the
    server's own (removed by ``close``)."""

    store: Literal["tcp", "file"]
    address: str
    _tcp: dist.TCPStore | None = field(default=None, repr=False)
    _dir: str | None = field(default=None, repr=False)

    @classmethod
    def tcp(cls, timeout_s: float = 60.0) -> Rendezvous:
        master = dist.TCPStore(
            LOOPBACK,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        return cls("tcp", f"{LOOPBACK}:{master.port}", _tcp=master)

    @classmethod
    def file(cls, parent: str | None = None) -> Rendezvous:
        path = tempfile.mkdtemp(prefix="walkserve-tp-", dir=parent)  # mode 0700
        return cls("file", path, _dir=path)

    def setup(
        self,
        spec: TPGroupSpec,
        rank: int,
        device: str = "cpu",
        timeout_s: float = 60.0,
    ) -> TPSetup:
        """The ``TPSetup`` of worker ``rank`` in ``spec``; NCCL when ``device`` is CUDA."""
        if rank not in spec.ranks:
            raise ValueError(f"rank {rank} is not in TP group {list(spec.ranks)}")
        address = self.address
        if self.store == "file":
            address = os.path.join(self.address, spec.key.strip("/").replace("/", "-"))
        backend: Backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        return TPSetup(spec.ranks, rank, self.store, address, backend, device, timeout_s)

    def close(self) -> None:
        self._tcp = None  # the master store's socket closes with the object
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TPGroup:
    """One worker rank's membership of its TP group: ``rank`` (its index in the group),
    ``size``, ``device_group`` (the model's collectives), ``cpu_group`` (control bytes).

    ``join`` blocks until every rank of the group has joined (or ``timeout_s`` passes);
    ``close`` destroys the groups (idempotent; also on ``with`` exit)."""

    def __init__(self, setup: TPSetup) -> None:
        self.setup = setup
        self.spec = setup.spec
        self.rank = self.spec.group_rank(setup.rank)
        self.size = self.spec.size
        self.device = torch.device(setup.device)
        self.timeout = timedelta(seconds=setup.timeout_s)
        self.device_group: dist.ProcessGroup | None = None
        self.cpu_group: dist.ProcessGroup | None = None

    @classmethod
    def join(cls, setup: TPSetup) -> TPGroup:
        group = cls(setup)
        group._init()
        return group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _init(self) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process; a worker joins "
                "one TP group (close the other first)"
            )
        store = dist.PrefixStore(self.spec.key, self._store())
        device_id = self.device if self.setup.backend == "nccl" else None
        if device_id is not None:
            torch.cuda.set_device(device_id)
        dist.init_process_group(
            self.setup.backend,
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=self.timeout,
            device_id=device_id,
        )
        self.device_group = dist.group.WORLD
        self.cpu_group = (
            dist.new_group(backend="gloo", timeout=self.timeout)
            if self.setup.backend != "gloo"
            else dist.group.WORLD
        )

    def _store(self) -> dist.Store:
        if self.setup.store == "file":
            return dist.FileStore(self.setup.address, self.size)
        host, _, port = self.setup.address.rpartition(":")
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=self.timeout, wait_for_workers=False
        )

    def close(self) -> None:
        if self.device_group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.device_group = self.cpu_group = None

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TPGroup(ranks={list(self.spec.ranks)}, rank={self.rank}, {self.setup.backend})"
