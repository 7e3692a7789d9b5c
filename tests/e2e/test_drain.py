"""A graceful drain of ``walkserve serve`` (the built-in default model, through HTTP): SIGTERM
with 8 streams in flight -> every stream completes, a new request meanwhile gets 503 with
Retry-After, the process exits 0 and leaves nothing behind (no socket directory
``walkserve-<pid>-*`` in the temporary directory, no shared-memory segment of a worker).
SIGKILL of the server: ``tests/integration/test_exits.py``."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading
import time
from typing import Any

import httpx

STREAMS = 8


def socket_dirs(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"walkserve-{pid}-*"))


def rank_segments(health: dict[str, Any]) -> list[str]:
    pools = [r["shm_pool"] for r in health["ranks"].values() if r["shm_pool"]]
    return [n for n in os.listdir("/dev/shm") for p in pools if n.startswith(f"wsp_{p}_")]


def test_sigterm_drains_the_streams_in_flight_then_exits_0(walkserve_serve: Any) -> None:
    with walkserve_serve("--shutdown-grace", "60") as server:
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert socket_dirs(server.proc.pid)
        body = {
            "model": "walkserve-default",
            "prompt": "drain",
            "max_tokens": 96,
            "ignore_eos": True,
            "stream": True,
        }
        started = [threading.Event() for _ in range(STREAMS)]
        ended: list[tuple[float, int, bool]] = []  # (when, chunks, saw [DONE])

        def stream(i: int) -> None:
            chunks, done = 0, False
            url = f"{server.url}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=120) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        started[i].set()
                        done = done or line == "data: [DONE]"
                        chunks += 1
            ended.append((time.monotonic(), chunks, done))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in started)
        server.proc.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()
        refused = None
        while refused is None and time.monotonic() - sigterm < 30:  # the signal lands
            r = httpx.post(
                f"{server.url}/v1/completions", json=body | {"stream": False}, timeout=30
            )
            if r.status_code == 503:
                refused = r
        for t in threads:
            t.join(120)
        assert refused is not None, "no 503 after SIGTERM"
        assert refused.headers["retry-after"] and "shutting down" in refused.text
        assert len(ended) == STREAMS and all(done for _, _, done in ended), ended
        assert any(when > sigterm for when, _, _ in ended), "every stream ended before SIGTERM"
        assert server.proc.wait(60) == 0
        out = server.proc.stdout.read() if server.proc.stdout else ""
        assert "draining" in out, out
        assert socket_dirs(server.proc.pid) == []
        assert rank_segments(health) == []
