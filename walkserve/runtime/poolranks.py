"""A rank's life as the pool sees it, from its start handshake to its end (``pool.WorkerPool``
is a ``RankLife``)::

    Join(rank, pid)      -> _on_join: WorkerSetup (model source, seed, IR, plan, the pool's
                            shared memory, data path, scheduling, peer sockets, TP join),
                            sent once the rank's command socket is routable
    AttachPools([spec])  -> _on_attach: the rank's output pool, read from now on
    Hello(rank, pid)     -> _on_hello: ready; commands that waited for a restart go first
    Fatal(error)         -> _on_fatal: why it will not start (its exit follows)
    process ended        -> _on_exit: closed (clean) or dead; what it held freed, its batches
                            and region runs failed, then (dead, serving) supervision restarts it
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Literal

import zmq

from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.messages import AttachPools, Fatal, Hello, Join, TPJoin, WorkerSetup, encode
from walkserve.runtime.poollinks import PoolLinks
from walkserve.runtime.poolstate import (
    GONE,
    RankState,
    WorkerDied,
    WorkerError,
    WorkerPoolClosed,
    describe_exit,
    fail_future,
    reap,
    unlink_segments,
)
from walkserve.runtime.shm import ShmPool

__all__ = ["RankLife"]

log = logging.getLogger("walkserve.pool")


class RankLife(PoolLinks):
    """The start handshake and the end of every rank (see the module docstring)."""

    # the pool's state these handlers use (set by WorkerPool)
    hold: bool
    _model: tuple[str, int, str, str]
    _scheduling: tuple[bool, int]
    _shm: ShmPool
    _tp: dict[int, TPJoin]
    _rendezvous: Any
    _tmpdir: str | None
    _serving: bool
    _setups_due: dict[int, bytes]

    def _tp_joins(self, plan: ExecutablePlan) -> dict[int, TPJoin]:
        """The rendezvous of the plan's TP groups (a TCP store this process binds on a free
        port of 127.0.0.1, held until ``close``) and each member rank's ``TPJoin``."""
        from walkserve.runtime.tp.group import Rendezvous, TPGroupSpec

        if self.config.remote_ranks:
            raise ValueError("tensor-parallel groups run on this host's ranks only")
        self._rendezvous = Rendezvous.tcp(timeout_s=self.config.start_timeout_s)
        joins = {}
        for group in plan.tp_groups:
            spec = TPGroupSpec(tuple(group.ranks))
            for rank in group.ranks:
                device = f"cuda:{rank}" if plan.device.startswith("cuda") else "cpu"
                setup = self._rendezvous.setup(spec, rank, device, self.config.start_timeout_s)
                joins[rank] = TPJoin(
                    list(setup.ranks),
                    setup.rank,
                    setup.store,
                    setup.address,
                    setup.backend,
                    setup.device,
                    setup.timeout_s,
                    list(group.components),
                )
        return joins

    def _start_failure(self, state: RankState) -> str:
        if state.error is not None:
            return state.error
        if state.status == "dead":
            return f"the process exited ({describe_exit(state.exitcode)})"
        return f"no Hello within {self.config.start_timeout_s:.0f} s"

    def _send_setup(self, state: RankState, setup: bytes) -> None:
        """Send a worker its setup once its command socket is connected (its ``Join`` came
        over the other one, so it may not be yet)."""
        try:
            self._send(state, setup, now=True)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._setups_due[state.rank] = setup
        else:
            self._setups_due.pop(state.rank, None)

    def _on_join(self, state: RankState, msg: Join) -> None:
        if state.rank in self.config.remote_ranks and self._remote_joined(state, msg):
            return  # a Join it sent again before its setup reached it (``rejoin``)
        if msg.pid != state.process.pid:
            log.warning("rank %d: Join from pid %d, expected %s", state.rank, msg.pid, state.pid)
            return
        model, seed, ir, plan = self._model
        remote = state.rank in self.config.remote_ranks
        data = self.remote_data(state.rank) if remote else "shm"
        speculate, limit = self._scheduling
        exchange = self._exchange()
        setup = WorkerSetup(
            model,
            seed,
            ir,
            plan,
            state.rank,
            self._shm.spec,
            data,
            speculate,
            limit,
            {} if remote else self._peers(),
            self.passes_rank_to_rank(),
            tp=self._tp.get(state.rank),
            exchange=exchange,
            exchange_host=self._exchange_host(),
        )
        self._send_setup(state, encode(setup))

    def _peers(self) -> dict[int, str]:
        """The peer socket of every rank this process spawned (they share this host and its
        private directory)."""
        from walkserve.runtime.peers import peer_address

        if self._tmpdir is None:
            return {}
        local = [r for r in self._ranks if r not in self.config.remote_ranks]
        return {r: peer_address(self._tmpdir, r) for r in local}

    def _exchange(self) -> Literal["", "mooncake"]:
        """How held values reach ranks on other hosts: ``mooncake`` when tensors to and from
        them travel through Mooncake (each rank exports what it holds and pulls the others'),
        else none (``""``: with ranks on other hosts, nothing is held then, and values go
        through this process)."""
        remote = self.config.remote_ranks
        return "mooncake" if remote and self.config.remote_data == "mooncake" else ""

    def _exchange_host(self) -> str:
        """Where a Mooncake engine of this host listens (this process's, its spawned
        workers'): the bind address's host (``PoolConfig`` checked it is ``tcp://``)."""
        from walkserve.runtime.net.remote import parse_tcp

        bind = self.config.bind
        return parse_tcp(bind)[0] if bind is not None else "127.0.0.1"

    def passes_rank_to_rank(self) -> bool:
        """Whether every rank holds what it makes and its readers pull it from there, on other
        hosts too (``_exchange``), rather than the values of remote ranks going through this
        process."""
        return self.hold and (self._exchange() != "" or not self.config.remote_ranks)

    def _on_attach(self, state: RankState, msg: AttachPools) -> None:
        if len(msg.pools) != 1 or state.spec is not None:
            log.warning("rank %d: unexpected AttachPools", state.rank)
            return
        state.spec = msg.pools[0]
        self._reader.add(state.spec)

    def _on_hello(self, state: RankState, msg: Hello) -> None:
        if msg.pid != state.process.pid or state.spec is None:
            log.warning("rank %d: unexpected Hello", state.rank)
            return
        with self._send_lock:  # what waited for a restarted rank goes first, in order
            with self._lock:
                state.status = "ready"
                if state.generation > 0:
                    state.error = None
            backlog, state.backlog = state.backlog, []
            for data in backlog:
                with contextlib.suppress(zmq.ZMQError):
                    self._write(state, data)
        if state.generation > 0:
            log.warning(
                "worker rank %d is back (pid %s, restart %d, %d commands waited)",
                state.rank,
                state.pid,
                state.generation,
                len(backlog),
            )
        state.settled.set()

    def _on_fatal(self, state: RankState, msg: Fatal) -> None:
        state.error = msg.error
        log.error("worker rank %d: %s", state.rank, msg.error)

    def _on_exit(self, state: RankState, closing: bool) -> None:
        """A worker process ended (or the pool closed): settle its state, free what it held,
        then fail its batches (so that whoever sees the failure finds everything released)."""
        if state.status in GONE:
            return
        if state.status == "restarting":  # no process: the pool closed before its restart
            with self._lock:
                state.status = "closed"
            self.supervision.fail_waiting(
                state, f"the pool closed while rank {state.rank} restarted"
            )
            return
        reap(state.process, 5.0)  # no zombie
        with self._send_lock, self._lock:
            if state.status in GONE:
                return
            state.exitcode = state.process.exitcode
            clean = closing and state.exitcode == 0
            state.status = "closed" if clean else "dead"
            if not clean:
                exit_ = describe_exit(state.exitcode)
                killed = None if state.hung is None else f"killed: it {state.hung}"
                state.error = killed or state.error or f"the process exited ({exit_})"
            mine = [b for b, p in self._pending.items() if p.rank == state.rank]
            state.backlog.clear()  # their batches fail below
        self._drop_link(state)
        died = f"died ({describe_exit(state.exitcode)})"
        if state.hung is not None:
            died = f"was killed: it {state.hung}"
        if not clean:
            log.error("worker rank %d %s", state.rank, died)
            if state.spec is not None and state.rank not in self.config.remote_ranks:
                unlink_segments(state.spec)
        for batch in mine:
            pending = self._take(batch)
            if pending is None:
                continue
            what = f"batch {batch} ({pending.walk}:{pending.node})"
            if clean:
                error: WorkerError = WorkerPoolClosed(
                    f"the pool closed with {what} in flight on rank {state.rank}", state.rank
                )
            else:
                error = WorkerDied(
                    f"worker rank {state.rank} (pid {state.pid}) {died} with {what} in flight",
                    state.rank,
                )
            fail_future(pending.future, error)
        if clean:
            self.regions.fail_rank(
                state.rank, f"the pool closed with region runs on rank {state.rank}"
            )
        else:
            self.regions.fail_rank(state.rank, f"worker rank {state.rank} (pid {state.pid}) {died}")
        state.settled.set()
        if (
            not clean
            and not closing
            and self._serving
            and state.rank not in self.config.remote_ranks
        ):
            self.supervision.after_death(state)
