"""Supervision of the worker pool's spawned ranks: the mechanics the policy
(``supervisor``) decides. ``pool.supervision``; runs on the pool's io thread.

Owns the restarts due and what a restarting rank's commands wait in (``RankState.backlog``,
filled by ``WorkerPool._send`` and sent on the new process's Hello). What it does: kills a
ready rank silent past its deadline (SIGKILL; it then dies like any other, ``_on_exit``), and
after a death either schedules a restart (a new process one generation later, the same
``WorkerSetup``; its old identity forgotten, so a stale process is not heard) or gives the
rank up (``failed``: what waited for it fails).
"""

from __future__ import annotations

import contextlib
import logging
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import zmq

from walkserve.runtime.config import routing_id
from walkserve.runtime.poolstate import RankState, WorkerDied, fail_future
from walkserve.runtime.supervisor import GiveUp, Supervisor

if TYPE_CHECKING:
    from walkserve.runtime.pool import WorkerPool

log = logging.getLogger("walkserve.pool")


class RankSupervision:
    """See the module docstring."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.policy = Supervisor(pool.config.supervision)
        self.due: dict[int, float] = {}  # rank -> when to start it again

    def tick(self) -> None:
        """On the io thread: kill the ranks past their deadline (their death does the rest:
        ``_on_exit``), and start again the ones whose restart is due."""
        pool = self.pool
        now = time.monotonic()
        local = (
            []
            if pool._closed
            else [s for s in pool._ranks.values() if s.rank not in pool.config.remote_ranks]
        )
        if any(s.status == "ready" and self.policy.hung(s.last_seen) for s in local):
            # what a rank sent may wait unread (this thread was kept from its reads, by the
            # GIL or a long pass): read it before calling any rank hung
            pool._drain_reports(wait_ms=0)
        for state in local:
            if state.status == "ready" and self.policy.hung(state.last_seen):
                assert state.last_seen is not None
                silent, limit = now - state.last_seen, pool.config.supervision.hang_deadline_s
                self.kill_hung(state, f"sent nothing for {silent:.1f} s (deadline {limit:g} s)")
            elif (
                state.status == "starting"
                and state.generation > 0
                and now - state.started > pool.config.start_timeout_s
            ):
                self.kill_hung(state, f"did not start within {pool.config.start_timeout_s:g} s")
        for rank, due in list(self.due.items()):
            if now >= due:
                del self.due[rank]
                self.restart(pool._ranks[rank])

    def kill_hung(self, state: RankState, why: str) -> None:
        if state.hung is not None:
            return
        state.hung = why
        log.error("worker rank %d (pid %s) %s; killing it", state.rank, state.pid, why)
        with contextlib.suppress(ProcessLookupError, ValueError):
            state.process.kill()  # SIGKILL: a stopped process dies too

    def after_death(self, state: RankState) -> None:
        """A spawned rank died (not at close): schedule its restart, or give it up (restarts
        off, or a rank of a tensor-parallel group: it stays ``dead``, as without
        supervision)."""
        pool = self.pool
        if not pool.config.supervision.restart:
            return
        if state.rank in pool._tp:  # a TP group takes no new member: its ranks stay dead
            log.error(
                "worker rank %d is a member of a tensor-parallel group: not restarted", state.rank
            )
            return
        decision = self.policy.died(state.rank)
        with pool._lock:
            if pool._closed:
                return
            if isinstance(decision, GiveUp):
                state.status = "failed"
                state.error = f"{state.error}; {decision.reason}"
            else:
                state.status = "restarting"
        if isinstance(decision, GiveUp):
            log.critical("worker rank %d failed: %s", state.rank, decision.reason)
            self.fail_waiting(state, f"worker rank {state.rank} failed: {decision.reason}")
            return
        log.warning(
            "restarting worker rank %d in %.1f s (restart %d)",
            state.rank,
            decision.after_s,
            decision.restart,
        )
        self.due[state.rank] = time.monotonic() + decision.after_s

    def restart(self, state: RankState) -> None:
        """Start rank ``state`` again, one generation later (its old identity is forgotten:
        whatever the old process still sends is ignored)."""
        pool = self.pool
        with pool._lock:
            if pool._closed or state.status != "restarting":
                return
        if state.spec is not None:
            pool._reader.forget(state.spec.pool_id)
        with contextlib.suppress(ValueError):
            state.process.close()
        pool._by_identity.pop(state.identity, None)
        generation = state.generation + 1
        try:
            process = pool._spawn(state.rank, generation)
        except Exception as e:
            log.exception("could not start worker rank %d again", state.rank)
            with pool._lock:
                state.status = "failed"
                state.error = f"could not start it again: {e}"
            self.fail_waiting(state, f"worker rank {state.rank} failed: {e}")
            return
        self.adopt(state, process, routing_id(state.rank, generation), generation)

    def adopt(
        self, state: RankState, process: BaseProcess, identity: bytes, generation: int
    ) -> None:
        """Make ``process`` (heard as ``identity``) rank ``state``'s, one generation later: a
        restart, or a remote rank's replacement (``poolremote``)."""
        pool = self.pool
        with pool._send_lock, pool._lock:
            state.process, state.pid, state.generation = process, process.pid, generation
            state.identity = identity
            state.exitcode = state.spec = state.last_seen = state.hung = None
            state.kv = []
            state.started = time.monotonic()
            state.settled.clear()
            state.status = "starting"
        pool._by_identity[state.identity] = state
        pool._sentinels[process.sentinel] = state
        pool._poller.register(process.sentinel, zmq.POLLIN)

    def fail_waiting(self, state: RankState, error: str) -> None:
        """Fail what waited for a rank that will not come back."""
        pool = self.pool
        with pool._send_lock:
            state.backlog.clear()
        with pool._lock:
            mine = [b for b, p in pool._pending.items() if p.rank == state.rank]
        for batch in mine:
            pending = pool._take(batch)
            if pending is not None:
                fail_future(pending.future, WorkerDied(error, state.rank))
        pool.regions.fail_rank(state.rank, error)
