"""The conductor's side of the worker processes: start them, dispatch batches, watch, stop.

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

    callers     submit_batch: encode the inputs (small tensors inline, large ones written
                into the conductor's pool), register a future, send RunBatch on *commands*
                (shared under a lock; nobody reads it)
    io thread   owns *reports*: receives every worker message and dispatches it by type (a
                table), and polls every worker's ``Process.sentinel``, so a dead worker is
                noticed at once, not at a heartbeat timeout

A reply's tensors are copied out of the worker's pool on the io thread and acked at once;
futures complete on the io thread (callbacks added to them should not block). Input slots are
released when the worker acks them, and at the latest when its reply (or its death) arrives.

A dead worker: its in-flight futures fail with ``WorkerDied`` naming the rank, the input slots
it held are released, its pool's segments are unlinked (a killed process cannot), and
``health()`` reports it ``dead``; the other ranks keep serving. There is no restart yet.
``close()`` sends ``Shutdown``, waits ``stop_timeout_s``, kills what is left, reaps every
process (no zombies) and removes its sockets' directory.

Beyond one host (``runtime.net``): with ``PoolConfig.bind`` both ROUTERs listen on TCP as
CURVE servers admitting only known keys; ``remote_ranks`` are not spawned but awaited (a
``RemoteProcess`` stands in for their process: given up when silent too long), their tensors
travel inline, through Mooncake or (same host, ``set_remote_data``) shared memory, and the
link to each is measured at start-up (``links``, ``measure_link``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import msgspec
import zmq

from walkserve.capture.model import CapturedModel
from walkserve.capture.serialize import to_json as ir_to_json
from walkserve.lowering.plan import ExecutablePlan
from walkserve.runtime.messages import (
    Ack,
    AttachPools,
    BatchDone,
    BatchFailed,
    BatchItem,
    Cancel,
    DropRuns,
    Fatal,
    FeedStream,
    GrantCredit,
    Heartbeat,
    Hello,
    Join,
    KVStats,
    Message,
    MessageError,
    ObjectRef,
    Probe,
    ProbeReply,
    RankStatsReply,
    RegionDone,
    RegionEvent,
    RegionEvents,
    RegionFailed,
    RegionOutput,
    RegionStart,
    RegionStreamed,
    Release,
    RunBatch,
    Shutdown,
    StartRegions,
    StatsQuery,
    Value,
    WorkerSetup,
    decode,
    encode,
)
from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.net.link import PROBE_SIZES, LinkModel, fit_link
from walkserve.runtime.net.remote import INLINE_ALL, RemoteProcess
from walkserve.runtime.shm import (
    PoolStats,
    ShmError,
    ShmPool,
    ShmPoolConfig,
    ShmPoolSpec,
    ShmReader,
)
from walkserve.runtime.transport import (
    INLINE_MAX_BYTES,
    ShmTransport,
    Token,
    Transport,
    TransportError,
    shm_handles,
)
from walkserve.runtime.worker import WorkerConfig, default_threads, routing_id, worker_main

log = logging.getLogger("walkserve.workers")

Item = tuple[int, str, Mapping[str, Any]]  # (item id, request id, {input name: value})
DataPath = Literal["shm", "inline", "mooncake"]  # how tensors reach a worker
Status = Literal["starting", "ready", "unresponsive", "dead", "closed"]


# ------------------------------------------------------------------------------ errors


class WorkerError(RuntimeError):
    """Base of the errors a batch or the pool raises; ``rank`` names the worker."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerStartError(WorkerError):
    """A worker did not come up (it failed its setup, died, or did not say Hello in time)."""


class WorkerDied(WorkerError):
    """The worker running a batch died before replying."""


class BatchError(WorkerError):
    """The node raised on the worker; ``errors`` holds the message of every item."""

    def __init__(self, rank: int, walk: str, node: str, errors: dict[int, str]) -> None:
        first = next(iter(errors.values()), "no items")
        super().__init__(f"batch of {walk}:{node} failed on rank {rank}: {first}", rank)
        self.errors = errors


class WorkerPoolClosed(WorkerError):
    """The pool was closed (before or while a batch ran)."""


# ------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class PoolConfig:
    """``address``: ``"ipc"`` (a socket file in a private temporary directory) or ``"tcp"``
    (127.0.0.1, a free port). ``unresponsive_after_s``: a ready worker silent for this long is
    reported ``unresponsive`` (heartbeats come every ``heartbeat_s``). ``forbid_pickle``: make
    pickle raise inside the workers after their setup. ``shm`` configures this process's pool;
    ``worker_shm_slots_per_class`` the slots per size class of each worker's own pool (which
    holds every node output a worker sends until its reader acks it)."""

    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    address: Literal["ipc", "tcp"] = "ipc"
    heartbeat_s: float = 1.0
    unresponsive_after_s: float = 10.0
    inline_max_bytes: int = INLINE_MAX_BYTES
    shm: ShmPoolConfig = field(default_factory=ShmPoolConfig)
    forbid_pickle: bool = False
    kv_pool_tokens: int | None = None  # paged KV pools (PagedLM): tokens each (None: default)
    kv_page_size: int | None = None
    worker_shm_slots_per_class: int = 8  # each worker's output pool: slots per size class
    # Beyond one host (``runtime.net``): ``bind`` ``tcp://HOST:PORT`` puts both ROUTERs on TCP
    # (reports at PORT, commands at PORT+1; PORT 0: free ports) as CURVE servers that admit
    # only known keys; ``remote_ranks`` are not spawned but awaited (``walkserve worker``),
    # their tensors travel inline (no shared memory between hosts); ``keys_dir`` holds the
    # server's and the remote ranks' key files (made where missing). ``remote_data``: how
    # tensors travel to and from remote ranks: inline in the messages, or Mooncake transfers.
    bind: str | None = None
    remote_ranks: tuple[int, ...] = ()
    keys_dir: str | None = None
    remote_data: Literal["inline", "mooncake"] = "inline"

    def __post_init__(self) -> None:
        if self.kv_page_size is not None and self.kv_page_size < 1:
            raise ValueError(f"kv_page_size must be >= 1, got {self.kv_page_size}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < (self.kv_page_size or 1):
            raise ValueError(
                f"kv_pool_tokens must hold at least one page, got {self.kv_pool_tokens}"
            )
        for name in ("start_timeout_s", "stop_timeout_s", "heartbeat_s", "unresponsive_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.address not in ("ipc", "tcp"):
            raise ValueError(f"address must be 'ipc' or 'tcp', got {self.address!r}")
        if self.inline_max_bytes < 0:
            raise ValueError(f"inline_max_bytes must be >= 0, got {self.inline_max_bytes}")
        if self.worker_shm_slots_per_class < 1:
            raise ValueError(
                f"worker_shm_slots_per_class must be >= 1, got {self.worker_shm_slots_per_class}"
            )
        if self.bind is not None:
            from walkserve.runtime.net.remote import parse_tcp

            parse_tcp(self.bind)
        if self.remote_data not in ("inline", "mooncake"):
            raise ValueError(
                f"remote_data must be 'inline' or 'mooncake', got {self.remote_data!r}"
            )
        if self.remote_ranks and (self.bind is None or self.keys_dir is None):
            raise ValueError(
                "remote_ranks need bind='tcp://HOST:PORT' (where remote workers connect) and "
                "keys_dir (where their CURVE keys are written)"
            )


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class BatchResult:
    """What a batch produced: per item id, the node's outputs by name (``NodeIO.outputs``)."""

    rank: int
    walk: str
    node: str
    outputs: dict[int, dict[str, Any]]
    deferred: frozenset[int] = frozenset()  # items to send again later (no memory for them)
    errors: Mapping[int, str] = field(default_factory=dict)  # items that failed, alone


@dataclass(frozen=True)
class RankHealth:
    rank: int
    pid: int | None
    status: Status
    exitcode: int | None  # negative: killed by that signal
    last_seen_s: float | None  # seconds since its last message
    in_flight: int  # batches sent and not answered
    error: str | None
    shm_pool: str | None  # pool id of its output pool (segments ``wsp_<id>_<i>``)


@dataclass(eq=False)
class _Pending:
    rank: int
    walk: str
    node: str
    items: list[int]
    future: Future[BatchResult]
    handles: set[Token]  # input slots the worker has not acked yet
    requests: dict[int, str] = field(default_factory=dict)  # item -> request


@dataclass(eq=False)
class _Rank:
    rank: int
    process: BaseProcess
    identity: bytes
    status: Status = "starting"
    pid: int | None = None
    exitcode: int | None = None
    error: str | None = None
    last_seen: float | None = None
    spec: ShmPoolSpec | None = None
    kv: list[KVStats] = field(default_factory=list)  # from its last heartbeat
    settled: threading.Event = field(default_factory=threading.Event)  # ready, or never will be


# -------------------------------------------------------------------------------- pool


class WorkerPool:
    """One spawned worker process per rank (see the module docstring). ``threads``: torch
    threads per worker, default ``worker.default_threads(ranks)`` (cores // ranks, >= 1)."""

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
        self._scheduling = (speculate, stream_buffer_limit)
        self.hold = hold
        self.on_regions: Callable[[int, list[RegionEvent]], None] = lambda rank, events: None
        self._regions: dict[int, dict[int, str]] = {}  # rank -> region item -> request
        self._region_handles: dict[Token, int] = {}  # input slots of region starts -> rank
        self._stats_replies: dict[int, tuple[threading.Event, dict[int, RankStatsReply]]] = {}
        self._releases: collections.deque[tuple[int, str, str]] = collections.deque()
        self._stats_seq = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._handle_batch: dict[Token, int] = {}
        self._batch_ids = itertools.count()
        self._closed = False
        self._tmpdir: str | None = None
        self._io: threading.Thread | None = None
        self._ranks: dict[int, _Rank] = {}
        self._ctx = zmq.Context()
        self._on_listening = on_listening
        self._remote_data: dict[int, DataPath] = {}  # remote rank -> data path, when not config's
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
        if self.config.bind is not None:
            commands, curve = self._secure_tcp(ranks)
        elif self.config.address == "ipc" and zmq.has("ipc"):
            self._tmpdir = tempfile.mkdtemp(prefix="walkserve-")  # mode 0700: ours alone
            weakref.finalize(self, shutil.rmtree, self._tmpdir, True)  # if never closed
            self.address = f"ipc://{self._tmpdir}/reports"
            self._reports.bind(self.address)
            commands = f"ipc://{self._tmpdir}/commands"
            self._commands.bind(commands)
        else:
            port = self._reports.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
            port = self._commands.bind_to_random_port("tcp://127.0.0.1")
            commands = f"tcp://127.0.0.1:{port}"
        worker_config = WorkerConfig(
            threads=self.threads,
            commands_addr=commands,
            heartbeat_s=self.config.heartbeat_s,
            setup_timeout_s=self.config.start_timeout_s,
            inline_max_bytes=self.config.inline_max_bytes,
            shm_slots_per_class=self.config.worker_shm_slots_per_class,
            forbid_pickle=self.config.forbid_pickle,
            kv_pool_tokens=self.config.kv_pool_tokens,
            kv_page_size=self.config.kv_page_size,
            curve_server_key=curve[0],
            curve_public_key=curve[1],
            curve_secret_key=curve[2],
        )
        self._wake_rx = self._ctx.socket(zmq.PULL)  # close() stops the io thread through it
        self._wake_rx.bind("inproc://wake")
        self._wake = self._ctx.socket(zmq.PUSH)
        self._wake.connect("inproc://wake")
        self._setups_due: dict[int, bytes] = {}  # rank -> WorkerSetup not yet routable

        self._shm = ShmPool(self.config.shm)
        self._reader = ShmReader()
        self._transport = ShmTransport(
            self._shm, self._reader, inline_max_bytes=self.config.inline_max_bytes
        )
        self._remote_transport: Transport = ShmTransport(
            self._shm, self._reader, inline_max_bytes=INLINE_ALL
        )
        if self.config.remote_ranks and self.config.remote_data == "mooncake":
            from walkserve.runtime.net.mooncake import (
                MooncakeConfig,
                MooncakeEngine,
                MooncakeTransport,
            )
            from walkserve.runtime.net.remote import parse_tcp

            assert self.config.bind is not None
            engine = MooncakeEngine(MooncakeConfig(host=parse_tcp(self.config.bind)[0]))
            self._remote_transport = MooncakeTransport(
                engine, inline_max_bytes=self.config.inline_max_bytes
            )
        spawn = mp.get_context("spawn")
        config_json = worker_config.to_json()
        for rank in range(ranks):
            if rank in self.config.remote_ranks:
                self._ranks[rank] = self._remote_rank(rank)
                continue
            process = spawn.Process(
                target=worker_main,
                args=(rank, self.address, config_json),
                name=f"walkserve-worker-{rank}",
                daemon=True,
            )
            process.start()
            self._ranks[rank] = _Rank(rank, process, routing_id(rank), pid=process.pid)
        self._by_identity = {r.identity: r for r in self._ranks.values()}
        self._handlers: dict[type, Callable[[_Rank, Any], None]] = {
            Join: self._on_join,
            AttachPools: self._on_attach,
            Hello: self._on_hello,
            Heartbeat: self._on_heartbeat,  # every message refreshes last_seen
            BatchDone: self._on_done,
            BatchFailed: self._on_failed,
            Ack: self._on_ack,
            Fatal: self._on_fatal,
            ProbeReply: self._on_probe_reply,
            RegionEvents: self._on_region_events,
            RankStatsReply: self._on_rank_stats,
        }
        self._probes: dict[int, threading.Event] = {}
        self._probe_ids = itertools.count()
        self.links: dict[int, LinkModel] = {}  # remote rank -> measured at start-up
        self._io = threading.Thread(target=self._io_loop, name="walkserve-pool-io", daemon=True)
        self._io.start()
        if self._on_listening is not None:
            self._on_listening(self)

        deadline = time.monotonic() + self.config.start_timeout_s
        for state in self._ranks.values():
            state.settled.wait(max(0.0, deadline - time.monotonic()))
        failed = [s for s in self._ranks.values() if s.status != "ready"]
        if failed:
            reasons = "; ".join(f"rank {s.rank}: {self._start_failure(s)}" for s in failed)
            raise WorkerStartError(f"workers did not start: {reasons}", failed[0].rank)
        for rank in self.config.remote_ranks:
            self.links[rank] = self.measure_link(rank)
            log.info("link to remote rank %d: %s", rank, self.links[rank])

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

    def _remote_rank(self, rank: int) -> _Rank:
        holder: list[_Rank] = []
        process = RemoteProcess(
            rank,
            closing=lambda: self._closed,
            last_seen=lambda: holder[0].last_seen if holder else None,
            dead_after_s=max(self.config.unresponsive_after_s, 3 * self.config.heartbeat_s),
        )
        state = _Rank(rank, process, routing_id(rank), pid=None)  # type: ignore[arg-type]
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

    def _on_probe_reply(self, state: _Rank, msg: ProbeReply) -> None:
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

    def _start_failure(self, state: _Rank) -> str:
        if state.error is not None:
            return state.error
        if state.status == "dead":
            return f"the process exited ({_describe_exit(state.exitcode)})"
        return f"no Hello within {self.config.start_timeout_s:.0f} s"

    # ------------------------------------------------------------------ public API

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def pid(self, rank: int) -> int | None:
        return self._rank(rank).pid

    @property
    def shm_pool_id(self) -> str:
        """The id of the conductor's pool (the inputs it sends)."""
        return self._shm.pool_id

    def shm_stats(self) -> PoolStats:
        """Slots of the conductor's pool: ``in_use`` are inputs not yet released."""
        return self._shm.stats()

    def submit_batch(
        self,
        rank: int,
        walk: str,
        node: str,
        items: Iterable[Item],
        ops: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
    ) -> Future[BatchResult]:
        """Run ``node`` of ``walk`` on ``rank`` for ``items`` (item id, request id, inputs by
        name: tensors, Python scalars, None, tuples/lists of them, or ``ObjectRef`` handles a
        worker returned). ``ops``/``outputs``: part of the node, and the values to return
        (see ``messages.RunBatch``). The future fails with ``BatchError`` (the node raised),
        ``WorkerDied`` or ``WorkerPoolClosed``."""
        state = self._rank(rank)
        future: Future[BatchResult] = Future()
        batch_items: list[BatchItem] = []
        handles: list[Token] = []
        seen: set[int] = set()
        try:
            for item, request_id, inputs in items:
                if item in seen:
                    raise ValueError(f"item id {item} appears twice in one batch")
                seen.add(item)
                values: dict[str, Value] = {}
                for name, value in inputs.items():
                    values[name] = payload = self._transport_for(rank).send(value, request_id)
                    handles += shm_handles(payload)
                batch_items.append(BatchItem(item, request_id, values))
            batch = next(self._batch_ids)
            data = encode(
                RunBatch(
                    batch,
                    walk,
                    node,
                    batch_items,
                    None if ops is None else list(ops),
                    None if outputs is None else list(outputs),
                )
            )
            with self._lock:
                if self._closed:
                    raise WorkerPoolClosed("the worker pool is closed", rank)
                if state.status in ("dead", "closed"):
                    raise WorkerDied(
                        f"worker rank {rank} is dead ({_describe_exit(state.exitcode)})", rank
                    )
                self._pending[batch] = _Pending(
                    rank,
                    walk,
                    node,
                    [i.item for i in batch_items],
                    future,
                    set(handles),
                    {i.item: i.request_id for i in batch_items},
                )
                for h in handles:
                    self._handle_batch[h] = batch
        except WorkerDied as e:
            self._transport_for(rank).release(handles)
            future.set_exception(e)
            return future
        except BaseException:
            self._transport_for(rank).release(handles)
            raise
        try:
            self._send(state, data)
        except zmq.ZMQError as e:  # its socket is gone (dead) or its queue is full
            pending = self._take(batch)
            if pending is not None:
                error = WorkerDied(f"worker rank {rank} is unreachable: {e}", rank)
                _fail(pending.future, error)
        return future

    def start_regions(
        self, rank: int, starts: Iterable[tuple[int, str, str, str, Mapping[str, Any]]]
    ) -> None:
        """Start region runs on ``rank``: (item id, request id, walk, region, inputs by
        name). What they do arrives at ``on_regions(rank, events)`` (on the io thread),
        their exits included; a rank that dies fails its runs there too."""
        self.flush_releases()
        state = self._rank(rank)
        transport = self._transport_for(rank)
        wire: list[RegionStart] = []
        handles: list[Token] = []
        try:
            for item, request_id, walk, region, inputs in starts:
                values: dict[str, Value] = {}
                for name, value in inputs.items():
                    values[name] = payload = transport.send(value, request_id)
                    handles += shm_handles(payload)
                wire.append(RegionStart(item, request_id, walk, region, values))
            data = encode(StartRegions(wire))
        except BaseException:
            transport.release(handles)
            raise
        with self._lock:
            dead = self._closed or state.status in ("dead", "closed")
            if not dead:
                self._regions.setdefault(rank, {}).update({s.item: s.request_id for s in wire})
                for h in handles:
                    self._region_handles[h] = rank
        if dead:
            transport.release(handles)
            error = f"worker rank {rank} is dead ({_describe_exit(state.exitcode)})"
            self.on_regions(rank, [RegionFailed(s.item, error) for s in wire])
            return
        try:
            self._send(state, data)
        except zmq.ZMQError as e:
            self._fail_regions(rank, f"worker rank {rank} is unreachable: {e}")

    def feed(
        self,
        rank: int,
        item: int,
        request_id: str,
        stream: str,
        pieces: Sequence[Any],
        finished: bool,
    ) -> None:
        """Items of a stream from one region to region item ``item`` on ``rank``: held values
        (``ObjectRef``) that rank pulls from their producer itself."""
        state = self._rank(rank)
        transport = self._transport_for(rank)
        values: list[Value] = []
        handles: list[Token] = []
        try:
            for piece in pieces:
                values.append(payload := transport.send(piece, request_id))
                handles += shm_handles(payload)
            data = encode(FeedStream(item, request_id, stream, values, finished))
        except BaseException:
            transport.release(handles)
            raise
        with self._lock:
            for h in handles:
                self._region_handles[h] = rank
        if state.status not in ("dead", "closed"):
            with contextlib.suppress(zmq.ZMQError):
                self._send(state, data)

    def grant(self, rank: int, item: int, channel: str, items: int) -> None:
        """Producer region item ``item`` on ``rank`` may commit ``channel`` up to ``items``."""
        state = self._rank(rank)
        if state.status not in ("dead", "closed"):
            with contextlib.suppress(zmq.ZMQError):
                self._send(state, encode(GrantCredit(item, channel, items)))

    def drop_runs(self, rank: int, items: Sequence[int]) -> None:
        """Region runs on ``rank`` nobody waits for any more: the rank may stop them."""
        state = self._rank(rank)
        with self._lock:
            live = self._regions.get(rank, {})
            items = [i for i in items if live.pop(i, None) is not None]
        if items and state.status not in ("dead", "closed"):
            with contextlib.suppress(zmq.ZMQError):
                self._send(state, encode(DropRuns(list(items))))

    def rank_stats(self, timeout: float = 10.0) -> dict[int, RankStatsReply]:
        """Every live rank's scheduler and stores, as each answered a ``StatsQuery`` sent after
        every command before this call (ranks that do not answer in ``timeout`` are left out)."""
        seq = next(self._stats_seq)
        done = threading.Event()
        replies: dict[int, RankStatsReply] = {}
        with self._lock:
            live = [s for s in self._ranks.values() if s.status == "ready"]
            self._stats_replies[seq] = (done, replies)
        try:
            for state in live:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(state, encode(StatsQuery(seq)))
            deadline = time.monotonic() + timeout
            while len(replies) < len(live) and time.monotonic() < deadline:
                done.wait(max(0.0, deadline - time.monotonic()))
                done.clear()
            return dict(replies)
        finally:
            with self._lock:
                self._stats_replies.pop(seq, None)

    def release_request(self, request_id: str) -> None:
        """Tell every live worker that ``request_id`` is over (finished, failed or cancelled):
        each drops the objects it keeps for it (a KV cache), which frees their memory."""
        data = encode(Cancel(request_id))
        with self._lock:
            live = [s for s in self._ranks.values() if s.status not in ("dead", "closed")]
        for state in live:
            with contextlib.suppress(zmq.ZMQError):  # a dead worker holds nothing any more
                self._send(state, data)

    def _send(self, state: _Rank, data: bytes) -> None:
        with self._send_lock:
            self._commands.send_multipart([state.identity, data], zmq.NOBLOCK)

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
                    rank, s.pid, status, s.exitcode, seen, in_flight.get(rank, 0), s.error, pool_id
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
            if s.status not in ("dead", "closed") and hasattr(self, "_commands"):
                with contextlib.suppress(zmq.ZMQError):
                    self._send(s, encode(Shutdown()))
        deadline = time.monotonic() + self.config.stop_timeout_s
        for s in self._ranks.values():
            _reap(s.process, deadline - time.monotonic())
        for s in self._ranks.values():
            if s.process.exitcode is None:
                log.warning("worker rank %d did not stop in time; killing it", s.rank)
                s.process.kill()
                _reap(s.process, 5.0)
        if self._io is not None:
            self._wake.send(b"stop")
            if threading.current_thread() is not self._io:  # close() from a future callback
                self._io.join()
        for s in self._ranks.values():
            self._on_exit(s, closing=True)
            with contextlib.suppress(ValueError):
                s.process.close()
        with self._lock:
            pending, self._pending = self._pending, {}
        for batch, p in pending.items():
            _fail(
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
        for name in ("_shm", "_reader"):
            resource = getattr(self, name, None)
            if resource is not None:
                resource.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rank(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            raise ValueError(f"no rank {rank}; the pool has ranks {self.ranks}")
        return state

    # ------------------------------------------------------------------ io thread

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._reports, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        sentinels = {s.process.sentinel: s for s in self._ranks.values()}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll(5 if self._setups_due else 1000):
                if sock is self._reports:
                    while (frames := _recv_multipart(self._reports)) is not None:
                        self._dispatch(frames)
                elif sock is self._wake_rx:
                    return
                elif isinstance(sock, int) and sock in sentinels:
                    poller.unregister(sock)
                    self._drain_reports()  # its last words (a Fatal) come first
                    self._on_exit(sentinels.pop(sock), closing=self._closed)
            for rank, setup in list(self._setups_due.items()):
                self._send_setup(self._ranks[rank], setup)
            self.flush_releases()

    def _drain_reports(self, wait_ms: int = 20) -> None:
        """Dispatch what the workers sent so far, waiting up to ``wait_ms`` for stragglers."""
        while self._reports.poll(wait_ms):
            while (frames := _recv_multipart(self._reports)) is not None:
                self._dispatch(frames)
            wait_ms = 2

    def _send_setup(self, state: _Rank, setup: bytes) -> None:
        """Send a worker its setup once its command socket is connected (its ``Join`` came
        over the other one, so it may not be yet)."""
        try:
            self._send(state, setup)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._setups_due[state.rank] = setup
        else:
            self._setups_due.pop(state.rank, None)

    def _dispatch(self, frames: list[bytes]) -> None:
        state = self._by_identity.get(frames[0])
        if state is None or len(frames) != 2:
            log.warning("ignoring a message from an unknown peer")
            return
        state.last_seen = time.monotonic()
        try:
            msg: Message = decode(frames[1])
        except MessageError as e:
            log.warning("rank %d sent a bad message: %s", state.rank, e)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("rank %d sent an unexpected %s", state.rank, type(msg).__name__)
            return
        if getattr(msg, "rank", state.rank) != state.rank:
            log.warning("rank %d sent a message for rank %s", state.rank, msg.rank)  # type: ignore[union-attr]
            return
        handler(state, msg)

    def _on_join(self, state: _Rank, msg: Join) -> None:
        if state.rank in self.config.remote_ranks and state.pid is None:
            state.pid = msg.pid  # a remote worker: its pid on its host
            if isinstance(state.process, RemoteProcess):
                state.process.pid = msg.pid
            log.info("remote rank %d joined (pid %d)", state.rank, msg.pid)
        if msg.pid != state.process.pid:
            log.warning("rank %d: Join from pid %d, expected %s", state.rank, msg.pid, state.pid)
            return
        model, seed, ir, plan = self._model
        remote = state.rank in self.config.remote_ranks
        data = self.remote_data(state.rank) if remote else "shm"
        speculate, limit = self._scheduling
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
            self._peers(),
            self.hold,
        )
        self._send_setup(state, encode(setup))

    def _peers(self) -> dict[int, str]:
        """Every rank's peer socket, when all ranks share this host and its private
        directory (else none: values then travel through this process)."""
        from walkserve.runtime.peers import peer_address

        if self._tmpdir is None or self.config.remote_ranks:
            return {}
        return {r: peer_address(self._tmpdir, r) for r in self._ranks}

    def _on_heartbeat(self, state: _Rank, msg: Heartbeat) -> None:
        state.kv = list(msg.kv)

    def kv_stats(self) -> dict[int, list[KVStats]]:
        """Every rank's paged KV pools, as of its last heartbeat (``heartbeat_s`` old at most)."""
        with self._lock:
            return {rank: list(s.kv) for rank, s in sorted(self._ranks.items())}

    def _on_attach(self, state: _Rank, msg: AttachPools) -> None:
        if len(msg.pools) != 1 or state.spec is not None:
            log.warning("rank %d: unexpected AttachPools", state.rank)
            return
        state.spec = msg.pools[0]
        self._reader.add(state.spec)

    def _on_hello(self, state: _Rank, msg: Hello) -> None:
        if msg.pid != state.process.pid or state.spec is None:
            log.warning("rank %d: unexpected Hello", state.rank)
            return
        with self._lock:
            state.status = "ready"
        state.settled.set()

    def _on_fatal(self, state: _Rank, msg: Fatal) -> None:
        state.error = msg.error
        log.error("worker rank %d: %s", state.rank, msg.error)

    def _on_ack(self, state: _Rank, msg: Ack) -> None:
        with self._lock:
            for h in msg.handles:
                if self._region_handles.pop(h, None) is not None:
                    self._release(h)
                    continue
                batch = self._handle_batch.pop(h, None)
                pending = self._pending.get(batch) if batch is not None else None
                if pending is None or pending.rank != state.rank or h not in pending.handles:
                    log.warning("rank %d acked a handle it was not given", state.rank)
                    continue
                pending.handles.discard(h)
                self._release(h)

    def _on_done(self, state: _Rank, msg: BatchDone) -> None:
        handles = [h for out in msg.outputs for v in out.values.values() for h in shm_handles(v)]
        pending = self._take(msg.batch, state.rank)
        try:
            if pending is None:
                return
            outputs: dict[int, dict[str, Any]] = {}
            for out in msg.outputs:
                outputs[out.item] = {
                    name: self._transport_for(state.rank).receive(payload, "")[0]
                    for name, payload in out.values.items()
                }
                self._track(outputs[out.item], pending.requests.get(out.item, ""))
        except Exception as e:
            assert pending is not None
            error = f"outputs of batch {msg.batch} from rank {state.rank} are unreadable: {e}"
            _fail(pending.future, WorkerError(error, state.rank))
            return
        finally:
            if handles:  # copied out (or unreadable): the worker may reuse the slots
                with contextlib.suppress(zmq.ZMQError):
                    self._send(state, encode(Ack(handles)))
        answered = sorted([*outputs, *msg.deferred, *(e.item for e in msg.errors)])
        if answered != sorted(pending.items):
            error = f"rank {state.rank} answered items {answered}, sent {sorted(pending.items)}"
            _fail(pending.future, WorkerError(error, state.rank))
            return
        errors = {e.item: e.error for e in msg.errors}
        pending.future.set_result(
            BatchResult(
                pending.rank,
                pending.walk,
                pending.node,
                outputs,
                frozenset(msg.deferred),
                errors,
            )
        )

    def _on_region_events(self, state: _Rank, msg: RegionEvents) -> None:
        """Copy the values out (acking their slots at once) and hand the events on."""
        transport = self._transport_for(state.rank)
        handles: list[Token] = []
        events: list[RegionEvent] = []
        with self._lock:
            live = self._regions.setdefault(state.rank, {})
        for event in msg.events:
            request = live.get(event.item, "")
            try:
                if isinstance(event, RegionStreamed):
                    value, tokens = transport.receive(event.value, "")
                    handles += tokens
                    events.append(msgspec.structs.replace(event, value=value))
                elif isinstance(event, (RegionOutput, RegionDone)):
                    outputs = {}
                    for name, payload in event.outputs.items():
                        outputs[name], tokens = transport.receive(payload, "")
                        handles += tokens
                    self._track(outputs, request)
                    events.append(msgspec.structs.replace(event, outputs=outputs))
                else:
                    events.append(event)
            except Exception as e:
                error = (
                    f"region item {event.item}'s values from rank {state.rank} are unreadable: {e}"
                )
                events.append(RegionFailed(event.item, error))
            if isinstance(events[-1], (RegionDone, RegionFailed)):
                with self._lock:
                    live.pop(event.item, None)
        if handles:
            with contextlib.suppress(zmq.ZMQError):
                self._send(state, encode(Ack(handles)))
        self.on_regions(state.rank, events)

    def _track(self, values: Mapping[str, Any], request: str) -> None:
        """Release each held value of ``values`` (an ``ObjectRef``) on its rank once this
        process drops its last reference to it: its last reader is done."""
        todo = list(values.values())
        while todo:
            v = todo.pop()
            if isinstance(v, ObjectRef):
                weakref.finalize(v, self._releases.append, (v.rank, request, v.key))
            elif isinstance(v, (list, tuple)):
                todo += v

    def flush_releases(self) -> None:
        """Send the ``Release`` of every held value dropped since the last flush (the
        finalizers only queue them: they may run in any thread, holding any lock)."""
        by: dict[tuple[int, str], list[str]] = {}
        while self._releases:
            rank, request, key = self._releases.popleft()
            by.setdefault((rank, request), []).append(key)
        for (rank, request), keys in by.items():
            state = self._ranks.get(rank)
            if request and state is not None and state.status == "ready":
                with contextlib.suppress(zmq.ZMQError):
                    self._send(state, encode(Release(request, keys)))

    def _on_rank_stats(self, state: _Rank, msg: RankStatsReply) -> None:
        with self._lock:
            waiting = self._stats_replies.get(msg.seq)
        if waiting is not None:
            waiting[1][state.rank] = msg
            waiting[0].set()

    def _fail_regions(self, rank: int, error: str) -> None:
        """Every region run of ``rank`` fails with ``error`` (its worker died)."""
        with self._lock:
            items = self._regions.pop(rank, {})
            mine = [h for h, r in self._region_handles.items() if r == rank]
            for h in mine:
                del self._region_handles[h]
        for h in mine:
            self._release(h)
        if items:
            self.on_regions(rank, [RegionFailed(item, error) for item in items])

    def _on_failed(self, state: _Rank, msg: BatchFailed) -> None:
        pending = self._take(msg.batch, state.rank)
        if pending is not None:
            errors = {e.item: e.error for e in msg.errors}
            _fail(pending.future, BatchError(pending.rank, pending.walk, pending.node, errors))

    def _take(self, batch: int, rank: int | None = None) -> _Pending | None:
        """Take batch ``batch`` out of the pending table and release the input slots its
        worker did not ack (it is done with them once it replied, or dead)."""
        with self._lock:
            pending = self._pending.get(batch)
            if pending is None or (rank is not None and pending.rank != rank):
                log.warning("reply for unknown batch %d", batch)
                return None
            del self._pending[batch]
            for h in pending.handles:
                self._handle_batch.pop(h, None)
                self._release(h)
            pending.handles.clear()
        return pending

    def _on_exit(self, state: _Rank, closing: bool) -> None:
        """A worker process ended (or the pool closed): settle its state, free what it held,
        then fail its batches (so that whoever sees the failure finds everything released)."""
        if state.status in ("dead", "closed"):
            return
        _reap(state.process, 5.0)  # no zombie
        with self._lock:
            if state.status in ("dead", "closed"):
                return
            state.exitcode = state.process.exitcode
            clean = closing and state.exitcode == 0
            state.status = "closed" if clean else "dead"
            if not clean:
                exit_ = _describe_exit(state.exitcode)
                state.error = state.error or f"the process exited ({exit_})"
            mine = [b for b, p in self._pending.items() if p.rank == state.rank]
        if not clean:
            log.error("worker rank %d died (%s)", state.rank, _describe_exit(state.exitcode))
            if state.spec is not None and state.rank not in self.config.remote_ranks:
                _unlink_segments(state.spec)
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
                    f"worker rank {state.rank} (pid {state.pid}) died "
                    f"({_describe_exit(state.exitcode)}) with {what} in flight",
                    state.rank,
                )
            _fail(pending.future, error)
        if clean:
            self._fail_regions(state.rank, f"the pool closed with region runs on rank {state.rank}")
        else:
            self._fail_regions(
                state.rank,
                f"worker rank {state.rank} (pid {state.pid}) died ({_describe_exit(state.exitcode)})",
            )
        state.settled.set()

    def _release(self, handle: Token) -> None:
        try:
            if isinstance(handle, MooncakeHandle):
                self._remote_transport.release([handle])
            else:
                self._transport.release([handle])
        except (ShmError, TransportError) as e:
            log.warning("could not release an input slot: %s", e)


# ------------------------------------------------------------------------------ helpers


def _fail(future: Future[BatchResult], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _reap(process: BaseProcess, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``process`` to end and reap it. ``join`` alone
    returns early when the sentinel fires, which happens as the process closes its files, a
    moment before it can be reaped."""
    deadline = time.monotonic() + timeout
    while process.exitcode is None and (remaining := deadline - time.monotonic()) > 0:
        process.join(remaining)
        if process.exitcode is None:
            time.sleep(0.001)


def _recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _unlink_segments(spec: ShmPoolSpec) -> None:
    """Unlink the segments of a dead worker's pool (it cannot any more), and tell the resource
    tracker the worker registered them with (shared with this process under spawn)."""
    import _posixshmem
    from multiprocessing import resource_tracker

    for seg in spec.segments:
        try:
            _posixshmem.shm_unlink("/" + seg.name)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("could not unlink %s: %s", seg.name, e)
            continue
        with contextlib.suppress(Exception):
            resource_tracker.unregister("/" + seg.name, "shared_memory")


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
