"""A command that cannot reach a rank (``poolstate.unreachable``): when the rank's process has
exited before the io thread saw it (a SIGKILLed rank's socket is gone at once), the requests
it fails say it died, and how, as those its death fails do; a rank still running, or one of
another host (no process of ours to ask), gets the socket's error."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import zmq

from walkserve.runtime.poolstate import unreachable

ERROR = zmq.ZMQError(zmq.EHOSTUNREACH)


def test_a_killed_process_is_reported_as_died_with_its_signal() -> None:
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    process.start()
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while process.is_alive() and time.monotonic() < deadline:  # is_alive polls waitpid
        time.sleep(0.01)
    state: Any = SimpleNamespace(rank=3, process=process)
    assert unreachable(state, ERROR) == "worker rank 3 died (killed by SIGKILL)"


def test_a_live_or_remote_rank_gets_the_sockets_error() -> None:
    live: Any = SimpleNamespace(rank=1, process=SimpleNamespace(exitcode=None))
    assert unreachable(live, ERROR) == f"worker rank 1 is unreachable: {ERROR}"
    remote: Any = SimpleNamespace(rank=2, process=None)  # no exitcode to read
    assert unreachable(remote, ERROR) == f"worker rank 2 is unreachable: {ERROR}"
    exited: Any = SimpleNamespace(rank=0, process=SimpleNamespace(exitcode=1))
    assert unreachable(exited, ERROR) == "worker rank 0 died (exit code 1)"
