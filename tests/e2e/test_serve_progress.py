"""``walkserve serve`` as a subprocess: its start-up stages appear on stderr, in order, before
it answers; the text engine's line says which engine serves it and how long its self-check
took."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time

import httpx

STAGES = [
    "loading weights",
    "checking text engines",
    r"engine lm: LlamaForCausalLM on the paged KV pool \(self-check passed in [0-9.]+ s: .+\)",
    "capturing walks",
    "lowering",
    "starting 1 worker",
    "ready",
]


def test_startup_stages_appear_in_order_on_stderr() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "walkserve.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not lines or not lines[-1].endswith("] ready"):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stderr.readline().rstrip("\n"))
        stages = [re.fullmatch(r"walkserve: \[ *([0-9.]+) s\] (.+)", line) for line in lines]
        assert all(stages), lines  # nothing else on stderr before "ready"
        names = [m.group(2) for m in stages if m]
        assert len(names) == len(STAGES) and all(map(re.fullmatch, STAGES, names)), names
        elapsed = [float(m.group(1)) for m in stages if m]
        assert elapsed == sorted(elapsed)
        deadline = time.monotonic() + 30
        while True:  # "ready" comes just before the socket opens
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
