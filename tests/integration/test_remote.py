"""Workers on another "host": ``serve(..., pool_config=PoolConfig(bind=..., remote_ranks=...))`` awaits ranks that
``walkserve worker`` starts elsewhere; control is CURVE-encrypted TCP, tensors to and from
remote ranks travel inline on it (no shared memory between hosts).

Two hosts on one machine: a network namespace joined to this one by a veth pair (made and
removed here; the remote workers run under ``ip netns exec`` and reach the conductor only over
the veth link). Where the sandbox forbids namespaces, the same tests run the remote workers as
ordinary processes that talk to the conductor only over TCP on 127.0.0.1; either way the
conductor's shared-memory pool is checked to have created no segment for them.

Outputs are compared with the reference interpreter by ``walkserve.testing.assert_outputs_match``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from walkserve import capture
from walkserve.adapters.examples import example_placement
from walkserve.adapters.registry import capture_model, load_model
from walkserve.lowering.placement import Placement
from walkserve.runtime.config import PoolConfig
from walkserve.runtime.messages import Join, encode
from walkserve.runtime.net.auth import KeyPair, load_worker_keys
from walkserve.runtime.net.mooncake import MooncakeTransport
from walkserve.runtime.net.mooncake import available as mooncake_available
from walkserve.runtime.server import RequestFailed, Server, serve
from walkserve.runtime.worker import routing_id
from walkserve.testing import assert_outputs_match, mixed_requests

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Hosts:
    """Where the conductor binds and how a command is run on the other host."""

    server_ip: str
    prefix: tuple[str, ...]  # prepended to the remote worker's command line
    how: str


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    ns, a, b = f"wsr{os.getpid()}", f"wsa{os.getpid()}", f"wsb{os.getpid()}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    made = False
    try:
        if shutil.which("ip") is None:
            raise OSError("no 'ip' command (iproute2)")
        _sh("ip", "netns", "add", ns)
        made = True
        _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _sh("ip", "link", "set", b, "netns", ns)
        _sh("ip", "addr", "add", f"{subnet}.1/24", "dev", a)
        _sh("ip", "link", "set", a, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", b)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", b, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        hosts = Hosts(f"{subnet}.1", ("ip", "netns", "exec", ns), f"netns {ns} over veth")
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        logging.getLogger(__name__).warning(
            "network namespaces refused here (%s %s); remote workers talk over TCP on 127.0.0.1",
            e,
            err.decode(errors="replace").strip(),
        )
        hosts = Hosts("127.0.0.1", (), "processes over TCP on 127.0.0.1")
    try:
        yield hosts
    finally:
        if made:
            subprocess.run(["ip", "link", "del", a], capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


# below Linux's default ephemeral range (32768-60999): a port in it may be taken by any
# outgoing connection of the test's own processes (a fresh-clone run once failed to bind 46290)
_PORTS = iter(range(20000 + (os.getpid() % 290) * 40, 32766, 2))


def start_workers(
    hosts: Hosts,
    port: int,
    ranks: list[int],
    keys: Path,
    extra: list[str] | None = None,
    path: str = str(ROOT),
) -> list[Any]:
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")
    return [
        subprocess.Popen(
            [
                *hosts.prefix,
                sys.executable,
                "-m",
                "walkserve.cli",
                "worker",
                "--conductor",
                f"tcp://{hosts.server_ip}:{port}",
                "--rank",
                str(rank),
                "--keys",
                str(keys),
                "--threads",
                "1",
                "--setup-timeout",
                "120",
                *(extra or []),
            ],
            env=env,
        )
        for rank in ranks
    ]


def stop(procs: list[Any]) -> list[int | None]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(30))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait(10))
    return codes


def check_walks(server: Server, name: str, n: int) -> None:
    model, sample = load_model(name)
    captured = capture.trace(model, sample)
    reqs = mixed_requests(name, sample, n)
    for walk in captured.graph.entry_walks():
        handles = [server.submit(r, walk) for r in reqs]  # all in flight at once
        for handle, r in zip(handles, reqs):
            assert_outputs_match(handle.result(timeout=120), captured.run(r, walk))


def segments_created(server: Server) -> int:
    return sum(c.created for c in server.pool.shm_stats().classes)


def test_cfg_branches_on_two_hosts_and_intruders_refused(
    hosts: Hosts, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CFG branches: rank 0 here, rank 1 on the other host (the placement names it; the
    server awaits it instead of spawning it, measures its link and reports the edges that
    cross hosts). Then a peer without CURVE and one with a key the server does not know are
    refused (logged, never answered) while the server goes on serving."""
    name, port = "example-cfg-image", next(_PORTS)
    base = Placement.from_file(example_placement(name, 2))
    placement = dataclasses.replace(base, hosts={1: "host-b"})
    workers = start_workers(hosts, port, [1], tmp_path)
    try:
        pool = PoolConfig(bind=f"tcp://{hosts.server_ip}:{port}", keys_dir=str(tmp_path))
        with serve(name, placement, pool_config=pool) as server:
            health = server.health()
            assert health[1].status == "ready" and health[1].pid == workers[0].pid
            assert server.pool.config.remote_ranks == (1,)
            link = server.pool.links[1]
            assert link.alpha_s < 0.5 and link.beta_bytes_per_s > 1e5, link
            edges = server.cross_host_edges
            assert edges and {e.dst_host for e in edges} >= {"host-b"}, edges
            for e in edges:
                hops = (e.src_host == "host-b") + (e.dst_host == "host-b")
                assert e.seconds == pytest.approx(hops * link.seconds(e.nbytes)), e
            check_walks(server, name, 4)
            assert (tmp_path / "rank-1.secret").stat().st_mode & 0o077 == 0

            ctx = zmq.Context()
            try:
                with caplog.at_level(logging.WARNING, logger="walkserve.net"):
                    plain = ctx.socket(zmq.DEALER)  # no keys at all
                    plain.setsockopt(zmq.ROUTING_ID, routing_id(0))  # even posing as rank 0
                    wrong = ctx.socket(zmq.DEALER)  # CURVE, with a key nobody gave it
                    server_public, _ = load_worker_keys(tmp_path, 1)
                    intruder = KeyPair.generate()
                    wrong.curve_serverkey = server_public.encode()
                    wrong.curve_publickey = intruder.public.encode()
                    wrong.curve_secretkey = intruder.secret.encode()
                    for sock in (plain, wrong):
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(f"tcp://{hosts.server_ip}:{port}")
                        sock.send(encode(Join(0, 4242)), zmq.NOBLOCK)
                    deadline = time.monotonic() + 3.0
                    while time.monotonic() < deadline and len(_refusals(caplog)) < 2:
                        time.sleep(0.05)
                    assert not plain.poll(300) and not wrong.poll(10)  # no reply, ever
                refusals = _refusals(caplog)
                assert any("handshake failed" in m for m in refusals), refusals
                assert any(intruder.public in m for m in refusals), refusals
            finally:
                ctx.destroy(linger=0)
            assert server.health()[0].status == "ready"
            check_walks(server, name, 1)  # still serving
    finally:
        codes = stop(workers)
    assert codes == [0], f"remote worker exit codes {codes} ({hosts.how})"


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


def test_speech_stages_on_another_host_without_shared_memory(
    hosts: Hosts, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Speech: thinker (rank 0) and talker + codec (rank 1) both remote, so every tensor
    crosses hosts: every one, however small, through Mooncake TCP transfers (inline on the
    encrypted control socket where mooncake does not import; the CFG test covers inline).
    The conductor's shared-memory pool makes no segment."""
    ok, why = mooncake_available()
    data = "mooncake" if ok else "inline"
    if not ok:
        logging.getLogger(__name__).warning("mooncake does not import (%s): inline", why)
    name, port = "example-speech", next(_PORTS)
    extra = ["--inline-max-bytes", "0"] if data == "mooncake" else []
    workers = start_workers(hosts, port, [0, 1], tmp_path, extra)
    try:
        pool = PoolConfig(
            bind=f"tcp://{hosts.server_ip}:{port}",
            remote_ranks=(0, 1),
            keys_dir=str(tmp_path),
            remote_data=data,
            inline_max_bytes=0 if data == "mooncake" else 64 << 10,
        )
        with serve(name, example_placement(name, 2), pool_config=pool) as server:
            check_walks(server, name, 4)
            assert segments_created(server) == 0
            assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}
            transport = server.pool.remote_transport
            if data == "mooncake":
                assert isinstance(transport, MooncakeTransport)
                assert transport.reads > 0 and transport.writes > 0, (
                    transport.reads,
                    transport.writes,
                )
                deadline = time.monotonic() + 5.0
                while transport.held and time.monotonic() < deadline:  # the last Acks
                    time.sleep(0.05)
                assert transport.held == 0
    finally:
        codes = stop(workers)
    assert codes == [0, 0], f"remote worker exit codes {codes} ({hosts.how})"


def test_values_between_hosts_go_rank_to_rank_through_mooncake(
    hosts: Hosts, tmp_path: Path
) -> None:
    """Ranks 0 and 2 here, rank 1 on the other host, data through Mooncake: a 1 MiB value
    made on rank 0 is read by rank 1's loop, whose 1 MiB result is read by rank 2. Each rank
    keeps what it made and exports it for the other host; the reader pulls it with one
    Mooncake read, so the server process handles neither (its transports count the bytes),
    and every held value and exported block is freed when the request ends. A value read only
    on its own host (rank 0's, by rank 2, in ``direct``) is held and not exported."""
    ok, why = mooncake_available()
    if not ok:
        pytest.skip(f"mooncake-transfer-engine does not import here: {why}")
    from waiting import settled, wait_for

    here = str(Path(__file__).resolve().parent)  # rank_local_models, for the remote worker
    model, port = "rank_local_models:two_stage", next(_PORTS)
    captured = capture_model(model)
    placement = Placement.from_dict(
        {"ranks": 3, "nodes": {"widen": [0], "step": [1], "reduce": [2]}, "hosts": {1: "b"}}
    )
    workers = start_workers(hosts, port, [1], tmp_path, path=f"{ROOT}{os.pathsep}{here}")
    try:
        pool = PoolConfig(
            bind=f"tcp://{hosts.server_ip}:{port}", keys_dir=str(tmp_path), remote_data="mooncake"
        )
        with serve(captured, placement, pool_config=pool) as server:
            assert server.pool.config.remote_ranks == (1,)
            paths = (server.pool._transport, server.pool.remote_transport)

            def exported() -> list[int]:
                ranks = server.stats().ranks
                return [ranks[r].counters.get("objects/exported", 0) for r in range(3)]

            for k in range(3):
                inputs = {"x": torch.randn(1, 4), "steps": 2 + k}
                before = sum(t.bytes_in + t.bytes_out for t in paths)
                got = server.run(inputs, "looped", timeout=120)
                assert_outputs_match(got, captured.run(inputs, "looped"))
                moved = sum(t.bytes_in + t.bytes_out for t in paths) - before
                assert moved < 4096, moved  # inputs and the [1, 4] result, not 2 MiB
                assert wait_for(lambda: settled(server)), server.stats()
            assert exported() == [3, 3, 0]  # rank 0's value for rank 1, rank 1's for rank 2
            for _ in range(2):  # rank 0's value read by rank 2 only: one host, no export
                inputs = {"x": torch.randn(1, 4)}
                before = sum(t.bytes_in + t.bytes_out for t in paths)
                got = server.run(inputs, "direct", timeout=120)
                assert_outputs_match(got, captured.run(inputs, "direct"))
                assert sum(t.bytes_in + t.bytes_out for t in paths) - before < 4096
                assert wait_for(lambda: settled(server)), server.stats()
            assert exported() == [3, 3, 0]
            stats = server.stats()
            assert all(stats.ranks[r].objects == 0 for r in range(3))
            # cancelled while rank 1 loops over the value it pulled: nothing stays held
            handle = server.submit({"x": torch.randn(1, 4), "steps": 100_000}, "looped")
            assert wait_for(lambda: server.stats().ranks[1].runs == 1, timeout=60)
            handle.cancel()
            with pytest.raises(RequestFailed, match="cancelled"):
                handle.result(timeout=60)
            assert wait_for(lambda: settled(server)), server.stats()
            stats = server.stats()
            assert all(stats.ranks[r].objects == 0 for r in range(3))
            assert stats.ranks[1].runs == 0
            inputs = {"x": torch.randn(1, 4), "steps": 1}
            assert_outputs_match(
                server.run(inputs, "looped", timeout=120), captured.run(inputs, "looped")
            )
    finally:
        codes = stop(workers)
    assert codes == [0], f"remote worker exit codes {codes} ({hosts.how})"
