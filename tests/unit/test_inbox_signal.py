"""The worker inbox's ``waiting`` (asked between fast-lane steps) reads the socket's events only
when its fd says something came, and still sees every command: one that came before the inbox
opened (inproc: in the pipe as the send returns), one that comes after each read, several in a row, and one it said was waiting until
``read`` takes it. Real ZeroMQ sockets (inproc), no sleeps: a send is awaited on the fd with a
bounded select."""

from __future__ import annotations

import select
import socket
from typing import Any

import pytest
import zmq

from walkserve.runtime import workerinbox
from walkserve.runtime.messages import Release, encode
from walkserve.runtime.ranklink import Link
from walkserve.runtime.workerinbox import Commands, LinkCommands, WorkerInbox, ZmqCommands


class Inbox(WorkerInbox):
    def __init__(self, rx: Commands) -> None:
        self.rank = 0
        self.engine = None  # type: ignore[assignment]
        self.released: list[str] = []
        self.lost = 0
        self._open_inbox(rx)
        self._handlers[Release] = lambda m: self.released.append(m.request_id)

    def _conductor_closed(self) -> None:
        self.lost += 1


@pytest.fixture
def sockets() -> Any:
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    tx.bind("inproc://inbox-signal")
    rx.connect("inproc://inbox-signal")
    yield tx, rx
    tx.close(0)
    rx.close(0)
    ctx.term()


def arrived(rx: zmq.Socket[bytes]) -> None:
    """Until the socket's fd says something came (bounded: a lost signal fails the test)."""
    ready, _, _ = select.select([rx.get(zmq.FD)], [], [], 10.0)
    assert ready, "the socket's fd never turned readable"


def test_waiting_sees_every_command_and_reads_events_only_when_signalled(
    sockets: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tx, rx = sockets
    # before the inbox opens, and before the socket was ever read: a pipe nobody found empty
    # signals nothing when a message comes (ZeroMQ's edge), so the inbox reads the events once
    tx.send(encode(Release("early", [])))
    box = Inbox(ZmqCommands(rx))
    reads: list[bool] = []
    real = workerinbox._readable

    def counted(sock: Any) -> bool:
        reads.append(real(sock))
        return reads[-1]

    monkeypatch.setattr(workerinbox, "_readable", counted)
    assert box.waiting() and box.waiting()  # still waiting: read has not taken it
    box.read(wait=False)
    assert box.released == ["early"]
    for k in range(50):
        reads.clear()
        assert not any(box.waiting() for _ in range(5))
        assert reads == [], "the events were read while the fd said nothing came"
        for j in range(k % 3 + 1):
            tx.send(encode(Release(f"r{k}.{j}", [])))
        arrived(rx)
        assert box.waiting() and box.waiting()
        box.read(wait=False)
        assert box.released[-(k % 3 + 1) :] == [f"r{k}.{j}" for j in range(k % 3 + 1)]
    assert not box.waiting()


def test_a_rank_link_inbox_sees_every_command_once_whole_and_the_conductor_s_end() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tx, commands = Link(a), LinkCommands(Link(b))
    tx.send(encode(Release("early", [])))
    select.select([b], [], [], 10.0)
    assert commands.recv() is not None  # as ``_await_setup`` reads one...
    tx.send(encode(Release("setup", [])))
    tx.send(encode(Release("after", [])))
    select.select([b], [], [], 10.0)
    assert commands.poll(0)
    assert commands.recv() is not None  # ...and what came with it stays for the inbox
    box = Inbox(commands)
    assert box.waiting()
    box.read(wait=False)
    assert box.released == ["after"] and not box.waiting() and box.lost == 0
    for k in range(20):
        keys = [f"{j:060d}" for j in range(k * 150 + 1)]  # up to 180 KB: cut by the socket
        tx.send(encode(Release(f"r{k}", keys)))
        for _ in range(1000):  # bounded: a lost message fails the test
            tx.flush()
            box.read(wait=False)
            if box.released[-1] == f"r{k}":
                break
            select.select([b], [a] if tx.pending() else [], [], 0.01)
    assert box.released[1:] == [f"r{k}" for k in range(20)]
    tx.close()  # the conductor's end goes: the inbox says so once read
    select.select([b], [], [], 10.0)
    box.read(wait=False)
    assert box.lost == 1
