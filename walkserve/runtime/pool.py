"""The server's side of the worker processes: start them, dispatch work, watch, stop.

Owns the worker processes, the ROUTER sockets they connect to, the conductor's shared-memory
pool (inputs it sends) and the reads of the workers' pools (outputs it receives). What crosses
its boundary: typed messages (``messages``), tensor bytes in shared memory; never pickle (the
child gets only ``rank``, the socket address and a JSON config string as spawn arguments;
everything else goes over ZeroMQ after start-up)::

    with WorkerPool("example-cfg-image", 0, captured, plan, ranks=2) as pool:
        fut = pool.submit_batch(1, "generate", "decoder", [(item, request_id, {name: value})])
        fut.result().outputs[item]     # {name: value}: tensors, scalars, None, ObjectRef
        pool.health()                  # {rank: RankHealth}

Sockets: two ROUTERs bound in a private temporary directory (``ipc://``; or on 127.0.0.1).
Workers report on *reports* and are commanded on *commands*; each worker connects one DEALER
to each. Threads in the conductor process:

    callers     submit_batch (``poolbatches``): encode the inputs (small tensors inline, large ones written
                into the conductor's pool), register a future, send RunBatch on *commands*
                (shared under a lock; nobody reads it)
    io thread   (``poolio``, which ``WorkerPool`` extends) owns *reports*: receives every
                worker message and dispatches it by type (a table), and polls every worker's
                ``Process.sentinel``, so a dead worker is noticed at once, not at a heartbeat
                timeout; after each read, the server's conductor pass (``on_io_pass``)

A reply's tensors are copied out of the worker's pool on the io thread and acked at once;
futures complete on the io thread (callbacks added to them should not block). Input slots are
released when the worker acks them, and at the latest when its reply (or its death) arrives.

A rank's start handshake (``Join`` -> ``WorkerSetup``, ``AttachPools``, ``Hello``) and its end
are ``poolranks``'s (which ``WorkerPool`` extends). A dead worker: its in-flight futures fail with ``WorkerDied`` naming the rank, the input slots
it held are released, its pool's segments are unlinked (a killed process cannot); the other
ranks keep serving. Supervision (``pool.supervision``: ``poolsupervision`` acting on the
policy of ``supervisor``, set by ``PoolConfig.supervision``): a ready rank silent past
``hang_deadline_s`` is killed (SIGKILL) and dies the same way, its error saying it hung. A
dead spawned rank is started again with the same ``WorkerSetup`` (weights, plan; a fresh KV
pool and output pool), one generation later: its sockets' routing id names the
generation, so a stale process (SIGCONT of a stopped one) is not heard. While it restarts,
commands for it wait (``RankState.backlog``) and go out on its Hello; a crash loop ends in
``failed`` (``health()``), and then what waited fails. In-flight requests are not retried.
``close()`` sends ``Shutdown``, waits ``stop_timeout_s``, kills what is left, reaps every
process (no zombies) and removes its sockets' directory.

Beyond one host (``runtime.net``; ``poolremote``, which ``WorkerPool`` extends): with ``PoolConfig.bind`` both ROUTERs listen on TCP as
CURVE servers admitting only known keys; ``remote_ranks`` are not spawned but awaited (a
``RemoteProcess`` stands in for their process: given up when silent too long, and a new
process's Join is then the rank's restart), their tensors
travel inline, through Mooncake or (same host, ``set_remote_data``) shared memory, and the
link to each is measured at start-up (``links``, ``measure_link``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from walkserve.capture.model import CapturedModel
from walkserve.capture.serialize import to_json as ir_to_json
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.config import (
    PoolConfig,
    WorkerConfig,
    default_threads,
    routing_id,
)
from walkserve.runtime.messages import (
    Cancel,
    KVStats,
    Shutdown,
    TPJoin,
    Wake,
    encode,
)
from walkserve.runtime.net.link import LinkModel
from walkserve.runtime.net.remote import INLINE_ALL
from walkserve.runtime.poolio import IoLoop
from walkserve.runtime.poolregions import RegionTraffic
from walkserve.runtime.poolstate import (
    GONE,
    BatchError,
    BatchResult,
    DataPath,
    Item,
    Pending,
    RankHealth,
    RankState,
    WorkerDied,
    WorkerError,
    WorkerPoolClosed,
    WorkerStartError,
    fail_future,
    reap,
    sweep_stale_dirs,
)
from walkserve.runtime.poolsupervision import RankSupervision
from walkserve.runtime.shm import (
    PoolStats,
    ShmPool,
)
from walkserve.runtime.shmreader import ShmReader
from walkserve.runtime.transport import (
    ShmTransport,
    Token,
    Transport,
)
from walkserve.runtime.worker import worker_main

log = logging.getLogger("walkserve.pool")
_WAKE = encode(Wake())


class WorkerPool(IoLoop):
    """One spawned worker process per rank (see the module docstring). ``threads``: torch
    threads per worker, default ``config.default_threads(ranks)`` ((cores - 1) // ranks, >= 1)."""

    def __init__(
        self,
        model_name: str,
        seed: int,
        captured: CapturedModel,
        plan: ExecutablePlan,
        ranks: int,
        threads: int | None = None,
        config: PoolConfig | None = None,
        on_listening: Callable[[WorkerPool], None] | None = None,
        *,
        speculate: bool = True,
        stream_buffer_limit: int = 64,
        hold: bool = False,
    ) -> None:
        """``on_listening(pool)``: called once the control sockets are bound (``pool.address``)
        and before waiting for the workers; a launcher of remote ranks starts them there.
        ``speculate``, ``stream_buffer_limit``: the rank schedulers' (``rankscheduler``).
        ``hold``: workers keep the values whose bytes the plan's conductor does not need
        (``ExecutablePlan.conductor_values``) and report handles; without it every output
        comes back whole (a caller of ``submit_batch`` that reads the values itself)."""
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        for walk in plan.walks:
            for node in plan.nodes(walk):
                bad = [r for r in node.ranks if not 0 <= r < ranks]
                if bad:
                    raise ValueError(
                        f"node {walk}:{node.name} is placed on ranks {bad}, but the pool has "
                        f"ranks 0..{ranks - 1}"
                    )
        self.config = config or PoolConfig()
        self.threads = threads if threads is not None else default_threads(ranks)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self._model = (model_name, seed, ir_to_json(captured.graph), plan.to_json())
        self._rendezvous: Any = None  # runtime.tp.group.Rendezvous, with TP groups
        self._tp: dict[int, TPJoin] = {}
        if plan.tp_groups:
            self._tp = self._tp_joins(plan)
        self._scheduling = (speculate, stream_buffer_limit)
        # the ranks work is sent to (a TP group's leader, not its followers): ``wake``'s
        self._working = frozenset(r for w in plan.walks for n in plan.nodes(w) for r in n.ranks)
        self.hold = hold
        self.regions = RegionTraffic(self)
        self._open_io()
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._handle_batch: dict[Token, int] = {}
        self._batch_ids = itertools.count()
        self._closed = False
        self._tmpdir: str | None = None
        self._ranks: dict[int, RankState] = {}
        self._ctx = zmq.Context()
        self._on_listening = on_listening
        self._remote_data: dict[int, DataPath] = {}  # remote rank -> data path, when not config's
        self.supervision = RankSupervision(self)
        self._serving = False  # every rank started once: from now on a dead one restarts
        try:
            self._start(ranks)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up

    def _start(self, ranks: int) -> None:
        # Two ROUTERs: workers report on one (the io thread's alone) and are commanded on the
        # other (any thread, under _send_lock; never read), so a caller's RunBatch goes out
        # on the caller's own thread instead of waking the io thread.
        self._reports = self._ctx.socket(zmq.ROUTER)
        self._reports.setsockopt(zmq.LINGER, 0)
        self._commands = self._ctx.socket(zmq.ROUTER)
        self._commands.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable: an error, not a drop
        self._commands.setsockopt(zmq.LINGER, 0)
        self._send_lock = threading.Lock()
        curve = ("", "", "")  # server public, worker public, worker secret (Z85)
        if (self.config.address == "ipc" or self.config.bind is not None) and zmq.has("ipc"):
            # the sockets of this host's processes: the spawned ranks' peer sockets, and
            # without ``bind`` the conductor's own; mode 0700: ours alone; the pid in its name
            # lets a later server sweep it
            sweep_stale_dirs(tempfile.gettempdir())  # of servers that were killed
            self._tmpdir = tempfile.mkdtemp(prefix=f"walkserve-{os.getpid()}-")
            weakref.finalize(self, shutil.rmtree, self._tmpdir, True)  # if never closed
        if self.config.bind is not None:
            commands, curve = self._secure_tcp(ranks)
        elif self._tmpdir is not None:
            self.address = f"ipc://{self._tmpdir}/reports"
            self._reports.bind(self.address)
            commands = f"ipc://{self._tmpdir}/commands"
            self._commands.bind(commands)
        else:
            port = self._reports.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
            port = self._commands.bind_to_random_port("tcp://127.0.0.1")
            commands = f"tcp://127.0.0.1:{port}"
        link = self._open_links(self._tmpdir if self.config.bind is None else None)
        worker_config = WorkerConfig.of_pool(
            self.config, self.threads, commands, curve, ranks, link
        )
        self._setups_due: dict[int, bytes] = {}  # rank -> WorkerSetup not yet routable

        self._shm = ShmPool(self.config.shm)
        self._reader = ShmReader()
        self._transport = ShmTransport(
            self._shm, self._reader, inline_max_bytes=self.config.inline_max_bytes
        )
        self._remote_transport: Transport = ShmTransport(
            self._shm, self._reader, inline_max_bytes=INLINE_ALL
        )
        if self._exchange() == "mooncake":
            from walkserve.runtime.net.mooncake import (
                MooncakeConfig,
                MooncakeEngine,
                MooncakeTransport,
            )

            engine = MooncakeEngine(MooncakeConfig(host=self._exchange_host()))
            self._remote_transport = MooncakeTransport(
                engine, inline_max_bytes=self.config.inline_max_bytes
            )
        self._worker_config = worker_config
        for rank in range(ranks):
            if rank in self.config.remote_ranks:
                self._ranks[rank] = self._remote_rank(rank)
                continue
            process = self._spawn(rank, 0)
            self._ranks[rank] = RankState(rank, process, routing_id(rank), pid=process.pid)
        self._by_identity = {r.identity: r for r in self._ranks.values()}
        self._probes: dict[int, threading.Event] = {}
        self._probe_ids = itertools.count()
        self.links: dict[int, LinkModel] = {}  # remote rank -> measured at start-up
        self._start_io()
        if self._on_listening is not None:
            self._on_listening(self)

        deadline = time.monotonic() + self.config.start_timeout_s
        for state in self._ranks.values():
            state.settled.wait(max(0.0, deadline - time.monotonic()))
        failed = [s for s in self._ranks.values() if s.status != "ready"]
        if failed:
            reasons = "; ".join(f"rank {s.rank}: {self._start_failure(s)}" for s in failed)
            raise WorkerStartError(f"workers did not start: {reasons}", failed[0].rank)
        self._serving = True
        for rank in self.config.remote_ranks:
            self.links[rank] = self.measure_link(rank)
            log.info("link to remote rank %d: %s", rank, self.links[rank])

    def _spawn(self, rank: int, generation: int) -> BaseProcess:
        config = msgspec.structs.replace(self._worker_config, generation=generation)
        process = mp.get_context("spawn").Process(
            target=worker_main,
            args=(rank, self.address, config.to_json()),
            name=f"walkserve-worker-{rank}",
            daemon=True,
        )
        process.start()
        return process

    # ------------------------------------------------------------------ public API

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def serving(self, rank: int) -> bool:
        """Whether ``rank`` can take work: alive, and so is every rank of its TP group."""
        group = self._tp[rank].ranks if rank in self._tp else [rank]
        return all(self._ranks[r].status not in ("dead", "closed", "failed") for r in group)

    def pid(self, rank: int) -> int | None:
        return self._rank(rank).pid

    @property
    def shm_pool_id(self) -> str:
        """The id of the conductor's pool (the inputs it sends)."""
        return self._shm.pool_id

    def shm_stats(self) -> PoolStats:
        """Slots of the conductor's pool: ``in_use`` are inputs not yet released."""
        return self._shm.stats()

    def release_request(self, request_id: str) -> None:
        """Tell every live worker that ``request_id`` is over (finished, failed or cancelled):
        each drops the objects it keeps for it (a KV cache), which frees their memory."""
        self.release_requests([request_id])

    def release_requests(self, request_ids: list[str]) -> None:
        """``release_request`` for several requests, in one message per worker."""
        if not request_ids:
            return
        data = encode(Cancel(request_ids))
        with self._lock:
            live = [s for s in self._ranks.values() if s.status not in GONE]
        for state in live:
            with contextlib.suppress(zmq.ZMQError):  # a dead worker holds nothing any more
                self._send(state, data)

    def wake(self) -> None:
        """Tell every ready rank that work is sent to and that may sleep (no work of it in
        flight, and its last command or report older than its idle spin) that work is on its
        way (``Wake``), so that it wakes while a request is admitted rather than when the work
        reaches it (any thread; cheap when none sleeps). A TP group's followers get no work,
        so no ``Wake`` either; nor does a rank in the middle of a long step or loop.
        On this 2-core VM a rank idle for 20 ms took ~200 us to read a command after it was
        sent, against ~7 us while it spins."""
        spin = self._worker_config.idle_spin_s
        if spin <= 0:  # ranks that never spin sleep again at once: waking them is no use
            return
        now = time.monotonic()
        with self._lock:
            asleep = [
                s
                for r, s in self._ranks.items()
                if r in self._working and s.status == "ready" and now - s.busy_at > spin
            ]
            if asleep:  # quiet for a while, but maybe busy: a long lane reports at its end
                busy = {p.rank for p in self._pending.values()}
                asleep = [
                    s for s in asleep if s.rank not in busy and not self.regions.running(s.rank)
                ]
        for state in asleep:
            with contextlib.suppress(zmq.ZMQError):
                self._send(state, _WAKE)

    def _send(self, state: RankState, data: bytes, *, now: bool = False) -> None:
        """Send a command to ``state``'s process; while the rank restarts it waits in its
        backlog (``now``: its setup and ``Shutdown``, which are for the new process itself)."""
        state.busy_at = time.monotonic()
        with self._send_lock:
            if state.waiting and not now:
                state.backlog.append(data)
                return
            self._write(state, data)

    def health(self) -> dict[int, RankHealth]:
        now = time.monotonic()
        with self._lock:
            in_flight: dict[int, int] = {}
            for p in self._pending.values():
                in_flight[p.rank] = in_flight.get(p.rank, 0) + 1
            out = {}
            for rank, s in sorted(self._ranks.items()):
                seen = None if s.last_seen is None else now - s.last_seen
                status = s.status
                if (
                    status == "ready"
                    and seen is not None
                    and seen > self.config.unresponsive_after_s
                ):
                    status = "unresponsive"
                pool_id = None if s.spec is None else s.spec.pool_id
                out[rank] = RankHealth(
                    rank,
                    s.pid,
                    status,
                    s.exitcode,
                    seen,
                    in_flight.get(rank, 0),
                    s.error,
                    pool_id,
                    s.generation,
                )
            return out

    def close(self) -> None:
        """Shut every worker down (``Shutdown``, then a kill after ``stop_timeout_s``), fail
        the batches still in flight with ``WorkerPoolClosed``, release everything. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for s in self._ranks.values():
            if s.status not in GONE and hasattr(self, "_commands"):
                with contextlib.suppress(zmq.ZMQError):
                    self._send(s, encode(Shutdown()), now=True)
        deadline = time.monotonic() + self.config.stop_timeout_s
        for s in self._ranks.values():
            reap(s.process, deadline - time.monotonic())
        for s in self._ranks.values():
            if s.process.exitcode is None:
                log.warning("worker rank %d did not stop in time; killing it", s.rank)
                s.process.kill()
                reap(s.process, 5.0)
        self._stop_io()
        self._close_links()
        for s in self._ranks.values():  # one started again while the pool closed
            with contextlib.suppress(ValueError):
                if s.process.exitcode is None:
                    s.process.kill()
                    reap(s.process, 5.0)
        for s in self._ranks.values():
            self._on_exit(s, closing=True)
            with contextlib.suppress(ValueError):
                s.process.close()
        with self._lock:
            pending, self._pending = self._pending, {}
        for batch, p in pending.items():
            fail_future(
                p.future, WorkerPoolClosed(f"the pool closed with batch {batch} in flight", p.rank)
            )
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.close()
        for name in ("_wake", "_wake_rx", "_reports", "_commands"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        self._nudge.close()
        for name in ("_shm", "_reader"):
            resource = getattr(self, name, None)
            if resource is not None:
                resource.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        if self._rendezvous is not None:
            self._rendezvous.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rank(self, rank: int) -> RankState:
        state = self._ranks.get(rank)
        if state is None:
            raise ValueError(f"no rank {rank}; the pool has ranks {self.ranks}")
        return state

    def kv_stats(self) -> dict[int, list[KVStats]]:
        """Every rank's paged KV pools, as of its last heartbeat (``heartbeat_s`` old at most)."""
        with self._lock:
            return {rank: list(s.kv) for rank, s in sorted(self._ranks.items())}


__all__ = [
    "BatchError",
    "BatchResult",
    "Item",
    "PoolConfig",
    "RankHealth",
    "WorkerDied",
    "WorkerError",
    "WorkerPool",
    "WorkerPoolClosed",
    "WorkerStartError",
]
