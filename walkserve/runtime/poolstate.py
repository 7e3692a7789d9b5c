"""The worker pool's bookkeeping: errors, results, each rank's state, process helpers.

``RankState`` is what the pool knows of one rank (its process and generation, status, last
message, output pool, KV figures, commands held while it restarts); ``Pending`` one batch in flight. ``BatchResult`` and ``RankHealth`` are what
the pool's callers read. The helpers reap processes, describe exit codes and unlink a dead
worker's shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Literal

import zmq

from walkserve.runtime.messages import KVStats
from walkserve.runtime.shm import ShmPoolSpec
from walkserve.runtime.transport import Token

if TYPE_CHECKING:
    from walkserve.runtime.ranklink import Link

log = logging.getLogger("walkserve.pool")

Item = tuple[int, str, Mapping[str, Any]]  # (item id, request id, {input name: value})
DataPath = Literal["shm", "inline", "mooncake"]  # how tensors reach a worker
Status = Literal["starting", "ready", "unresponsive", "restarting", "dead", "failed", "closed"]
# No process serves the rank and none will (a dead rank restarts: ``restarting``, ``starting``)
GONE: frozenset[Status] = frozenset({"dead", "failed", "closed"})


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
    restarts: int = 0  # times its process was started again (``supervisor``)


@dataclass(eq=False)
class Pending:
    rank: int
    walk: str
    node: str
    items: list[int]
    future: Future[BatchResult]
    handles: set[Token]  # input slots the worker has not acked yet
    requests: dict[int, str] = field(default_factory=dict)  # item -> request


@dataclass(eq=False)
class RankState:
    rank: int
    process: BaseProcess
    identity: bytes
    status: Status = "starting"
    pid: int | None = None
    exitcode: int | None = None
    error: str | None = None
    last_seen: float | None = None
    busy_at: float = 0.0  # its last command or report but heartbeats (``WorkerPool.wake``)
    spec: ShmPoolSpec | None = None
    kv: list[KVStats] = field(default_factory=list)  # from its last heartbeat
    settled: threading.Event = field(default_factory=threading.Event)  # ready, or never will be
    generation: int = 0  # restarts so far; in the routing id of its sockets
    started: float = field(default_factory=time.monotonic)  # its process's start
    hung: str | None = None  # why the pool killed it ("sent nothing for 12.0 s (deadline 10 s)")
    backlog: list[bytes] = field(default_factory=list)  # commands held while it restarts
    link: Link | None = None  # its process's rank link, once accepted (ranks of this host)

    @property
    def waiting(self) -> bool:
        """Restarting: commands wait in ``backlog`` until the new process says Hello."""
        return self.status == "restarting" or (self.status == "starting" and self.generation > 0)


def fail_future(future: Future[BatchResult], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def reap(process: BaseProcess, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``process`` to end and reap it. ``join`` alone
    returns early when the sentinel fires, which happens as the process closes its files, a
    moment before it can be reaped."""
    deadline = time.monotonic() + timeout
    while process.exitcode is None and (remaining := deadline - time.monotonic()) > 0:
        process.join(remaining)
        if process.exitcode is None:
            time.sleep(0.001)


def recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    """The next message, or None when none is waiting (asked of the socket's events first:
    a ``zmq.Again`` raised at the end of every drain cost more than the message's read)."""
    if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
        return None
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


def unreachable(state: RankState, error: Exception) -> str:
    """Why a command could not be sent to ``state``'s process: its death, when it has exited
    and the io thread has not seen it yet (a SIGKILLed rank's socket is gone before its exit
    is read: the requests it fails fail as its death's do), else the socket's error."""
    code = None
    with contextlib.suppress(Exception):  # a remote rank has no process of ours to ask
        code = state.process.exitcode  # polled, not waited for
    if code is not None:
        return f"worker rank {state.rank} died ({describe_exit(code)})"
    return f"worker rank {state.rank} is unreachable: {error}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def sweep_stale_dirs(parent: str) -> None:
    """Remove the socket directories (``walkserve-<pid>-*`` in ``parent``) of servers whose
    process is gone: a SIGKILLed server cannot remove its own (its workers try, as they exit)."""
    import os
    import shutil

    for entry in os.scandir(parent):
        parts = entry.name.split("-")
        if len(parts) < 3 or parts[0] != "walkserve" or not parts[1].isdigit():
            continue
        with contextlib.suppress(OSError):
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            pid = int(parts[1])
            try:
                os.kill(pid, 0)
                continue  # its server lives
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("removed %s, left by server process %d", entry.path, pid)


def unlink_segments(spec: ShmPoolSpec) -> None:
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
