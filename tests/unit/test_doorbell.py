"""Doorbells (``runtime.doorbell``) and a rank link that watches one: whenever bytes wait in
the socket, the watching side's ``waiting()`` says so, however the writes are cut, queued and
flushed, and whenever it started watching; and the file goes with its ringer."""

from __future__ import annotations

import os
import select
import socket
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime import ranklink
from walkserve.runtime.doorbell import Doorbell, bell_path
from walkserve.runtime.ranklink import Link

pytestmark = pytest.mark.skipif(not ranklink.available(), reason="no Unix peer credentials")


def test_a_doorbell_says_what_rang_since_it_was_last_seen(tmp_path: Path) -> None:
    path = bell_path(str(tmp_path), 3, 1)
    assert Doorbell.open(path) is None  # none yet: the rank polls its socket
    ringer = Doorbell.create(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        Doorbell.create(path)  # never two ringers
    watcher = Doorbell.open(path)
    assert watcher is not None and not watcher.rung()
    ringer.ring()
    assert watcher.rung() and watcher.rung()  # until seen
    watcher.seen()
    assert not watcher.rung()
    ringer.ring()
    ringer.ring()
    assert watcher.rung()
    watcher.close()
    again = Doorbell.create(path, replace=True)  # a second link of the same rank's process
    ringer.close()
    assert os.path.exists(path)  # the later ringer's file stays with it
    fresh = Doorbell.open(path)
    assert fresh is not None and not fresh.rung()
    watcher.seen()
    again.ring()
    assert fresh.rung() and not watcher.rung()  # a page of its own
    again.close()
    assert not os.path.exists(path)  # the ringer's file goes with it
    (tmp_path / "other").write_bytes(b"not a bell")
    assert Doorbell.open(str(tmp_path / "other")) is None


def readable(link: Link) -> bool:
    poll = select.poll()
    poll.register(link.fileno(), select.POLLIN)
    return bool(poll.poll(0))


ops = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(0, 3 * ranklink.SCRATCH)),
        st.tuples(st.just("flush"), st.just(0)),
        st.tuples(st.just("recv"), st.just(0)),
        st.tuples(st.just("watch"), st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, buffer=st.sampled_from([4096, 20000, None]))
def test_a_watched_link_says_bytes_wait_whenever_they_do(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], buffer: int | None
) -> None:
    """The conductor's end rings after each write (``send``, and ``flush`` of what a full
    socket left queued); the rank's end starts watching at any point, reads at any point: after
    every step, bytes readable in the socket mean ``waiting()``, and every message arrives."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tx, rx = (Link(a), Link(b)) if buffer is None else (Link(a, buffer), Link(b, buffer))
    path = bell_path(str(tmp_path_factory.mktemp("bell")), 0, 0)
    tx.ring(Doorbell.create(path))
    sent: list[bytes] = []
    got: list[bytes] = []
    watching = False
    try:
        for op, n in [*ops, ("flush", 0), ("recv", 0)]:
            if op == "send":
                sent.append(os.urandom(n))
                tx.send(sent[-1])
            elif op == "flush":
                tx.flush()
            elif op == "recv":
                got += [bytes(m) for m in rx.recv()]
            elif not watching:
                bell = Doorbell.open(path)
                assert bell is not None
                rx.watch(bell)
                watching = True
            if readable(rx):
                assert rx.waiting()  # never a byte it would not look for
        while tx.pending() or readable(rx):
            tx.flush()
            if readable(rx):
                assert rx.waiting()
            got += [bytes(m) for m in rx.recv()]
        assert got == sent
        if watching:  # everything read: no ring left unseen but spurious ones
            rx.recv()
            assert not rx.waiting()
    finally:
        tx.close()
        rx.close()
    assert not os.path.exists(path)
