"""A remote rank's life across its conductor's restarts: the worker side of ``walkserve
worker`` (``net.remote.run_remote_worker`` runs it).

Owns the sessions of one ``walkserve worker`` process. A session is one ``Worker`` with
routing ids of its own (``session_identity``: this pid and the session's number, so a
replacement process, or this one's next session, is never confused with an earlier one by
the conductor's ROUTER); it joins, is set up from the ``WorkerSetup`` the conductor sends
(weights, plan: the rank's state is rebuilt each time), and serves. Unlike a spawned worker
it does not watch its parent process (a shell, ssh or a launcher may come and go): it watches
its connection to the conductor (a ZeroMQ socket monitor, with ZMTP heartbeats so that a
vanished host counts too). When the connection drops, the session ends and the next one
joins again (resending its ``Join`` with a backoff of 0.5 s doubling to 5 s) until the
conductor, restarted or the same one, sets it up, or ``rejoin_timeout_s`` passes (exit 1).
``Shutdown`` ends the process (exit 0). The conductor's side: ``poolremote``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec

from walkserve.runtime.config import WorkerConfig
from walkserve.runtime.worker import Worker

if TYPE_CHECKING:
    import zmq

    from walkserve.runtime.messages import WorkerSetup
    from walkserve.runtime.workerinbox import Commands

log = logging.getLogger("walkserve.net")

JOIN_AGAIN_S = (0.5, 5.0)  # the first wait for a setup before joining again, and the most


def session_identity(pid: int, session: int) -> int:
    """The ``WorkerConfig.generation`` (so the routing id) of session ``session`` of process
    ``pid``: unique per process and session."""
    return (pid << 20) | (session & 0xFFFFF)


class RemoteWorker(Worker):
    """One session of a remote rank (see the module docstring). ``lost``: why it ended when
    the conductor went away (None: it ended by ``Shutdown``, a failed setup, or none)."""

    def __init__(self, rank: int, address: str, config: WorkerConfig) -> None:
        super().__init__(rank, address, config)
        self.lost: str | None = None
        self.joined = False
        self._monitor: zmq.Socket[bytes] | None = None
        self._join_wait = JOIN_AGAIN_S[0]

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        import zmq

        super()._secure(sock)
        beat_ms = max(100, int(self.config.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, beat_ms)  # answered by the conductor's ROUTER
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(10_000, 5 * beat_ms))

    def _join_again_after(self) -> float:
        wait, self._join_wait = self._join_wait, min(2 * self._join_wait, JOIN_AGAIN_S[1])
        return wait

    def _await_setup(self, rx: Commands) -> WorkerSetup | None:
        import zmq

        with self._tx_lock:
            self._monitor = self._tx.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        setup = super()._await_setup(rx)
        self.joined = setup is not None
        return setup

    def _conductor_gone(self) -> bool:
        """The report socket's connection dropped (the conductor's process ended, or its
        host stopped answering the ZMTP heartbeats)."""
        from zmq.utils.monitor import recv_monitor_message

        if self._monitor is None or not self._monitor.poll(0):
            return False
        event = recv_monitor_message(self._monitor)
        self.lost = f"the connection to {self.address} dropped ({event.get('endpoint')!r})"
        log.error("rank %d: %s; this session ends", self.rank, self.lost)
        return True


def run_sessions(
    rank: int, conductor: str, config: WorkerConfig, rejoin_timeout_s: float = 300.0
) -> int:
    """Serve as rank ``rank`` of the conductor at ``conductor`` across its restarts (see
    the module docstring); ``config.setup_timeout_s`` bounds the first join. Returns the
    exit code: 0 after ``Shutdown``, 1 when no conductor set it up in time or its setup
    failed."""
    if rejoin_timeout_s <= 0:
        raise ValueError(f"rejoin_timeout_s must be > 0, got {rejoin_timeout_s}")
    session, give_up_s = 0, config.setup_timeout_s
    while True:
        cfg = msgspec.structs.replace(
            config,
            generation=session_identity(os.getpid(), session),
            setup_timeout_s=give_up_s,
        )
        start = time.monotonic()
        worker = RemoteWorker(rank, conductor, cfg)
        code = worker.run()
        if worker.lost is not None:
            session, give_up_s = session + 1, rejoin_timeout_s
            log.warning(
                "rank %d: joining %s again (giving up after %.0f s)", rank, conductor, give_up_s
            )
            continue
        if not worker.joined and time.monotonic() - start >= give_up_s:
            log.error("rank %d: no conductor set this rank up within %.0f s", rank, give_up_s)
            return 1
        return code


__all__ = ["RemoteWorker", "run_sessions", "session_identity"]
