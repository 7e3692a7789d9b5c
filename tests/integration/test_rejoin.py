"""A remote rank's process comes and goes, and so does its server (``runtime.rejoin``,
``poolremote``), with real processes over TCP on 127.0.0.1:

- SIGKILL of a remote worker: once the rank is lost (silent past its deadline), a new
  ``walkserve worker`` for that rank joins, is the rank's restart (``restarts`` 1), and the
  next requests are served correctly; a join from yet another pid while it lives is refused.
- SIGSTOP of a remote worker past its deadline: a new worker replaces it; SIGCONT of the old
  one does not disturb the new one (the old one is told to stop, and exits 0).
- The server goes away (its sockets close without a word, as when its process is killed) and
  a new one binds the same address: the still-running remote worker joins it and serves;
  when that one goes away too and none follows, the worker exits 1 after ``--rejoin-timeout``.

Outputs are compared with the same walks run in-process (``assert_outputs_match``). After each
test every worker process has ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_remote import _PORTS, Hosts, check_walks, start_workers, stop
from waiting import wait_for

from walkserve.adapters.examples import example_placement
from walkserve.lowering.placement import Placement
from walkserve.runtime.config import PoolConfig
from walkserve.runtime.messages import Join, encode
from walkserve.runtime.net.auth import load_worker_keys
from walkserve.runtime.server import Server, serve

LOCAL = Hosts("127.0.0.1", (), "processes over TCP on 127.0.0.1")
NAME = "example-cfg-image"


def _placement() -> Placement:
    base = Placement.from_file(example_placement(NAME, 2))
    return dataclasses.replace(base, hosts={1: "host-b"})


def _pool(port: int, keys: Path) -> PoolConfig:
    # a lost remote rank is given up after max(unresponsive_after_s, 3 heartbeats): 3 s
    return PoolConfig(
        bind=f"tcp://127.0.0.1:{port}",
        keys_dir=str(keys),
        heartbeat_s=0.2,
        unresponsive_after_s=3.0,
    )


def _serving(server: Server, pid: int, restarts: int) -> bool:
    h = server.health()[1]
    return h.status == "ready" and h.pid == pid and h.restarts == restarts


def _fake_join(keys: Path, port: int, pid: int) -> None:
    """A CURVE peer holding rank 1's keys that joins as rank 1 from ``pid``."""
    server_public, pair = load_worker_keys(keys, 1)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.ROUTING_ID, b"walkserve-rank-1-gfake")
        sock.curve_serverkey = server_public.encode()
        sock.curve_publickey = pair.public.encode()
        sock.curve_secretkey = pair.secret.encode()
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(encode(Join(1, pid)))
        sock.close()
    finally:
        ctx.term()


def _replace(server: Server, procs: list[Any], port: int, keys: Path) -> None:
    """Wait until rank 1 is lost (its requests fail fast), then start a new worker for it
    and wait until it serves as the rank's restart."""
    assert wait_for(lambda: server.health()[1].status == "dead", 10.0), server.health()
    assert not server.pool.serving(1)
    procs += start_workers(LOCAL, port, [1], keys)
    assert wait_for(lambda: _serving(server, procs[-1].pid, 1), 15.0), server.health()


def test_a_new_worker_replaces_a_killed_remote_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = next(_PORTS)
    procs: list[Any] = start_workers(LOCAL, port, [1], tmp_path)
    try:
        with serve(NAME, _placement(), pool_config=_pool(port, tmp_path)) as server:
            assert _serving(server, procs[0].pid, 0)
            check_walks(server, NAME, 1)
            procs[0].kill()
            procs[0].wait(10)
            _replace(server, procs, port, tmp_path)
            check_walks(server, NAME, 2)

            with caplog.at_level(logging.WARNING, logger="walkserve.pool"):
                _fake_join(tmp_path, port, 4242)
                refused = "remote rank 1: refused a join from pid 4242"
                assert wait_for(lambda: refused in caplog.text, 5.0), caplog.text
            assert _serving(server, procs[1].pid, 1)
            check_walks(server, NAME, 1)
    finally:
        codes = stop(procs)
    assert codes[1] == 0, codes


def test_a_stopped_remote_rank_replaced_and_its_old_process_told_to_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = next(_PORTS)
    procs: list[Any] = start_workers(LOCAL, port, [1], tmp_path)
    try:
        with serve(NAME, _placement(), pool_config=_pool(port, tmp_path)) as server:
            procs[0].send_signal(signal.SIGSTOP)
            _replace(server, procs, port, tmp_path)
            with caplog.at_level(logging.WARNING, logger="walkserve.pool"):
                procs[0].send_signal(signal.SIGCONT)
                assert procs[0].wait(10) == 0  # told to stop
            assert "a replaced process of remote rank 1 spoke again" in caplog.text
            assert _serving(server, procs[1].pid, 1)
            check_walks(server, NAME, 2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            procs[0].send_signal(signal.SIGCONT)
        codes = stop(procs)
    assert codes == [0, 0], codes


def test_a_remote_worker_joins_the_restarted_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = next(_PORTS)
    procs = start_workers(LOCAL, port, [1], tmp_path, ["--rejoin-timeout", "5"])
    try:
        with serve(NAME, _placement(), pool_config=_pool(port, tmp_path)) as first:
            check_walks(first, NAME, 1)
            _vanish(first, monkeypatch)
        assert procs[0].poll() is None, "the remote worker exited with its server"
        with serve(NAME, _placement(), pool_config=_pool(port, tmp_path)) as second:
            assert _serving(second, procs[0].pid, 0)
            check_walks(second, NAME, 2)
            _vanish(second, monkeypatch)
        start = time.monotonic()
        assert procs[0].wait(15) == 1  # no server within --rejoin-timeout: it gives up
        assert 4.0 < time.monotonic() - start < 10.0
    finally:
        codes = stop(procs)
    assert codes == [1], codes


def _vanish(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``server`` close without a word to rank 1 (no Shutdown), as when its process is
    killed; rank 0 (spawned) is stopped as usual."""
    send = server.pool._send

    def not_to_rank_1(state: Any, data: bytes, *, now: bool = False) -> None:
        if state.rank != 1:
            send(state, data, now=now)

    monkeypatch.setattr(server.pool, "_send", not_to_rank_1)
