"""Workers on other hosts: the conductor's view of a rank it did not spawn, the TCP address
convention, and the entry point of ``walkserve worker``.

Owns: parsing and binding of ``tcp://HOST:PORT`` control addresses (the report ROUTER at PORT,
the command ROUTER at PORT+1), ``RemoteProcess`` (what ``WorkerPool`` keeps in place of a
``multiprocessing`` process for a remote rank: no pid until its ``Join``, an exit code when the
pool closes or the rank falls silent) and ``run_remote_worker`` (the worker side: keys from a
directory, a ``WorkerConfig`` whose tensors all travel inline, then ``rejoin``'s sessions).
What crosses its boundary: addresses (str), key files, the typed messages of ``messages``
over CURVE-encrypted TCP; never pickle, and no shared memory between hosts::

    server host: serve(..., pool_config=PoolConfig(bind="tcp://10.0.0.1:5555",
                                                   remote_ranks=(1,), keys_dir="keys"))
    other host:  walkserve worker --conductor tcp://10.0.0.1:5555 --rank 1 --keys keys
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

log = logging.getLogger("walkserve.net")

INLINE_ALL = 1 << 62  # inline_max_bytes that sends every tensor inline (no shared memory)
_TCP = re.compile(r"tcp://(?P<host>[^:/\s]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)")


def parse_tcp(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://HOST:PORT``; raises ValueError naming the expected form."""
    m = _TCP.fullmatch(address)
    if m is None:
        raise ValueError(f"expected a control address tcp://HOST:PORT, got {address!r}")
    port = int(m["port"])
    if not 0 <= port <= 65534:
        raise ValueError(f"port must be in 0..65534 (PORT and PORT+1 are used), got {port}")
    return m["host"], port


def commands_address(conductor: str) -> str:
    """The command socket that goes with report socket ``conductor`` (PORT+1)."""
    host, port = parse_tcp(conductor)
    return f"tcp://{host}:{port + 1}"


def bind_pair(
    reports: zmq.Socket[bytes], commands: zmq.Socket[bytes], address: str, tries: int = 50
) -> tuple[str, str]:
    """Bind ``reports`` at ``address``'s PORT and ``commands`` at PORT+1 (PORT 0: a free
    pair); returns both addresses."""
    host, port = parse_tcp(address)
    for _ in range(tries if port == 0 else 1):
        p = reports.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port != 0:
            reports.bind(f"tcp://{host}:{p}")
        try:
            commands.bind(f"tcp://{host}:{p + 1}")
        except zmq.ZMQError:
            if port != 0:
                raise
            reports.unbind(f"tcp://{host}:{p}")
            continue
        return f"tcp://{host}:{p}", f"tcp://{host}:{p + 1}"
    raise ValueError(f"found no two free consecutive ports on {host}")


class RemoteProcess:
    """Stands in for ``multiprocessing.Process`` for a rank that runs elsewhere (the parts
    ``WorkerPool`` uses: ``pid``, ``exitcode``, ``sentinel``, ``join``, ``kill``, ``close``).

    ``sentinel`` is a pipe that becomes readable when the rank is given up: silent for
    ``dead_after_s`` after it was last seen (a watchdog thread asks ``last_seen``; while
    ``starting()``, building from its setup without heartbeats, ``start_timeout_s``), or killed.
    When ``closing()`` is true (the pool sent Shutdown) ``join`` settles it with exit code 0."""

    def __init__(
        self,
        rank: int,
        closing: Callable[[], bool],
        last_seen: Callable[[], float | None],
        dead_after_s: float,
        starting: Callable[[], bool] = lambda: False,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.rank = rank
        self.name = f"walkserve-remote-{rank}"
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._closing = closing
        self._last_seen = last_seen
        self._dead_after_s = dead_after_s
        self._starting = starting
        self._start_timeout_s = start_timeout_s
        self._read, self._write = os.pipe()
        self.sentinel = self._read
        self._ended = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, name=self.name, daemon=True)
        self._watch.start()

    def _watchdog(self) -> None:
        while not self._ended.wait(0.2):
            seen = self._last_seen()
            limit = self._start_timeout_s if self._starting() else self._dead_after_s
            if seen is not None and time.monotonic() - seen > limit:
                log.error("remote rank %d silent for %.0f s; giving it up", self.rank, limit)
                self._end(1)

    def _end(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
        if not self._ended.is_set():
            self._ended.set()
            os.write(self._write, b"x")

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._closing():
            self._end(0)
            return
        self._ended.wait(timeout)

    def kill(self) -> None:
        self._end(-9)

    terminate = kill

    def close(self) -> None:
        self._end(self.exitcode if self.exitcode is not None else 0)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read = self._write = -1


def remote_transport(
    data: str, conductor: str, objects: Any, inline_max_bytes: int = 64 << 10
) -> Any:
    """The transport of a worker whose conductor is on another host: ``inline`` (every tensor
    in the messages) or ``mooncake`` (an engine at this host's address towards the
    conductor; tensors under ``inline_max_bytes`` still travel inline)."""
    from walkserve.runtime.transport import ShmTransport

    if data == "inline":
        return ShmTransport(
            cast(Any, None), cast(Any, None), inline_max_bytes=INLINE_ALL, objects=objects
        )
    if data == "mooncake":
        from walkserve.runtime.net.mooncake import (
            MooncakeConfig,
            MooncakeEngine,
            MooncakeTransport,
            local_ip_towards,
        )

        host, _ = parse_tcp(conductor)
        engine = MooncakeEngine(MooncakeConfig(host=local_ip_towards(host)))
        return MooncakeTransport(engine, inline_max_bytes=inline_max_bytes, objects=objects)
    raise ValueError(f"data path must be 'shm', 'inline' or 'mooncake', got {data!r}")


def run_remote_worker(
    conductor: str,
    rank: int,
    keys_dir: str | os.PathLike[str],
    threads: int | None = None,
    setup_timeout_s: float = 120.0,
    heartbeat_s: float = 1.0,
    inline_max_bytes: int = 64 << 10,
    rejoin_timeout_s: float = 300.0,
) -> int:
    """Join the conductor at ``conductor`` (its report socket, ``tcp://HOST:PORT``) as rank
    ``rank``; serve until it sends Shutdown, joining again when it goes away (for up to
    ``rejoin_timeout_s``: ``runtime.rejoin``). Returns the exit code (0: clean)."""
    from walkserve.runtime.net.auth import load_worker_keys
    from walkserve.runtime.rejoin import run_sessions
    from walkserve.runtime.worker import WorkerConfig, default_threads

    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    commands = commands_address(conductor)
    server_key, pair = load_worker_keys(keys_dir, rank, wait_s=setup_timeout_s)
    n = (
        threads if threads is not None else default_threads(1, reserved=0)
    )  # no conductor on this host
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)
    config = WorkerConfig(
        threads=n,
        commands_addr=commands,
        heartbeat_s=heartbeat_s,
        setup_timeout_s=setup_timeout_s,
        inline_max_bytes=inline_max_bytes,  # for Mooncake; the conductor may say "inline"
        curve_server_key=server_key,
        curve_public_key=pair.public,
        curve_secret_key=pair.secret,
    )
    log.info("rank %d joining %s", rank, conductor)
    return run_sessions(rank, conductor, config, rejoin_timeout_s)


__all__ = [
    "INLINE_ALL",
    "RemoteProcess",
    "bind_pair",
    "commands_address",
    "parse_tcp",
    "run_remote_worker",
]
