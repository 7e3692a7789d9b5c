"""End-to-end fixtures: ``walkserve_serve`` starts ``walkserve serve`` as a subprocess on a free
127.0.0.1 port and waits until ``/health`` answers::

    with walkserve_serve("--api-key", KEY) as server:
        httpx.get(f"{server.url}/v1/models")
        output = server.stop()      # Ctrl-C, as a user would; returns what it printed

Leaving the block stops it too (and kills it if Ctrl-C does not end it in 30 s)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

START_TIMEOUT_S = 300  # a loaded 2-core machine imports torch + transformers slowly


@dataclass
class ServeProcess:
    url: str
    proc: subprocess.Popen[str]

    def stop(self) -> str:
        """Ctrl-C; returns the process output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return out or ""


@contextmanager
def _serve(*args: str) -> Iterator[ServeProcess]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "walkserve.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = ServeProcess(f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"walkserve serve exited: {proc.stdout.read() if proc.stdout else ''}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"walkserve serve did not become healthy in {START_TIMEOUT_S} s")
        time.sleep(0.2)
    try:
        yield server
    finally:
        if proc.poll() is None:
            server.stop()


@pytest.fixture(scope="session")
def walkserve_serve() -> Callable[..., AbstractContextManager[ServeProcess]]:
    return _serve


OMNI = "walkserve.adapters.qwen3_omni:tiny_audible"


@pytest.fixture(scope="session")
def omni(walkserve_serve: Callable[..., AbstractContextManager[ServeProcess]]) -> Iterator[Any]:
    """The tiny Qwen3-Omni served once for the speech and chat-media modules."""
    with walkserve_serve("--model", OMNI) as server:
        yield server


QWEN25 = "walkserve.adapters.qwen25_omni:tiny_audible"  # its waveform survives pcm16


@pytest.fixture(scope="session")
def qwen25(walkserve_serve: Callable[..., AbstractContextManager[ServeProcess]]) -> Iterator[Any]:
    """The tiny Qwen2.5-Omni served once for its chat-media and video modules."""
    with walkserve_serve("--model", QWEN25) as server:
        yield server
