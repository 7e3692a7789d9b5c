"""The worker pool's ranks beyond this process's spawn: TCP with CURVE for remote ranks
(``net.auth``), a ``RemoteProcess`` standing in for each remote rank's process, the transport
each rank's tensors take (shared memory, inline, Mooncake) and the link probes that measure it
(``measure_link``), and the joins of remote processes (``_from_unknown``). ``WorkerPool``
(``runtime.pool``) is a ``RemoteRanks``.

Joins: each session of a ``walkserve worker`` has routing ids of its own (``rejoin``), so its
``Join`` comes from a peer the pool does not know yet. The first one for a rank that has no
process takes the rank. Later, a join for a rank whose process is lost (dead: it exited,
or fell silent past ``RemoteProcess``'s deadline; its in-flight requests failed then) is
that rank's restart: one generation later, the old identity forgotten, and the rank rebuilt
from the ``WorkerSetup`` sent in answer; commands wait for its Hello as for a restarting
spawned rank. A join from the rank's own pid (the process lost its connection and joined
again: its state is gone) is a restart too. A join from another pid while the rank's process
lives is refused (logged; that joiner keeps trying). A process whose session was replaced
that speaks again (SIGCONT of a stopped one) is sent ``Shutdown`` and otherwise ignored."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import zmq

from walkserve.runtime.config import PoolConfig, routing_id, routing_rank
from walkserve.runtime.messages import (
    Join,
    MessageError,
    Probe,
    ProbeReply,
    Shutdown,
    decode,
    encode,
)
from walkserve.runtime.net.link import PROBE_SIZES, LinkModel, fit_link
from walkserve.runtime.net.remote import RemoteProcess
from walkserve.runtime.poolstate import (
    GONE,
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
    from walkserve.runtime.poolsupervision import RankSupervision
    from walkserve.runtime.shmreader import ShmReader


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
    _ranks: dict[int, RankState]
    _by_identity: dict[bytes, RankState]
    _sentinels: dict[int, RankState]
    _poller: zmq.Poller
    _reader: ShmReader
    _send_lock: threading.Lock
    supervision: RankSupervision
    _replaced: dict[bytes, bool]  # identities of replaced sessions -> told to stop yet

    def _rank(self, rank: int) -> RankState:
        raise NotImplementedError

    def _on_join(self, state: RankState, msg: Join) -> None:
        raise NotImplementedError

    def _on_exit(self, state: RankState, closing: bool) -> None:
        raise NotImplementedError

    def _send(self, state: RankState, data: bytes, *, now: bool = False) -> None:
        raise NotImplementedError

    def _secure_tcp(self, ranks: int) -> tuple[str, tuple[str, str, str]]:
        """Bind both ROUTERs at ``config.bind`` as CURVE servers (``net.auth``); returns the
        command socket's address and the keys of the spawned (local) workers."""
        from walkserve.runtime.net.auth import ControlGuard, KeyPair, ensure_keys
        from walkserve.runtime.net.remote import bind_pair

        assert self.config.bind is not None
        self._replaced = {}
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
        process = self._remote_process(rank, holder)
        state = RankState(rank, process, routing_id(rank), pid=None)  # type: ignore[arg-type]
        holder.append(state)
        return state

    def _remote_process(self, rank: int, holder: list[RankState]) -> RemoteProcess:
        return RemoteProcess(
            rank,
            closing=lambda: self._closed,
            last_seen=lambda: holder[0].last_seen if holder else None,
            dead_after_s=max(self.config.unresponsive_after_s, 3 * self.config.heartbeat_s),
            starting=lambda: bool(holder) and holder[0].status == "starting",
            start_timeout_s=self.config.start_timeout_s,
        )

    # ------------------------------------------------------------------ joins (io thread)

    def _from_unknown(self, frames: list[bytes]) -> None:
        """A message from a peer the pool does not know (see the module docstring)."""
        msg = None
        if len(frames) == 2 and self.config.remote_ranks:
            with contextlib.suppress(MessageError):
                msg = decode(frames[1])
        if isinstance(msg, Join) and msg.rank in self.config.remote_ranks:
            self._remote_join(frames[0], msg)
            return
        replaced = getattr(self, "_replaced", {})
        if frames[0] in replaced:
            if not replaced[frames[0]]:
                replaced[frames[0]] = True
                log.warning(
                    "a replaced process of remote rank %d spoke again: telling it to stop",
                    routing_rank(frames[0]),
                )
                with self._send_lock, contextlib.suppress(zmq.ZMQError):
                    self._commands.send_multipart([frames[0], encode(Shutdown())], zmq.NOBLOCK)
            return
        log.warning("ignoring a message from an unknown peer")

    def _remote_join(self, identity: bytes, msg: Join) -> None:
        state = self._ranks[msg.rank]
        if self._closed or state.status in ("closed", "failed"):
            return
        if state.pid is not None and state.status not in GONE and msg.pid != state.pid:
            log.warning(
                "remote rank %d: refused a join from pid %d: pid %d serves the rank (%s); a "
                "replacement is taken once it is lost",
                state.rank,
                msg.pid,
                state.pid,
                state.status,
            )
            return
        if state.pid is None and state.status == "starting":  # the rank's first process
            self._by_identity.pop(state.identity, None)
            state.identity = identity
            self._by_identity[identity] = state
        else:
            self._replace_remote(state, identity, msg.pid)
        state.last_seen = time.monotonic()
        self._on_join(state, msg)

    def _remote_joined(self, state: RankState, msg: Join) -> bool:
        """Note remote rank ``state``'s pid from its ``Join``; True: a Join it sent again."""
        if state.pid is not None:
            return msg.pid == state.pid
        state.pid = msg.pid  # its pid on its host
        if isinstance(state.process, RemoteProcess):
            state.process.pid = msg.pid
        log.info("remote rank %d joined (pid %d)", state.rank, msg.pid)
        return False

    def _replace_remote(self, state: RankState, identity: bytes, pid: int) -> None:
        """Remote rank ``state``'s process is lost (or joined again from scratch): fail what
        it held (as at a death, if that is not done yet), then take ``identity`` as its
        next generation."""
        old = state.process
        assert isinstance(old, RemoteProcess)
        if old.sentinel in self._sentinels:  # not given up yet: the same pid joins again
            self._poller.unregister(old.sentinel)
            del self._sentinels[old.sentinel]
            old.kill()
            state.error = f"pid {pid} joined again (its earlier session's state is gone)"
            self._on_exit(state, closing=False)
        old.close()
        if state.spec is not None:
            self._reader.forget(state.spec.pool_id)
        self._replaced[state.identity] = False  # told to stop yet?
        self._by_identity.pop(state.identity, None)
        holder = [state]
        process = self._remote_process(state.rank, holder)
        self.supervision.adopt(state, process, identity, state.generation + 1)  # type: ignore[arg-type]
        log.warning(
            "remote rank %d: pid %d joins in place of the lost process (restart %d)",
            state.rank,
            pid,
            state.generation,
        )

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
