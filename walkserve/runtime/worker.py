"""A worker process: hosts the nodes placed on one rank and runs batches of them.

Owns one rank's callables, its output shared-memory pool and its per-request object store.
What crosses its boundary: typed messages over ZeroMQ (never pickle), and tensor bytes in
shared memory (``transport.ShmTransport``)::

    conductor (workers.WorkerPool)              worker process (this module)
    spawn(worker_main, rank, addr, config) -->  OMP_NUM_THREADS, import torch, set_num_threads
                  <---------------------------  Join(rank, pid)
    WorkerSetup(model, seed, ir, plan, pool) ->  load weights, rebuild the CapturedModel, build
                                                 the callables of the nodes on this rank
                  <---------------------------  AttachPools([output pool]), Hello
    RunBatch(batch, walk, node, items) ------>  [io]   read inputs, Ack the input handles
                                                [main] run the node for every item
                  <---------------------------  BatchDone(outputs) | BatchFailed(per item)
    Ack(output handles) --------------------->  [io]   release the output slots
    Cancel(request) ------------------------->  [io]   drop the request's objects
                  <---------------------------  Heartbeat, every config.heartbeat_s
    Shutdown -------------------------------->  drop queued work, close the pool, exit 0

Two threads, two DEALER sockets: one to the conductor's command ROUTER (``commands_addr``),
one to its report ROUTER (``conductor_addr``).

- The *io* thread owns the command socket. It decodes a batch's inputs (copying large tensors
  out of the conductor's pool, resolving object handles), acks the input slots and queues the
  batch, so the next batch's inputs are gathered while the main thread runs the current one
  (torch ops release the GIL). It sends the heartbeats: a heartbeat says the process is alive,
  not that a long node has finished. A glue batch that arrives while nothing is queued or
  running, it runs itself: glue is cheaper than waking the main thread.
- The *main* thread runs the queued batches one at a time and sends each reply itself on the
  report socket (shared with the io thread under a lock): no hand-back to the io thread.

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
divided evenly over the ranks, at least 1. This module's top level imports no torch, because
spawn imports it in the child (to find ``worker_main``) before ``worker_main`` runs; torch and
the rest of walkserve are imported inside functions. If the parent's ``__main__`` module
imports torch at its top, spawn re-imports that module in the child first and the variable
comes too late for OpenMP's start-up, but ``torch.set_num_threads`` still applies.

Signals: SIGINT is ignored (Ctrl-C reaches the whole process group; the conductor decides),
SIGTERM stops the worker cleanly. A worker whose parent process is gone exits by itself.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import zmq

    from walkserve.capture import ir
    from walkserve.capture.interpret import Interpreter
    from walkserve.capture.model import CapturedModel
    from walkserve.lowering.batched import BatchedComponent
    from walkserve.lowering.plan import ExecutablePlan, NodePlan
    from walkserve.runtime.kv.paged_lm import PagedLM
    from walkserve.runtime.messages import (
        BatchDone,
        BatchFailed,
        KVStats,
        Message,
        RunBatch,
        WorkerSetup,
    )
    from walkserve.runtime.shm import ShmPool, ShmReader
    from walkserve.runtime.transport import ObjectStore, ShmTransport

KiB = 1 << 10
MiB = 1 << 20

log = logging.getLogger("walkserve.worker")


def default_threads(ranks: int) -> int:
    """Torch threads per worker when none are given: the cores this process may use, divided
    evenly over ``ranks`` workers on the host, at least 1 (oversubscribed cores cost more than
    idle ones)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks))


def routing_id(rank: int) -> bytes:
    """The ZeroMQ identity of both of rank ``rank``'s sockets."""
    return f"walkserve-rank-{rank}".encode()


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Process-level settings, given to the child at spawn as JSON (a plain ``str``: spawn
    pickles its arguments, so they stay plain data). ``forbid_pickle``: after setup, every
    pickle entry point in the worker raises (a hardening and testing aid)."""

    threads: int
    commands_addr: str  # the conductor's command socket (conductor_addr: its report socket)
    heartbeat_s: float = 1.0
    setup_timeout_s: float = 120.0
    inline_max_bytes: int = 64 * KiB
    shm_max_slot_bytes: int = 256 * MiB
    shm_slots_per_class: int = 8
    forbid_pickle: bool = False
    kv_pool_tokens: int | None = None  # PagedLM pools: capacity in tokens (None: the model's)
    kv_page_size: int | None = None
    # CURVE (Z85 keys; empty: none): set by ``net`` when the conductor listens on TCP
    curve_server_key: str = ""
    curve_public_key: str = ""
    curve_secret_key: str = ""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not self.commands_addr:
            raise ValueError("commands_addr must name the conductor's command socket")
        for name in ("heartbeat_s", "setup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.inline_max_bytes < 0:
            raise ValueError(f"inline_max_bytes must be >= 0, got {self.inline_max_bytes}")
        if self.shm_slots_per_class < 1:
            raise ValueError(f"shm_slots_per_class must be >= 1, got {self.shm_slots_per_class}")

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def from_json(text: str | bytes) -> WorkerConfig:
        return msgspec.json.decode(text, type=WorkerConfig)


# ------------------------------------------------------------------------- node runs


@dataclass(frozen=True)
class NodeIO:
    """What a plan node exchanges with the rest of its walk. ``inputs``: values its ops read
    that it does not make (the names of a ``BatchItem``'s inputs). ``outputs``: values it makes
    that something outside it reads (the names of an ``ItemOutput``'s values)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def value_readers(walk: ir.Walk) -> dict[str, set[str]]:
    """Who reads each value of ``walk``: op names, or ``<loop NAME>``, ``<walk outputs>``,
    ``<stream>`` for the loop plumbing, the walk's results and streaming edges."""
    from walkserve.capture import ir

    readers: dict[str, set[str]] = {}

    def add(names: Sequence[str], reader: str) -> None:
        for name in names:
            readers.setdefault(name, set()).add(reader)

    def visit(block: ir.Block) -> None:
        for n in block.nodes:
            if isinstance(n, ir.Op):
                add(ir.node_inputs(n), n.name)
            else:
                add(
                    [*ir.node_inputs(n), *n.outputs, *([n.stop] if n.stop else [])],
                    f"<loop {n.name}>",
                )
                visit(n.body)

    visit(walk.body)
    add([r for a in walk.outputs.values() for r in ir.arg_refs(a)], "<walk outputs>")
    add([e.source for e in walk.streams], "<stream>")
    return readers


def node_io(walk: ir.Walk, node: NodePlan, readers: dict[str, set[str]] | None = None) -> NodeIO:
    """The ``NodeIO`` of plan node ``node`` of ``walk`` (pass ``value_readers(walk)`` when
    asking for many nodes of one walk)."""
    from walkserve.capture import ir

    if readers is None:
        readers = value_readers(walk)
    ops = {n.name: n for n in ir.iter_nodes(walk.body) if isinstance(n, ir.Op)}
    inside = set(node.ops)
    inputs: dict[str, None] = {}
    for name in node.ops:
        for ref in ir.node_inputs(ops[name]):
            if ref not in inside:
                inputs[ref] = None
    outputs = [name for name in node.ops if readers.get(name, set()) - inside]
    return NodeIO(tuple(inputs), tuple(outputs))


_DEFERRED = "\0deferred"  # env key: the component deferred this item (no IR name has a NUL)


class NodeRunError(RuntimeError):
    """A node raised. ``item``: the index of the item it raised for, or None when the
    batched call itself raised (it failed for every item)."""

    def __init__(self, message: str, item: int | None) -> None:
        super().__init__(message)
        self.item = item


@dataclass(frozen=True)
class _Node:
    plan: NodePlan
    ops: list[ir.Op]
    io: NodeIO
    call: BatchedComponent | None  # component nodes


class NodeExecutor:
    """Runs the plan nodes placed on ``rank`` (all nodes for None) for batches of items, one
    environment (value name -> value) per item. No process, socket or transport here: values
    in, values out; the worker wraps it, a test or an in-process conductor calls it directly.

        outs = executor.run("generate", "euler_step/denoiser", [env0, env1, env2])
        outs[i]    # {name: value} for every name in executor.io(walk, node).outputs

    ``ops`` runs part of a node (a conductor splits a node whose ops become ready at different
    times): a subsequence of the node's ops, in plan order; it is a batched component call only
    if it starts with the node's component op. ``outputs`` names the values to return
    (default: the whole node's ``NodeIO.outputs``; with ``ops``, every one of ``ops``).
    """

    def __init__(self, captured: CapturedModel, plan: ExecutablePlan, rank: int | None) -> None:
        from walkserve.capture import ir
        from walkserve.capture.interpret import Interpreter
        from walkserve.lowering.batched import build_callables

        self.rank = rank
        self.interp: Interpreter = Interpreter(captured)
        callables = build_callables(captured, plan, rank)
        self._nodes: dict[tuple[str, str], _Node] = {}
        self._ops: dict[str, dict[str, ir.Op]] = {}
        for walk_name in plan.walks:
            walk = captured.graph.walks[walk_name]
            ops = {n.name: n for n in ir.iter_nodes(walk.body) if isinstance(n, ir.Op)}
            readers = value_readers(walk)
            self._ops[walk_name] = ops
            for node in plan.nodes(walk_name):
                if rank is not None and rank not in node.ranks:
                    continue
                self._nodes[(walk_name, node.name)] = _Node(
                    node,
                    [ops[name] for name in node.ops],
                    node_io(walk, node, readers),
                    callables.get(f"{walk_name}:{node.name}"),
                )

    def nodes(self) -> list[tuple[str, str]]:
        """(walk, node) of every node this executor runs."""
        return list(self._nodes)

    def io(self, walk: str, node: str) -> NodeIO:
        return self._node(walk, node).io

    def is_glue(self, walk: str, node: str, ops: Sequence[str] | None = None) -> bool:
        """Whether running ``node`` (or its ``ops``) is glue only, no component call."""
        entry = self._nodes.get((walk, node))
        if entry is None:
            return False
        if entry.call is None:
            return True
        return ops is not None and len(ops) > 0 and ops[0] != entry.ops[0].name

    def run(
        self,
        walk: str,
        node: str,
        envs: Sequence[dict[str, Any]],
        ops: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
    ) -> list[dict[str, Any] | None]:
        """Run ``node`` (or its ``ops``) for every item; ``envs`` (each holding at least the
        inputs) receive the values of the ops. None for an item the component deferred (it
        could not run it now: send it again later). Raises ``NodeRunError``."""
        import torch

        entry = self._node(walk, node)
        run = entry.ops if ops is None else self._subset(walk, entry, ops)
        if outputs is None:
            outputs = entry.io.outputs if ops is None else ops
        with torch.no_grad():
            if entry.call is not None and run[0] is entry.ops[0]:
                self._component(entry.call, run, envs)
            else:
                for i, env in enumerate(envs):
                    self._glue(run, env, i)
        try:
            return [
                None if env.get(_DEFERRED) else {name: env[name] for name in outputs}
                for env in envs
            ]
        except KeyError as e:
            raise NodeRunError(f"{walk}:{node} makes no value {e}", None) from None

    def _subset(self, walk: str, entry: _Node, ops: Sequence[str]) -> list[ir.Op]:
        order = {op.name: k for k, op in enumerate(entry.ops)}
        positions = [order.get(name, -1) for name in ops]
        if not ops or -1 in positions or positions != sorted(set(positions)):
            raise NodeRunError(
                f"ops {list(ops)} are not a subsequence of node {walk}:{entry.plan.name}'s "
                f"ops {list(order)}",
                None,
            )
        return [entry.ops[k] for k in positions]

    def _node(self, walk: str, node: str) -> _Node:
        entry = self._nodes.get((walk, node))
        if entry is None:
            where = "this executor" if self.rank is None else f"rank {self.rank}"
            raise NodeRunError(f"node {walk}:{node} is not placed on {where}", None)
        return entry

    def _component(
        self, call: BatchedComponent, ops: list[ir.Op], envs: Sequence[dict[str, Any]]
    ) -> None:
        op, value = ops[0], self.interp.value
        batch = []
        for i, env in enumerate(envs):
            try:
                args = [value(a, env) for a in op.args]
                kwargs = {k: value(a, env) for k, a in op.kwargs.items()}
            except Exception as e:
                raise NodeRunError(str(e), i) from e
            batch.append((args, kwargs))
        try:
            outs = call(batch)
        except Exception as e:
            where = f" ({op.source})" if op.source else ""
            raise NodeRunError(f"node {op.name} ({op.target}){where} failed: {e}", None) from e
        from walkserve.lowering.batched import DEFER

        for i, (env, out) in enumerate(zip(envs, outs)):
            if out is DEFER:
                env[_DEFERRED] = True
                continue
            env[op.name] = out
            self._glue(ops[1:], env, i)

    def _glue(self, ops: list[ir.Op], env: dict[str, Any], index: int) -> None:
        for op in ops:
            try:
                env[op.name] = self.interp.op(op, env)
            except Exception as e:
                raise NodeRunError(str(e), index) from e


def configure_kv(
    model: Any, pool_tokens: int | None, page_size: int | None
) -> list[tuple[str, PagedLM]]:
    """Size the paged KV pools of ``model``'s ``PagedLM`` components (before any allocates);
    returns them by name."""
    from dataclasses import replace

    from walkserve.runtime.kv.paged_lm import PagedLM

    found = []
    for name, module in model.named_modules():
        if isinstance(module, PagedLM):
            config = module.config_kv
            if pool_tokens is not None:
                config = replace(config, pool_tokens=pool_tokens)
            if page_size is not None:
                config = replace(config, page_size=page_size)
            module.config_kv = config
            found.append((name, module))
    return found


# ----------------------------------------------------------------------------- process


def worker_main(rank: int, conductor_addr: str, config: str | WorkerConfig) -> None:
    """The worker process's entry point (``config``: ``WorkerConfig`` or its JSON). Exits 0
    after ``Shutdown``, 1 when its setup failed (after telling the conductor why).

    The exit skips the interpreter's teardown (``os._exit``): with torch loaded it takes about
    a second, and by then the worker has released everything it owns (its pool is unlinked,
    its sockets closed, logs flushed)."""
    cfg = config if isinstance(config, WorkerConfig) else WorkerConfig.from_json(config)
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    import torch

    torch.set_num_threads(cfg.threads)
    code = Worker(rank, conductor_addr, cfg).run()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


@dataclass
class _Job:
    """A batch whose inputs are decoded, waiting for the main thread."""

    batch: int
    walk: str
    node: str
    items: list[tuple[int, str]]  # (item, request id)
    envs: list[dict[str, Any]]
    ops: list[str] | None
    outputs: list[str] | None


_STOP = None  # the job that ends the main loop


class Worker:
    """One rank's process side (see the module docstring). ``run()`` returns the exit code."""

    def __init__(self, rank: int, address: str, config: WorkerConfig) -> None:
        self.rank = rank
        self.address = address
        self.config = config
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._backlog = 0  # batches queued or running
        self._backlog_lock = threading.Lock()
        self._stopping = threading.Event()
        self._ppid = os.getppid()
        self._tx_lock = threading.Lock()
        self._tx: zmq.Socket[bytes]
        self.executor: NodeExecutor
        self.pool: ShmPool
        self.reader: ShmReader
        self.objects: ObjectStore
        self.transport: ShmTransport
        self._kv: list[tuple[str, PagedLM]] = []
        self._kv_last: dict[str, KVStats] = {}

    def run(self) -> int:
        import zmq

        from walkserve.runtime.messages import AttachPools, Fatal, Hello, Join

        ctx = zmq.Context()
        rx = ctx.socket(zmq.DEALER)  # commands; the io thread's alone once it runs
        rx.setsockopt(zmq.LINGER, 0)
        rx.setsockopt(zmq.ROUTING_ID, routing_id(self.rank))
        self._secure(rx)
        rx.connect(self.config.commands_addr)
        self._tx = ctx.socket(zmq.DEALER)  # reports; any thread, under _tx_lock
        self._tx.setsockopt(zmq.LINGER, 1000)  # let the last replies out
        self._tx.setsockopt(zmq.SNDTIMEO, 10_000)  # never block forever on a gone conductor
        self._tx.setsockopt(zmq.ROUTING_ID, routing_id(self.rank))
        self._secure(self._tx)
        self._tx.connect(self.address)
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
                forbid_pickle()
            # Ctrl-C reaches the whole process group: the conductor decides when workers stop.
            # SIGTERM (multiprocessing's exit stops daemonic children with it): a clean stop.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, lambda signum, frame: self._stop())
            self._serve(rx)
            return 0
        finally:
            if built:
                self.pool.close()
                self.reader.close()
            rx.close()
            self._tx.close()
            ctx.term()

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
            try:
                self._tx.send(data)
            except zmq.Again:
                log.error("rank %d: could not send %s", self.rank, type(msg).__name__)

    # ------------------------------------------------------------------ setup

    def _await_setup(self, rx: zmq.Socket[bytes]) -> WorkerSetup | None:
        """The ``WorkerSetup`` (None after ``Shutdown``, or if none comes in time)."""
        from walkserve.runtime.messages import MessageError, Shutdown, WorkerSetup, decode

        deadline = time.monotonic() + self.config.setup_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not rx.poll(int(remaining * 1000) + 1):
                break
            try:
                msg = decode(rx.recv())
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

    def _build(self, setup: WorkerSetup) -> None:
        from walkserve.adapters.registry import load_model
        from walkserve.capture.model import CapturedModel
        from walkserve.capture.serialize import from_json
        from walkserve.lowering.plan import ExecutablePlan
        from walkserve.runtime.shm import ShmPool, ShmPoolConfig, ShmReader
        from walkserve.runtime.transport import ObjectStore, ShmTransport

        if setup.rank != self.rank:
            raise ValueError(f"setup is for rank {setup.rank}")
        model, _ = load_model(setup.model, setup.seed)
        self._kv = configure_kv(model, self.config.kv_pool_tokens, self.config.kv_page_size)
        captured = CapturedModel(from_json(setup.ir), model)
        self.executor = NodeExecutor(captured, ExecutablePlan.from_json(setup.plan), self.rank)
        min_slot = 64 * KiB
        self.pool = ShmPool(
            ShmPoolConfig(
                min_slot_bytes=min_slot,
                max_slot_bytes=max(min_slot, self.config.shm_max_slot_bytes),
                slots_per_class=self.config.shm_slots_per_class,
            )
        )
        self.reader = ShmReader([setup.pool])
        self.objects = ObjectStore(self.rank)
        self.transport = ShmTransport(
            self.pool,
            self.reader,
            inline_max_bytes=self.config.inline_max_bytes,
            objects=self.objects,
        )
        if setup.data != "shm":  # a worker on another host (runtime.net)
            from walkserve.runtime.net.remote import remote_transport

            self.transport = remote_transport(
                setup.data, self.address, self.objects, self.config.inline_max_bytes
            )

    # ------------------------------------------------------------------ main thread

    def _serve(self, rx: zmq.Socket[bytes]) -> None:
        io = threading.Thread(
            target=self._io_loop, args=(rx,), name=f"walkserve-io-{self.rank}", daemon=True
        )
        io.start()
        try:
            while True:
                job = self._jobs.get()
                if job is _STOP or self._stopping.is_set():
                    break
                try:
                    self._send(self._run(job))
                finally:
                    self._finished()
                    # Idle, the loop must not keep the batch's values (a request's KV cache
                    # is freed when the request's last reference goes).
                    del job
        finally:
            self._stopping.set()
            io.join()

    def _run(self, job: _Job) -> BatchDone | BatchFailed:
        from walkserve.runtime.messages import BatchDone, ItemOutput
        from walkserve.runtime.transport import shm_handles

        try:
            results = self.executor.run(job.walk, job.node, job.envs, job.ops, job.outputs)
        except NodeRunError as e:
            return self._failed(job, e.item, str(e))
        except Exception as e:  # a bug of ours, not the model's: still only this batch
            log.exception("rank %d: batch %d", self.rank, job.batch)
            return self._failed(job, None, f"{type(e).__name__}: {e}")
        outputs, written, deferred = [], [], []
        try:
            for (item, request_id), values in zip(job.items, results):
                if values is None:
                    deferred.append(item)
                    continue
                encoded = {}
                for name, value in values.items():
                    encoded[name] = payload = self.transport.send(value, request_id)
                    written += shm_handles(payload)
                outputs.append(ItemOutput(item, encoded))
        except Exception as e:
            self.transport.release(written)
            return self._failed(job, None, f"outputs could not be sent: {type(e).__name__}: {e}")
        return BatchDone(job.batch, self.rank, outputs, deferred)

    def _failed(self, job: _Job, index: int | None, error: str) -> BatchFailed:
        from walkserve.runtime.messages import BatchFailed, ItemError

        where = f"{job.walk}:{job.node} on rank {self.rank}"
        if index is None:
            return BatchFailed(
                job.batch, self.rank, [ItemError(i, f"{where}: {error}") for i, _ in job.items]
            )
        culprit = job.items[index][1]
        return BatchFailed(
            job.batch,
            self.rank,
            [
                ItemError(
                    item,
                    f"{where}: {error}"
                    if k == index
                    else f"{where}: failed for request {culprit} of the same batch: {error}",
                )
                for k, (item, _) in enumerate(job.items)
            ],
        )

    # ------------------------------------------------------------------ io thread

    def _io_loop(self, rx: zmq.Socket[bytes]) -> None:
        from walkserve.runtime.messages import (
            Ack,
            Cancel,
            Heartbeat,
            MessageError,
            Probe,
            RunBatch,
            Shutdown,
            decode,
        )

        handlers: dict[type, Callable[[Any], object]] = {
            RunBatch: self._prepare,
            Ack: self._on_ack,
            Cancel: lambda m: self.objects.drop(m.request_id),
            Shutdown: lambda m: self._stop(),
            Probe: self._on_probe,
        }
        beat = self.config.heartbeat_s
        next_beat = time.monotonic()
        try:
            while not self._stopping.is_set():
                rx.poll(int(max(0.0, next_beat - time.monotonic()) * 1000) + 1)
                while not self._stopping.is_set() and (data := _recv(rx)) is not None:
                    try:
                        msg: Message = decode(data)
                    except MessageError as e:
                        log.warning("rank %d: ignoring a bad message: %s", self.rank, e)
                        continue
                    handler = handlers.get(type(msg))
                    if handler is None:
                        log.warning("rank %d: unexpected %s", self.rank, type(msg).__name__)
                    else:
                        handler(msg)
                now = time.monotonic()
                if now >= next_beat:
                    self._send(Heartbeat(self.rank, now, self._kv_stats()))
                    next_beat = now + beat
                    if os.getppid() != self._ppid:
                        log.error("rank %d: the conductor process is gone; exiting", self.rank)
                        break
        finally:
            self._stop()

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

    def _stop(self) -> None:
        self._stopping.set()
        self._jobs.put(_STOP)

    def _prepare(self, msg: RunBatch) -> None:
        """Decode a batch's inputs (the overlap with the main thread's current batch), ack the
        shared-memory inputs at once (they were copied out), queue the batch."""
        from walkserve.runtime.messages import Ack, BatchFailed, ItemError

        envs: list[dict[str, Any]] = []
        handles: list[Any] = []
        error = None
        try:
            for item in msg.items:
                env = {}
                for name, payload in item.inputs.items():
                    env[name], tokens = self.transport.receive(payload, item.request_id)
                    handles += tokens
                envs.append(env)
        except Exception as e:
            error = f"inputs of {msg.walk}:{msg.node} could not be read on rank {self.rank}: {e}"
        if handles:
            self._send(Ack(handles))
        if error is not None:
            errors = [ItemError(item.item, error) for item in msg.items]
            self._send(BatchFailed(msg.batch, self.rank, errors))
            return
        items = [(item.item, item.request_id) for item in msg.items]
        self._schedule(_Job(msg.batch, msg.walk, msg.node, items, envs, msg.ops, msg.outputs))

    def _schedule(self, job: _Job) -> None:
        """Queue ``job`` for the main thread, or run it here and now when it is a glue node
        and nothing is queued or running: glue is cheap, and the hand-over to the main thread
        (a thread wake-up) would cost more than the node. Batches still run one at a time, in
        arrival order."""
        with self._backlog_lock:
            glue = self.executor.is_glue(job.walk, job.node, job.ops)
            inline = self._backlog == 0 and glue
            self._backlog += 1
        if not inline:
            self._jobs.put(job)
            return
        try:
            self._send(self._run(job))
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._backlog_lock:
            self._backlog -= 1

    def _on_probe(self, msg: Any) -> None:
        """A link measurement (``runtime.net.link``): read the value, then say so."""
        from walkserve.runtime.messages import ProbeReply

        try:
            self.transport.receive(msg.value, "probe")
        except Exception as e:  # the conductor's timing is off, nothing else
            log.warning("rank %d: unreadable probe: %s", self.rank, e)
        self._send(ProbeReply(msg.seq, self.rank))

    def _on_ack(self, msg: Any) -> None:
        from walkserve.runtime.shm import ShmError

        for handle in msg.handles:
            try:
                self.transport.release([handle])
            except ShmError as e:
                log.warning("rank %d: bad ack: %s", self.rank, e)


def _recv(sock: zmq.Socket[bytes]) -> bytes | None:
    import zmq

    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None


def forbid_pickle() -> None:
    """From now on, every pickle entry point in this process raises (and so does reducing a
    tensor). Nothing on walkserve's data path pickles; this makes sure of it."""
    import _pickle
    import pickle

    import torch

    def forbidden(*args: object, **kwargs: object) -> None:
        raise RuntimeError("pickle is forbidden in walkserve workers")

    for module in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            setattr(module, name, forbidden)
    torch.Tensor.__reduce_ex__ = forbidden  # type: ignore[method-assign,assignment]
