"""The data plane across real processes: a spawned worker reads tensors from the parent's pool,
acks them, and echoes them back through a pool of its own.

Everything between the processes goes through ``messages.encode``/``decode`` over
``Connection.send_bytes`` (no pickle: the worker forbids pickle once it is running). The last
test runs the whole exchange in a fresh interpreter to see what it leaves behind: resource
tracker warnings on stderr, or segments in /dev/shm.
"""

from __future__ import annotations

import _pickle
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from walkserve.runtime.messages import (
    Ack,
    AttachPools,
    Hello,
    Message,
    NodeDone,
    NodeFailed,
    RunNode,
    Shutdown,
    decode,
    encode,
)
from walkserve.runtime.shm import (
    InvalidHandle,
    KiB,
    MiB,
    ShmHandle,
    ShmPool,
    ShmPoolConfig,
)
from walkserve.runtime.shmreader import ShmReader

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

CONFIG = ShmPoolConfig(
    min_slot_bytes=64 * KiB, max_slot_bytes=4 * MiB, slots_per_class=8, block_timeout_s=5.0
)
TIMEOUT_S = 60.0


def forbid_pickle() -> None:
    """From now on, any use of pickle in this process raises."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the data path")

    for module in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            setattr(module, name, forbidden)
    torch.Tensor.__reduce_ex__ = forbidden  # type: ignore[method-assign,assignment]


def send(conn: Connection, msg: Message) -> None:
    conn.send_bytes(encode(msg))


def recv(conn: Connection) -> Message:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"no message within {TIMEOUT_S} s")
    return decode(conn.recv_bytes())


def worker_main(conn: Connection) -> None:
    """The worker: reads what ``RunNode`` names, acks it, and echoes it from its own pool."""
    forbid_pickle()
    reader = ShmReader()
    pool = ShmPool(CONFIG)
    send(conn, Hello(rank=1, pid=os.getpid()))
    send(conn, AttachPools([pool.spec]))
    while True:
        msg = recv(conn)
        if isinstance(msg, AttachPools):
            for spec in msg.pools:
                reader.add(spec)
        elif isinstance(msg, RunNode):
            handles = [ref for ref in msg.inputs if isinstance(ref, ShmHandle)]
            try:
                tensors = [reader.read(h) for h in handles]
            except InvalidHandle as e:
                send(conn, NodeFailed(msg.request_ids, msg.node, str(e)))
                continue
            send(conn, Ack(handles))
            outputs: list[ShmHandle] = [pool.write(t) for t in tensors]
            send(conn, NodeDone(msg.request_ids, msg.node, msg.iteration, list(outputs)))
        elif isinstance(msg, Ack):
            for h in msg.handles:
                pool.ack(h)
        elif isinstance(msg, Shutdown):
            break
    leaked = pool.stats().in_use
    reader.close()
    pool.close()
    conn.close()
    sys.exit(0 if leaked == 0 else 3)


class Worker:
    """The parent's end: a spawned worker process and the pipe to it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        hello = recv(self.conn)
        assert isinstance(hello, Hello) and hello.pid == self.proc.pid
        attach = recv(self.conn)
        assert isinstance(attach, AttachPools)
        self.pool_id = attach.pools[0].pool_id
        self.reader = ShmReader(attach.pools)

    def stop(self) -> int | None:
        send(self.conn, Shutdown())
        self.proc.join(TIMEOUT_S)
        self.reader.close()
        return self.proc.exitcode


def shm_entries(pool_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if pool_id in n]


def example_tensors() -> list[torch.Tensor]:
    return [
        torch.randn(64, 48).t(),  # non-contiguous
        torch.randn(8, 8).to(torch.bfloat16),
        torch.tensor(-7, dtype=torch.int64),  # 0-d
        torch.rand(3, 4) > 0.5,
        torch.randn(10, 10, dtype=torch.complex64)[::2],
        torch.randint(0, 255, (3 * MiB,), dtype=torch.uint8),
        torch.zeros(0, 3),
    ]


def exchange(pool: ShmPool, worker: Worker, tensors: list[torch.Tensor]) -> None:
    """Send ``tensors`` to the worker, check its ack and its echo, ack the echo."""
    handles = [pool.write(t) for t in tensors]
    send(worker.conn, AttachPools([pool.spec]))
    send(worker.conn, RunNode(["r1"], "echo", 0, list(handles)))
    ack = recv(worker.conn)
    assert isinstance(ack, Ack) and ack.handles == handles
    for h in ack.handles:
        pool.ack(h)
    done = recv(worker.conn)
    assert isinstance(done, NodeDone)
    echoed = [ref for ref in done.outputs if isinstance(ref, ShmHandle)]
    assert [h.pool_id for h in echoed] == [worker.pool_id] * len(tensors)
    for h, t in zip(echoed, tensors):
        out = worker.reader.read(h)
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out, t)
    send(worker.conn, Ack(echoed))


@pytest.fixture(scope="module", autouse=True)
def fresh_driver() -> Iterator[subprocess.Popen[str]]:
    """``run_driver`` in a fresh interpreter, started before this module's first test so that
    it runs alongside them (each interpreter spends seconds importing torch)."""
    root = Path(__file__).resolve().parents[2]
    paths = [str(root), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import test_shm_processes as t; t.run_driver()"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    if w.proc.is_alive():
        w.proc.kill()
        w.proc.join(5)


def test_worker_reads_acks_and_echoes(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (pickle, _pickle):
        monkeypatch.setattr(module, "dumps", None)
        monkeypatch.setattr(module, "loads", None)
    tensors = example_tensors()
    with ShmPool(CONFIG) as pool:
        exchange(pool, worker, tensors)
        stats = pool.stats()
        assert stats.in_use == 0 and stats.idle == sum(c.created for c in stats.classes)

        # A slot held by two readers (the worker and the parent) stays put until both ack.
        shared = pool.write(tensors[0], readers=2)
        send(worker.conn, RunNode(["r2"], "echo", 1, [shared]))
        ack = recv(worker.conn)
        assert isinstance(ack, Ack)
        pool.ack(ack.handles[0])
        assert pool.stats().in_use == 1
        assert torch.equal(ShmReader([pool.spec]).read(shared), tensors[0])
        pool.ack(shared)
        assert pool.stats().in_use == 0
        done = recv(worker.conn)
        assert isinstance(done, NodeDone)
        send(worker.conn, Ack([h for h in done.outputs if isinstance(h, ShmHandle)]))

        # The slot is reused; the worker rejects the old handle instead of reading new bytes.
        reused = pool.write(tensors[0])
        assert reused.index == shared.index
        send(worker.conn, RunNode(["r3"], "echo", 2, [shared]))
        failed = recv(worker.conn)
        assert isinstance(failed, NodeFailed) and "generation" in failed.error
        pool.ack(reused)

        # A forged index and an unknown pool are rejected in the worker too.
        for forged in (
            ShmHandle(pool.pool_id, 10**6, 1, shared.header),
            ShmHandle("f" * 16, 0, 1, shared.header),
        ):
            send(worker.conn, RunNode(["r4"], "echo", 3, [forged]))
            assert isinstance(recv(worker.conn), NodeFailed)

        assert worker.stop() == 0  # the worker's own pool was back to idle
    assert shm_entries(pool.pool_id) == []
    assert shm_entries(worker.pool_id) == []


def run_driver() -> None:
    """The whole exchange in this (fresh) interpreter; prints the pool ids it used. One pool
    is left for interpreter exit to clean up."""
    forbid_pickle()
    worker = Worker()
    pool = ShmPool(CONFIG)
    exchange(pool, worker, example_tensors())
    assert worker.stop() == 0
    pool.close()
    unclosed = ShmPool(CONFIG)
    unclosed.write(torch.ones(10))
    print(json.dumps([pool.pool_id, worker.pool_id, unclosed.pool_id]))


def test_fresh_interpreter_leaves_no_segments_and_no_tracker_warnings(
    fresh_driver: subprocess.Popen[str],
) -> None:
    stdout, stderr = fresh_driver.communicate(timeout=2 * TIMEOUT_S)
    assert fresh_driver.returncode == 0, stderr
    for word in ("resource_tracker", "leaked", "Traceback", "Warning"):
        assert word not in stderr, stderr
    pool_ids = json.loads(stdout.strip().splitlines()[-1])
    assert len(pool_ids) == 3
    for pool_id in pool_ids:
        assert shm_entries(pool_id) == []
