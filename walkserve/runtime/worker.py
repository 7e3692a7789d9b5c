"""A worker process: hosts the nodes placed on one rank and runs batches of them.

Owns one rank's callables, its output shared-memory pool and its per-request object store.
What crosses its boundary: typed messages over ZeroMQ (never pickle), and tensor bytes in
shared memory (``transport.ShmTransport``)::

    conductor (workers.WorkerPool)              worker process (this module)
    spawn(worker_main, rank, addr, config) -->  OMP_NUM_THREADS, import torch, set_num_threads
                  <---------------------------  Join(rank, pid)
    WorkerSetup(model, seed, ir, plan, pool) ->  load weights, rebuild the CapturedModel, put
                                                 this rank's components on its device, build
                                                 the callables of its nodes (``workerbuild``)
                  <---------------------------  AttachPools([output pool]), Hello
    RunBatch(batch, walk, node, items) ------>  read inputs, Ack the input handles, run the
                                                 node for every item
                  <---------------------------  BatchDone(outputs) | BatchFailed(per item)
    Ack(output handles) --------------------->  release the output slots
    Cancel(requests) ------------------------>  drop the requests' runs and objects
                  <---------------------------  Heartbeat, every config.heartbeat_s [watch]
    Shutdown -------------------------------->  drop queued work, close the pool, exit 0

Two threads, two DEALER sockets: one to the conductor's command ROUTER (``commands_addr``),
one to its report ROUTER (``conductor_addr``).

- The *main* thread runs the engine loop (``engine.EngineLoop``) and reads the command socket
  itself (``workerinbox``): when it would wait, it polls the socket; between steps it takes
  what has arrived. A command reaches the engine with no hand-off between threads (a thread
  woken per command costs tens of microseconds on a small host, more than reading it). It
  sends its reports itself on the report socket (shared under a lock).
- The *watch* thread sends the heartbeats (a heartbeat says the process is alive, not that a
  long node has finished, nor that a slow peer answered) and notices the conductor's end.

Batches run one at a time, in arrival order. A component node is one ``BatchedComponent`` call
for the whole batch, then its fused glue per item; a glue node runs ``Interpreter.op`` per item.
An exception fails only that batch (every item of it gets an ``ItemError``, the culprit's naming
the error, the others naming the culprit); the worker keeps serving.

Outputs: a tensor under 64 KiB travels inline, a larger one through this worker's own pool;
Python scalars and None as typed values; anything else (a Hugging Face cache object) stays in
this worker's per-request object store and travels as ``ObjectRef(rank, key)``, which only this
worker resolves, only for that request. Objects never cross a process boundary: a plan must
place an object's producer and all its consumers on one rank. ``Cancel`` drops them.

Threads: ``WorkerConfig.threads`` sets ``OMP_NUM_THREADS`` before torch is imported and
``torch.set_num_threads``; the pool's default is ``default_threads(ranks)``: the usable cores
but one (the conductor's process) divided evenly over the ranks, at least 1. This module's top
level imports no torch, because spawn imports it in the child (to find ``worker_main``) before
``worker_main`` runs; torch and the rest of walkserve are imported inside functions. If the
parent's ``__main__`` module imports torch at its top, spawn re-imports that module in the
child first and the variable comes too late for OpenMP's start-up, but
``torch.set_num_threads`` still applies.

Tensor parallelism: a ``WorkerSetup`` with ``tp`` makes the worker join its group before it
loads the model (the loader then loads this rank's shard) and hand the group's components to
``tp.member.TPMember``: on the leader their calls go to every rank of the group; a follower
runs them on a thread of its own, and its engine loop runs whatever else is placed on it.
A broken group ends the worker (exit 1).

Signals: a spawned worker leads a process group of its own, so that signals meant for the
server's group (Ctrl-C, SIGTERM from a supervisor) reach the server only, which drains and
then stops its workers (``Shutdown``). SIGINT is ignored all the same (the conductor decides),
SIGTERM sent to the worker itself stops it cleanly. A worker whose parent process is gone exits by itself (it
checks at each heartbeat) and removes the conductor's socket directory; a remote one
(``rejoin.RemoteWorker``) watches its connection instead, and joins again when it drops. Its sockets' routing
id carries ``WorkerConfig.generation``: a restarted rank's new process is heard, the old one
(if it still runs) is not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import zmq

    from walkserve.runtime.engine import EngineLoop
    from walkserve.runtime.messages import (
        KVStats,
        Message,
        WorkerSetup,
    )
    from walkserve.runtime.peers import PeerClient, PeerServer
    from walkserve.runtime.ranklink import Link
    from walkserve.runtime.shm import ShmPool
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.tp.member import TPMember
    from walkserve.runtime.transport import ObjectStore, ShmTransport
    from walkserve.runtime.workerinbox import Commands

from walkserve.runtime.components import KVEngine, component_counters
from walkserve.runtime.config import WorkerConfig, default_threads, routing_id
from walkserve.runtime.workerbuild import WorkerBuild
from walkserve.runtime.workerinbox import WorkerInbox

__all__ = [
    "Worker",
    "WorkerConfig",
    "component_counters",
    "default_threads",
    "routing_id",
    "worker_main",
]

log = logging.getLogger("walkserve.worker")

SEND_TIMEOUT_S = 10.0  # a report that cannot leave in this time is dropped: the conductor is gone


# ----------------------------------------------------------------------------- process


def worker_main(rank: int, conductor_addr: str, config: str | WorkerConfig) -> None:
    """The worker process's entry point (``config``: ``WorkerConfig`` or its JSON). Exits 0
    after ``Shutdown``, 1 when its setup failed (after telling the conductor why).

    The exit skips the interpreter's teardown (``os._exit``): with torch loaded it takes about
    a second, and by then the worker has released everything it owns (its pool is unlinked,
    its sockets closed, logs flushed)."""
    cfg = config if isinstance(config, WorkerConfig) else WorkerConfig.from_json(config)
    # A process group of its own: a signal to the server's group (a terminal's Ctrl-C, a
    # supervisor's SIGTERM) reaches the server alone, which drains, then stops its workers.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    import torch

    torch.set_num_threads(cfg.threads)
    code = Worker(rank, conductor_addr, cfg).run()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


class Worker(WorkerInbox, WorkerBuild):
    """One rank's process side (see the module docstring). ``run()`` returns the exit code."""

    def __init__(self, rank: int, address: str, config: WorkerConfig) -> None:
        self.rank = rank
        self.address = address
        self.config = config
        self.idle_spin_s = config.idle_spin_s
        self._stopping = threading.Event()
        self._ppid = os.getppid()
        self._tx_lock = threading.Lock()
        self._tx: zmq.Socket[bytes]  # reports, when no rank link (``_link``) carries them
        self._link: Link | None = None
        self.engine: EngineLoop
        self.pool: ShmPool
        self.reader: ShmReader
        self.objects: ObjectStore
        self.transport: ShmTransport
        self._kv: list[tuple[str, KVEngine]] = []
        self._kv_last: dict[str, KVStats] = {}
        self.peer_server: PeerServer | None = None
        self.peers: PeerClient | None = None
        self.pull: Callable[[Any], Any] | None = None
        self._orphaned = False  # the conductor process died: clean what it left
        self._next_beat = 0.0  # when the watch thread sends the next heartbeat
        self.tp: TPMember | None = None

    def run(self) -> int:
        import zmq

        from walkserve.runtime.messages import AttachPools, Fatal, Hello, Join

        ctx = self._ctx = zmq.Context()
        rx = self._connect(ctx)
        built = False
        try:
            self._send(Join(self.rank, os.getpid()))
            setup = self._await_setup(rx)
            if setup is None:
                return 0
            try:
                self._build(setup)
                built = True
            except Exception as e:
                log.exception("rank %d: setup failed", self.rank)
                self._send(Fatal(self.rank, f"setup failed: {type(e).__name__}: {e}"))
                return 1
            self._send(AttachPools([self.pool.spec]))
            self._send(Hello(self.rank, os.getpid()))
            if self.config.forbid_pickle:
                from walkserve.runtime.nopickle import forbid_pickle

                forbid_pickle()
            # Ctrl-C reaches the whole process group: the conductor decides when workers stop.
            # SIGTERM (multiprocessing's exit stops daemonic children with it): a clean stop.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, lambda signum, frame: self._stop())
            self._serve(rx)
            return 0
        finally:
            if self.tp is not None:
                self.tp.close()
            if built:
                if self.peer_server is not None:
                    self.peer_server.close()
                if self.peers is not None:
                    self.peers.close()
                self.pool.close()
                self.reader.close()
            rx.close()
            if self._link is None:
                self._tx.close()
            ctx.destroy()  # and any socket a subclass opened (a monitor)
            if self._orphaned:
                self._clean_after_conductor()

    def _clean_after_conductor(self) -> None:
        """The conductor process is gone (killed): remove its private socket directory, which
        it cannot any more (every worker tries; the first one wins). Shared memory needs
        nothing: the segments are unlinked by multiprocessing's resource tracker once the last
        process registered with it exits."""
        import shutil

        if self.address.startswith("ipc://"):
            directory = os.path.dirname(self.address[len("ipc://") :])
            if os.path.basename(directory).startswith("walkserve-"):
                shutil.rmtree(directory, ignore_errors=True)

    def _connect(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> Commands:
        """The conductor's end: its rank link (``WorkerConfig.link``: a rank it spawned), else
        a pair of ZeroMQ sockets (commands in, reports out)."""
        import zmq

        from walkserve.runtime.workerinbox import LinkCommands, ZmqCommands

        if self.config.link:
            from walkserve.runtime.doorbell import bell_path
            from walkserve.runtime.ranklink import Link

            self._link = Link.connect(self.config.link)
            bell = bell_path(os.path.dirname(self.config.link), self.rank, self.config.generation)
            return LinkCommands(self._link, bell)
        rx = ctx.socket(zmq.DEALER)  # commands; the engine thread's alone once it runs
        rx.setsockopt(zmq.LINGER, 0)
        rx.setsockopt(zmq.ROUTING_ID, routing_id(self.rank, self.config.generation))
        self._secure(rx)
        rx.connect(self.config.commands_addr)
        self._tx = ctx.socket(zmq.DEALER)  # reports; any thread, under _tx_lock
        self._tx.setsockopt(zmq.LINGER, 1000)  # let the last replies out
        # never block forever on a gone conductor
        self._tx.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self._tx.setsockopt(zmq.ROUTING_ID, routing_id(self.rank, self.config.generation))
        self._secure(self._tx)
        self._tx.connect(self.address)
        return ZmqCommands(rx)

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        """A CURVE client of the conductor when the config names keys (``runtime.net``)."""
        if self.config.curve_server_key:
            sock.curve_serverkey = self.config.curve_server_key.encode("ascii")
            sock.curve_publickey = self.config.curve_public_key.encode("ascii")
            sock.curve_secretkey = self.config.curve_secret_key.encode("ascii")

    def _send(self, msg: Message) -> None:
        """Send on the report socket; a message that cannot leave within its send timeout
        (the conductor is gone) is dropped: the conductor treats this worker as dead then."""
        import zmq

        from walkserve.runtime.messages import encode

        data = encode(msg)
        with self._tx_lock:
            if self._link is not None:
                from walkserve.runtime.ranklink import LinkClosed

                try:
                    self._link.send_all(data, SEND_TIMEOUT_S)
                except (TimeoutError, LinkClosed) as e:
                    log.error("rank %d: could not send %s: %s", self.rank, type(msg).__name__, e)
                return
            try:
                self._tx.send(data)
            except zmq.Again:
                log.error("rank %d: could not send %s", self.rank, type(msg).__name__)

    # ------------------------------------------------------------------ setup

    def _join_again_after(self) -> float:
        """Seconds to wait for the setup before joining again (a spawned worker: never)."""
        return float("inf")

    def _await_setup(self, rx: Commands) -> WorkerSetup | None:
        """The ``WorkerSetup`` (None after ``Shutdown``, or if none comes in time)."""
        from walkserve.runtime.messages import Join, MessageError, Shutdown, WorkerSetup, decode

        deadline = time.monotonic() + self.config.setup_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not rx.poll(int(min(remaining, self._join_again_after()) * 1000) + 1):
                if deadline - time.monotonic() > 0:  # unanswered: a conductor not up yet
                    self._send(Join(self.rank, os.getpid()))
                continue
            data = rx.recv()
            if data is None:  # the start of a message only, or the conductor closed its end
                if rx.closed:
                    return None
                continue
            try:
                msg = decode(data)
            except MessageError as e:
                log.warning("rank %d: ignoring a bad message before setup: %s", self.rank, e)
                continue
            if isinstance(msg, WorkerSetup):
                return msg
            if isinstance(msg, Shutdown):
                return None
            log.warning("rank %d: ignoring %s before setup", self.rank, type(msg).__name__)
        log.error("rank %d: no WorkerSetup within %.0f s", self.rank, self.config.setup_timeout_s)
        return None

    # ------------------------------------------------------------------ threads

    def _serve(self, rx: Commands) -> None:
        """The engine loop on this (the main) thread, reading the command socket itself
        (``WorkerInbox``); heartbeats and the conductor's end on a watch thread."""
        self._open_inbox(rx)
        watch = threading.Thread(
            target=self._watch, name=f"walkserve-watch-{self.rank}", daemon=True
        )
        watch.start()
        try:
            self.engine.run(self._stopping, inbox=self)
        finally:
            self._stopping.set()
            watch.join()
            self._close_inbox()

    def _watch(self) -> None:
        """The watch thread: a heartbeat every ``heartbeat_s`` (it says the process is alive,
        also while a long step runs or a peer is slow to answer), and the end of the
        conductor (this process's parent dies, a remote connection drops) stops the rank."""
        self._next_beat = time.monotonic()
        try:
            while not self._stopping.is_set():
                self._beat()
                if self._conductor_gone():
                    break
                self._stopping.wait(max(0.0, self._next_beat - time.monotonic()) + 0.001)
        finally:
            self._stop()

    def _conductor_closed(self) -> None:
        """The conductor closed its end of the rank link: it died (a pool closes a link only
        once its process ended). Its death reparents this process a moment after its files
        close: once it has, clean what it left (``_conductor_gone``); stop either way."""
        deadline = time.monotonic() + 2.0
        while not self._conductor_gone() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self._orphaned:
            log.error("rank %d: the conductor closed its link; exiting", self.rank)
        self._stop()

    def _conductor_gone(self) -> bool:
        """The conductor process (this one's parent) died: clean what it left, exit."""
        if os.getppid() == self._ppid:  # a cheap syscall
            return False
        log.error("rank %d: the conductor process is gone; exiting", self.rank)
        self._orphaned = True
        return True

    def _beat(self) -> None:
        """Send a heartbeat if one is due (the watch thread's)."""
        from walkserve.runtime.messages import Heartbeat

        now = time.monotonic()
        if now >= self._next_beat:
            self._send(Heartbeat(self.rank, now, self._kv_stats()))
            self._next_beat = now + self.config.heartbeat_s

    def _kv_stats(self) -> list[KVStats]:
        """The paged pools this worker allocated (a busy pool keeps its last figures)."""
        from walkserve.runtime.messages import KVStats

        for name, module in self._kv:
            stats = module.kv_stats(wait=False)
            if stats is not None:
                self._kv_last[name] = KVStats(
                    name,
                    stats.pages_in_use,
                    stats.pages_cached,
                    stats.num_pages,
                    stats.live_sequences,
                    stats.evictions,
                    stats.prefix_hits,
                )
        return list(self._kv_last.values())

    def _tp_broken(self, error: BaseException) -> None:
        """A rank of this worker's TP group died: the group cannot heal, so this rank ends
        too (the pool sees it dead and fails its requests; other replicas go on)."""
        log.error("rank %d: its tensor-parallel group broke (%s); exiting", self.rank, error)
        with contextlib.suppress(Exception):
            from walkserve.runtime.messages import Fatal

            self._send(Fatal(self.rank, f"tensor-parallel group broke: {error}"))
        logging.shutdown()
        os._exit(1)

    def _stop(self) -> None:
        """Stop the engine loop (any thread, a signal handler too): it wakes if it waits."""
        self._stopping.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
        self._wake()
