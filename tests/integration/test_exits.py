"""A server process that is SIGKILLed leaves nothing behind: its workers notice their parent is
gone (at their next heartbeat), exit and remove its socket directory; the shared-memory
segments (its own and its workers') are unlinked by multiprocessing's resource tracker. A
later server also sweeps socket directories of dead servers (``poolstate.sweep_stale_dirs``)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from waiting import wait_for

from walkserve.runtime.poolstate import sweep_stale_dirs

SERVER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from walkserve.adapters.registry import capture_model
    from walkserve.runtime.config import PoolConfig
    from walkserve.runtime.server import serve

    server = serve(capture_model("rank_local_models:two_stage"),
                   pool_config=PoolConfig(heartbeat_s=0.2))
    server.run({"big": torch.randn(1, 4, 1 << 16)}, "mean", timeout=60)  # 1 MiB: shared memory
    pools = [server.pool.shm_pool_id] + [h.shm_pool for h in server.health().values()]
    pids = [h.pid for h in server.health().values()]
    print(json.dumps({"pools": pools, "pids": pids}), flush=True)
    time.sleep(600)
    """
)


def socket_dirs(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"walkserve-{pid}-*"))


def segments(pools: list[str]) -> list[str]:
    return [n for n in os.listdir("/dev/shm") for p in pools if n.startswith(f"wsp_{p}_")]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_sigkill_of_the_server_leaves_no_socket_directory_and_no_segment() -> None:
    here = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        assert socket_dirs(proc.pid) and segments(started["pools"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t0 = time.monotonic()
        assert wait_for(lambda: all(gone(p) for p in started["pids"]), 20), started
        assert wait_for(lambda: socket_dirs(proc.pid) == [], 10), socket_dirs(proc.pid)
        assert wait_for(lambda: segments(started["pools"]) == [], 10)
        print(f"all cleaned {time.monotonic() - t0:.2f} s after the SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_new_server_sweeps_the_socket_directories_of_dead_ones() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(done.stdout)  # exited: no server of that pid lives
    stale = tempfile.mkdtemp(prefix=f"walkserve-{dead}-")
    open(os.path.join(stale, "reports"), "w").close()
    live = tempfile.mkdtemp(prefix=f"walkserve-{os.getpid()}-")
    try:
        sweep_stale_dirs(tempfile.gettempdir())
        assert not os.path.exists(stale) and os.path.isdir(live)
    finally:
        os.rmdir(live)
