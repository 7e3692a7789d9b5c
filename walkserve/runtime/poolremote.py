"""The worker pool's ranks beyond this process's spawn: TCP with CURVE for remote ranks
(``net.auth``), a ``RemoteProcess`` standing in for each remote rank's process, the transport
each rank's tensors take (shared memory, inline, Mooncake) and the link probes that measure it
(``measure_link``). ``WorkerPool`` (``runtime.pool``) is a ``RemoteRanks``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import zmq

from walkserve.runtime.config import PoolConfig, routing_id
from walkserve.runtime.messages import (
    Probe,
    ProbeReply,
    encode,
)
from walkserve.runtime.net.link import PROBE_SIZES, LinkModel, fit_link
from walkserve.runtime.net.remote import RemoteProcess
from walkserve.runtime.poolstate import (
    DataPath,
    RankState,
    WorkerError,
)
from walkserve.runtime.transport import (
    Transport,
    shm_handles,
)

log = logging.getLogger("walkserve.pool")


if TYPE_CHECKING:
    from walkserve.runtime.net.auth import ControlGuard


class RemoteRanks:
    """The remote-rank half of ``WorkerPool`` (see the module docstring)."""

    # the pool's state these methods use (set by WorkerPool.__init__)
    config: PoolConfig
    address: str
    _ctx: zmq.Context[zmq.Socket[bytes]]
    _reports: zmq.Socket[bytes]
    _commands: zmq.Socket[bytes]
    _guard: ControlGuard
    _closed: bool
    _probe_ids: Iterator[int]
    _probes: dict[int, threading.Event]
    _transport: Transport
    _remote_transport: Transport
    _remote_data: dict[int, DataPath]

    def _rank(self, rank: int) -> RankState:
        raise NotImplementedError

    def _send(self, state: RankState, data: bytes, *, now: bool = False) -> None:
        raise NotImplementedError

    def _secure_tcp(self, ranks: int) -> tuple[str, tuple[str, str, str]]:
        """Bind both ROUTERs at ``config.bind`` as CURVE servers (``net.auth``); returns the
        command socket's address and the keys of the spawned (local) workers."""
        from walkserve.runtime.net.auth import ControlGuard, KeyPair, ensure_keys
        from walkserve.runtime.net.remote import bind_pair

        assert self.config.bind is not None
        bad = [r for r in self.config.remote_ranks if not 0 <= r < ranks]
        if bad:
            raise ValueError(f"remote_ranks {bad} are not ranks of this pool (0..{ranks - 1})")
        if self.config.keys_dir is not None:
            keys = ensure_keys(self.config.keys_dir, self.config.remote_ranks)
            server, clients = keys.server, list(keys.clients.values())
        else:
            server, clients = KeyPair.generate(), []
        local = KeyPair.generate()
        self._guard = ControlGuard(self._ctx, server, [*clients, local.public])
        self._guard.secure(self._reports, "reports")
        self._guard.secure(self._commands, "commands")
        self.address, commands = bind_pair(self._reports, self._commands, self.config.bind)
        self._guard.start()
        return commands, (server.public, local.public, local.secret)

    def _remote_rank(self, rank: int) -> RankState:
        holder: list[RankState] = []
        process = RemoteProcess(
            rank,
            closing=lambda: self._closed,
            last_seen=lambda: holder[0].last_seen if holder else None,
            dead_after_s=max(self.config.unresponsive_after_s, 3 * self.config.heartbeat_s),
        )
        state = RankState(rank, process, routing_id(rank), pid=None)  # type: ignore[arg-type]
        holder.append(state)
        return state

    def measure_link(
        self, rank: int, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 3
    ) -> LinkModel:
        """Time ``repeats`` round trips per size in ``sizes`` (a tensor to ``rank`` through its
        transport, a short reply back) and fit ``alpha + bytes / beta`` (review eq. 8)."""
        import torch

        transport = self._transport_for(rank)
        state = self._rank(rank)
        samples: list[tuple[int, float]] = []
        for nbytes in sizes:
            tensor = torch.ones(nbytes, dtype=torch.uint8)
            for _ in range(repeats):
                seq = next(self._probe_ids)
                done = self._probes[seq] = threading.Event()
                start = time.perf_counter()
                payload = transport.send(tensor, "probe")
                try:
                    self._send(state, encode(Probe(seq, payload)))
                    if not done.wait(self.config.unresponsive_after_s):
                        raise WorkerError(f"rank {rank} did not answer a link probe", rank)
                    samples.append((nbytes, time.perf_counter() - start))
                finally:
                    self._probes.pop(seq, None)
                    transport.release(shm_handles(payload))
        return fit_link(samples)

    def _on_probe_reply(self, state: RankState, msg: ProbeReply) -> None:
        done = self._probes.get(msg.seq)
        if done is not None:
            done.set()

    @property
    def remote_transport(self) -> Transport:
        """The transport of the remote ranks (``config.remote_data``)."""
        return self._remote_transport

    def _transport_for(self, rank: int) -> Transport:
        """Shared memory within the host; to a remote rank, inline over the control socket
        or Mooncake (``config.remote_data``)."""
        if rank in self.config.remote_ranks and self.remote_data(rank) != "shm":
            return self._remote_transport
        return self._transport

    def remote_data(self, rank: int) -> DataPath:
        """How tensors travel to and from remote rank ``rank``."""
        return self._remote_data.get(rank, self.config.remote_data)

    def set_remote_data(self, rank: int, data: DataPath) -> None:
        """Before remote rank ``rank`` joins: ``shm`` when it turned out to run on this host
        (a launcher knows), else inline or Mooncake (only ``config.remote_data``'s)."""
        if rank not in self.config.remote_ranks:
            raise ValueError(f"rank {rank} is not a remote rank")
        if data not in ("shm", self.config.remote_data):
            raise ValueError(
                f"remote rank {rank} can use 'shm' (same host) or the pool's remote_data "
                f"{self.config.remote_data!r}, not {data!r}"
            )
        self._remote_data[rank] = data
