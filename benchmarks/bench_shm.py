"""Shared-memory transfer vs a bare memcpy: ``python benchmarks/bench_shm.py [--quick]``.

One transfer = the owner writes a tensor into the pool, sends the handle to a reader process
(spawned, never forked) in a ``RunNode`` message, the reader reads it and answers ``Ack``, and
the owner acks the slot: write + read + ack, one tensor in flight at a time. The baseline is
``dst.copy_(src)`` of the same size into a warm buffer, in this process. Reported ratio:
memcpy time / transfer time, i.e. the fraction of memcpy bandwidth the transfer achieves.

Reader modes, the same handle each time:
    copy  ``ShmReader.read(h)``: a fresh tensor (its pages fault in on first touch)
    into  ``ShmReader.read_into(h, out)``: into a reused buffer (a static input buffer)
    view  ``ShmReader.read(h, copy=False)``: zero-copy view, the owner's write is the only copy

Writes ``benchmarks/results/shm.json``. Environment knobs worth trying (recorded in the
results): ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY`` (default here: PASSIVE), and
``THP_MEM_ALLOC_ENABLE=1`` (huge pages for torch's CPU allocations: ``copy`` mode is dominated
by faulting in the fresh output tensor's pages).
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
from multiprocessing.connection import Connection
from pathlib import Path

from walkserve.benchmarking import git_commit

# Idle OpenMP threads sleep instead of spinning: with the owner and the reader on the same
# cores, a spinning pool in one process steals the CPU the other needs for its copy. Set
# before torch loads; inherited by the spawned reader; recorded in the results.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if importlib.util.find_spec("walkserve") is None:
    # Run as a script from a checkout without `pip install -e .`: import the checkout.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from walkserve.runtime.messages import Ack, AttachPools, RunNode, Shutdown, decode, encode
from walkserve.runtime.shm import MiB, ShmHandle, ShmPool, ShmPoolConfig
from walkserve.runtime.shmreader import ShmReader

SIZES = {"1 KiB": 1 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
MODES = ("copy", "into", "view")
RESULTS = Path(__file__).parent / "results" / "shm.json"
ENV_KNOBS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")


def reader_main(conn: Connection) -> None:
    """The reader process: attach, then answer every ``RunNode`` with an ``Ack``."""
    reader = ShmReader()
    outs: dict[int, torch.Tensor] = {}  # "into" mode: one reused buffer per size
    while True:
        msg = decode(conn.recv_bytes())
        if isinstance(msg, AttachPools):
            for spec in msg.pools:
                reader.add(spec)
        elif isinstance(msg, RunNode):
            handles = [ref for ref in msg.inputs if isinstance(ref, ShmHandle)]
            for h in handles:
                if msg.node == "into":
                    out = outs.get(h.header.nbytes)
                    if out is None:
                        out = outs[h.header.nbytes] = torch.empty(h.header.shape, dtype=torch.uint8)
                    reader.read_into(h, out)
                else:
                    t = reader.read(h, copy=msg.node == "copy")
                    del t
            conn.send_bytes(encode(Ack(handles)))
        elif isinstance(msg, Shutdown):
            break
    reader.close()


def time_memcpy(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_transfer(pool: ShmPool, conn: Connection, nbytes: int, mode: str, reps: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    samples = []
    for i in range(reps + 2):  # the first two touch fresh pages on both sides
        t0 = time.perf_counter()
        handle = pool.write(src)
        conn.send_bytes(encode(RunNode(["bench"], mode, i, [handle])))
        ack = decode(conn.recv_bytes())
        assert isinstance(ack, Ack)
        for h in ack.handles:
            pool.ack(h)
        if i >= 2:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reader_main, args=(child,), daemon=True)
    proc.start()
    rows = []
    config = ShmPoolConfig(max_slot_bytes=64 * MiB, slots_per_class=2, when_exhausted="raise")
    with ShmPool(config) as pool:
        parent.send_bytes(encode(AttachPools([pool.spec])))
        for label, nbytes in SIZES.items():
            reps = max(5, min(500, (512 * MiB) // nbytes // (4 if args.quick else 1)))
            memcpy_s = time_memcpy(nbytes, reps)
            row: dict[str, object] = {
                "size": label,
                "nbytes": nbytes,
                "reps": reps,
                "memcpy_s": memcpy_s,
            }
            for mode in MODES:
                transfer_s = time_transfer(pool, parent, nbytes, mode, reps)
                row[f"{mode}_s"] = transfer_s
                row[f"{mode}_ratio"] = memcpy_s / transfer_s
            rows.append(row)
            print_row(row)
        parent.send_bytes(encode(Shutdown()))
        proc.join(timeout=30)

    result = {
        "benchmark": "shm transfer (write + read in another process + ack) vs torch memcpy",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "env": {k: os.environ.get(k) for k in ENV_KNOBS},
        "target": "64 MiB transfer at >= 50% of memcpy bandwidth",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def print_row(row: dict[str, object]) -> None:
    if row["size"] == next(iter(SIZES)):
        head = f"{'size':>8} {'memcpy':>10}" + "".join(f" {m + ' (ratio)':>22}" for m in MODES)
        print(head)
    cells = [f"{row['size']:>8}", f"{_us(row['memcpy_s']):>10}"]
    for mode in MODES:
        cells.append(f"{_us(row[f'{mode}_s']):>12} ({row[f'{mode}_ratio']:.2f})".rjust(22))
    print(" ".join(cells))


def _us(seconds: object) -> str:
    assert isinstance(seconds, float)
    return f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    main()
