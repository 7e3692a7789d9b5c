"""Tensor transfer time by data path: ``python benchmarks/bench_net.py [--quick]``.

For tensors of 1 KiB, 1 MiB and 64 MiB (uint8), the median time of one producer-to-consumer
transfer through the transport API (``send``, ``receive``, ``release``), per path:

    shm         ShmTransport: copy into the producer's shared-memory pool, copy out (one host)
    peer        a rank's pull of a value another rank of its host holds (``runtime.peers``):
                ``PeerClient.fetch`` in this process from a ``PeerServer`` in another (its
                peer link, a Unix socket; the bytes through the producer's shared memory, or
                inline below 64 KiB), the slot acked
    mooncake    MooncakeTransport: copy into the producer's registered buffer, one Mooncake
                ``transfer_sync_read`` over protocol tcp (P2PHANDSHAKE) into the consumer's
                registered buffer, copy out; the consumer engine runs in another process,
                on 127.0.0.1 (loopback TCP, not a real NIC)
    tcp-inline  the tensor inline in a msgspec message over a CURVE-encrypted ZeroMQ
                DEALER -> ROUTER pair on 127.0.0.1 (what remote ranks use by default)

and alpha and beta of ``t = alpha + bytes / beta`` (review eq. 8) fitted per path over
the three sizes. Writes ``benchmarks/results/net.json`` (cpu count, torch version, git commit,
load average). ``--quick``: fewer repeats. Small shared VMs are noisy: compare paths within
one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GLOG_minloglevel", "2")

import torch

if importlib.util.find_spec("walkserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from walkserve.benchmarking import git_commit

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1 << 10, 1 << 20, 64 << 20)
MiB = 1 << 20


def repeats_for(nbytes: int, quick: bool) -> int:
    n = 5 if nbytes >= 64 * MiB else 50
    return max(3, n // 5) if quick else n


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up (first connection, page faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_shm(quick: bool) -> dict[int, float]:
    from walkserve.runtime.shm import ShmPool, ShmPoolConfig
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.transport import ShmTransport

    pool = ShmPool(ShmPoolConfig(max_slot_bytes=128 * MiB, slots_per_class=2))
    reader = ShmReader([pool.spec])
    producer = ShmTransport(pool, ShmReader(), inline_max_bytes=0)
    consumer = ShmTransport(pool, reader, inline_max_bytes=0)
    out = {}
    try:
        for n in SIZES:
            t = torch.ones(n, dtype=torch.uint8)

            def once(t: torch.Tensor = t) -> None:
                payload = producer.send(t, "r")
                _, tokens = consumer.receive(payload, "r")
                producer.release(tokens)

            out[n] = timed(once, repeats_for(n, quick))
    finally:
        reader.close()
        pool.close()
    return out


def _peer_producer(conn: Any, path: str) -> None:
    """Child process: a rank holding one tensor of each size, answering fetches on ``path``."""
    from walkserve.runtime.config import INLINE_MAX_BYTES
    from walkserve.runtime.peers import PeerServer
    from walkserve.runtime.shm import ShmPool, ShmPoolConfig
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.transport import ObjectStore

    store = ObjectStore(1)
    keys = [store.put("r", torch.ones(n, dtype=torch.uint8)).key for n in SIZES]
    pool = ShmPool(ShmPoolConfig(max_slot_bytes=128 * MiB, slots_per_class=2))
    server = PeerServer(path, store, pool, ShmReader(), INLINE_MAX_BYTES)
    conn.send(keys)
    conn.recv()  # stop
    server.close()
    pool.close()


def bench_peer(quick: bool) -> dict[int, float]:
    import shutil
    import tempfile

    from walkserve.runtime.peers import PeerClient, peer_address
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.wirevalues import ObjectRef

    directory = tempfile.mkdtemp(prefix="walkserve-bench-")
    path = peer_address(directory, 1)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_peer_producer, args=(child, path))
    proc.start()
    reader = ShmReader()
    client = PeerClient(0, {1: path}, reader)
    out = {}
    try:
        keys = parent.recv()
        for n, key in zip(SIZES, keys):
            ref = ObjectRef(1, key)
            out[n] = timed(lambda ref=ref: client.fetch("r", [ref]), repeats_for(n, quick))
        parent.send("stop")
    finally:
        client.close()
        reader.close()
        proc.join(30)
        if proc.exitcode is None:
            proc.kill()
        shutil.rmtree(directory, ignore_errors=True)
    return out


def _mooncake_consumer(conn: Any) -> None:
    """Child process: a consumer engine; reads each handle it is sent, answers when done."""
    from walkserve.runtime.messages import decode, encode
    from walkserve.runtime.net.mooncake import MooncakeConfig, MooncakeEngine, MooncakeTransport

    engine = MooncakeEngine(MooncakeConfig(send_bytes=1 * MiB, recv_bytes=80 * MiB))
    consumer = MooncakeTransport(engine)
    conn.send_bytes(b"ready")
    while (data := conn.recv_bytes()) != b"stop":
        probe = decode(data)
        consumer.receive(probe.value, "r")  # type: ignore[union-attr]
        conn.send_bytes(encode(probe))


def bench_mooncake(quick: bool) -> dict[int, float]:
    from walkserve.runtime.messages import Probe, encode
    from walkserve.runtime.net.mooncake import MooncakeConfig, MooncakeEngine, MooncakeTransport

    engine = MooncakeEngine(MooncakeConfig(send_bytes=80 * MiB, recv_bytes=1 * MiB))
    producer = MooncakeTransport(engine, inline_max_bytes=0)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_mooncake_consumer, args=(child,))
    proc.start()
    out = {}
    try:
        assert parent.recv_bytes() == b"ready"
        for n in SIZES:
            t = torch.ones(n, dtype=torch.uint8)

            def once(t: torch.Tensor = t) -> None:
                payload = producer.send(t, "r")
                parent.send_bytes(encode(Probe(0, payload)))
                parent.recv_bytes()
                producer.release([payload])

            out[n] = timed(once, repeats_for(n, quick))
        parent.send_bytes(b"stop")
    finally:
        proc.join(30)
        if proc.exitcode is None:
            proc.kill()
    return out


def bench_tcp_inline(quick: bool) -> dict[int, float]:
    import zmq

    from walkserve.runtime.messages import Probe, decode, encode
    from walkserve.runtime.net.auth import ControlGuard, KeyPair, secure_client
    from walkserve.runtime.transport import from_inline, inline

    ctx = zmq.Context()
    server, client = KeyPair.generate(), KeyPair.generate()
    guard = ControlGuard(ctx, server, [client.public])
    router = ctx.socket(zmq.ROUTER)
    guard.secure(router, "bench")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    guard.start()
    dealer = ctx.socket(zmq.DEALER)
    secure_client(dealer, server.public, client)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    out = {}
    try:
        for n in SIZES:
            t = torch.ones(n, dtype=torch.uint8)

            def once(t: torch.Tensor = t) -> None:
                dealer.send(encode(Probe(0, inline(t))))
                ident, data = router.recv_multipart()
                from_inline(decode(data).value)  # type: ignore[union-attr,arg-type]
                router.send_multipart([ident, b"ok"])
                dealer.recv()

            out[n] = timed(once, repeats_for(n, quick))
    finally:
        dealer.close(0)
        router.close(0)
        guard.close()
        ctx.term()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/net.json")
    args = parser.parse_args()
    from walkserve.runtime.net.link import fit_link
    from walkserve.runtime.net.mooncake import available

    paths: dict[str, Any] = {"shm": bench_shm, "peer": bench_peer, "tcp-inline": bench_tcp_inline}
    ok, why = available()
    if ok:
        paths["mooncake"] = bench_mooncake
    results: dict[str, Any] = {}
    for name, bench in paths.items():
        times = bench(args.quick)
        link = fit_link(list(times.items()))
        results[name] = {
            "seconds": {str(n): s for n, s in times.items()},
            "alpha_us": link.alpha_s * 1e6,
            "beta_gb_per_s": link.beta_bytes_per_s / 1e9,
        }
        row = "  ".join(f"{n // 1024:>6} KiB {s * 1e3:9.3f} ms" for n, s in times.items())
        print(f"{name:>10}: {row}   fit: {link}")
    if not ok:
        results["mooncake"] = {"skipped": why}
        print(f"  mooncake: skipped ({why})")
    record = {
        "benchmark": "net",
        "quick": args.quick,
        "sizes_bytes": list(SIZES),
        "paths": results,
        "cpu_count": os.cpu_count(),
        "loadavg_1min": os.getloadavg()[0],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
