"""Rank links (``runtime.ranklink``): messages arrive whole, in order, whatever sizes they have
and however the socket cuts them; a sender never blocks; a closed peer is seen."""

from __future__ import annotations

import os
import select
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime import ranklink
from walkserve.runtime.ranklink import Link, LinkClosed, LinkFull, LinkListener

pytestmark = pytest.mark.skipif(not ranklink.available(), reason="no Unix peer credentials")


def pair(buffer: int | None = None) -> tuple[Link, Link]:
    """Two ends; ``buffer``: small kernel buffers, so that sends and reads are cut often
    (None: a link's own)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if buffer is None:
        return Link(a), Link(b)
    return Link(a, buffer), Link(b, buffer)


def pump(tx: Link, rx: Link, want: int) -> list[bytes]:
    """Flush ``tx`` and read ``rx`` in turn until ``want`` messages came."""
    got: list[bytes] = []
    poll = select.poll()
    poll.register(rx.fileno(), select.POLLIN)
    while len(got) < want:
        tx.flush()
        poll.poll(50)
        got += [bytes(m) for m in rx.recv()]
        assert not rx.closed
    return got


sizes = st.lists(
    st.one_of(st.integers(0, 40), st.integers(0, 3 * ranklink.SCRATCH)), min_size=1, max_size=12
)


@settings(max_examples=40, deadline=None)
@given(sizes=sizes, buffer=st.sampled_from([None, 4096, 20000]))
def test_messages_arrive_whole_and_in_order_however_the_socket_cuts_them(
    sizes: list[int], buffer: int | None
) -> None:
    tx, rx = pair(buffer)
    try:
        messages = [os.urandom(n) for n in sizes]
        done = [tx.send(m) for m in messages]  # never blocks, even past the kernel's buffer
        assert all(done) or tx.pending()
        assert pump(tx, rx, len(messages)) == messages
        assert not tx.pending()
        assert rx.recv() == []  # nothing left over
    finally:
        tx.close()
        rx.close()


def test_send_all_blocks_until_a_reader_takes_it_and_many_threads_interleave_whole_messages() -> (
    None
):
    tx, rx = pair(4096)
    messages = {k: [bytes([k]) * (1000 * j + k + 1) for j in range(30)] for k in range(3)}

    def sender(k: int) -> None:
        for m in messages[k]:
            tx.send_all(m, timeout_s=30)

    threads = [threading.Thread(target=sender, args=(k,)) for k in messages]
    for t in threads:
        t.start()
    got = pump(tx, rx, 90)
    for t in threads:
        t.join()
    for k, want in messages.items():  # each thread's messages whole and in its order
        assert [m for m in got if m[:1] == bytes([k])] == want
    tx.close()
    rx.close()


def test_a_closed_peer_is_seen_by_both_reading_and_sending() -> None:
    tx, rx = pair()
    tx.send(b"last words")
    tx.close()
    assert [bytes(m) for m in rx.recv()] == [b"last words"]
    assert rx.recv() == [] and rx.closed
    a, b = pair()
    b.close()
    with pytest.raises(LinkClosed):
        for _ in range(100):  # the first writes may still land in the kernel's buffer
            a.send_all(b"x" * 100_000, timeout_s=5)
    a.close()


def test_what_waits_for_a_reader_that_reads_nothing_is_bounded() -> None:
    """Past ``max_unsent`` bytes waiting, a send is refused and nothing of it queued; what was
    queued arrives whole once the reader reads; a message larger than the bound goes alone."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tx, rx = Link(a, 4096, max_unsent=50_000), Link(b, 4096)
    try:
        sent: list[bytes] = []
        with pytest.raises(LinkFull, match="bound 50000"):
            for k in range(1000):  # the kernel's buffer fills first, then the bound
                m = bytes([k % 251]) * 3000
                tx.send(m)
                sent.append(m)
        assert 0 < tx.unsent() <= 50_000
        assert pump(tx, rx, len(sent)) == sent  # the refused one was not queued
        assert tx.unsent() == 0 and not tx.pending()
        big = os.urandom(200_000)  # over the bound, nothing waiting: it goes
        tx.send(big)
        with pytest.raises(LinkFull):  # and nothing may queue behind it past the bound
            tx.send(b"x" * 50_000)
        assert pump(tx, rx, 1) == [big]
        assert tx.send(b"after") or tx.pending()
        assert pump(tx, rx, 1) == [b"after"]
    finally:
        tx.close()
        rx.close()


def test_a_length_no_message_could_have_breaks_the_link() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    rx = Link(b)
    a.sendall((ranklink.MAX_MESSAGE_BYTES + 1).to_bytes(8, "little") + b"junk")
    select.select([b], [], [], 5)
    assert rx.recv() == [] and rx.closed
    a.close()
    rx.close()


def test_the_listener_names_the_connecting_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    listener = LinkListener(str(tmp_path / "link"))
    try:
        client = Link.connect(listener.path)
        select.select([listener], [], [], 5)
        accepted = listener.accept()
        assert accepted is not None
        server, pid = accepted
        assert pid == os.getpid()
        client.send_all(b"hello", timeout_s=5)
        assert pump(client, server, 1) == [b"hello"]
        assert listener.accept() is None  # nothing else waits
        client.close()
        server.close()
    finally:
        listener.close()
    assert not (tmp_path / "link").exists()


def test_an_empty_message_behind_a_cut_one_arrives_and_flush_ends() -> None:
    """An empty message queued behind one the socket cut: its header goes, and ``flush`` ends
    (an empty view of its body was never written, and ``flush`` spun on it, holding its lock:
    found by the test above, sizes [29, 16892, 34, 135049, 35, 154930, 6, 6, 22, 29, 1650, 0]
    with 20000-byte buffers)."""
    tx, rx = pair(4096)
    try:
        messages = [os.urandom(100_000), b"", b"x", b""]
        assert not tx.send(messages[0])  # cut: the rest queue behind it
        for m in messages[1:]:
            tx.send(m)
        assert pump(tx, rx, len(messages)) == messages
        assert not tx.pending()
    finally:
        tx.close()
        rx.close()
