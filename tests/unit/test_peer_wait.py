"""A rank's peer fetch (``runtime.peers``) that gets no answer keeps calling ``on_wait`` (the
worker's heartbeat) until it gives up, so a dead or stopped producer does not make its
consumer look hung; a producer that was restarted since the last fetch is reached anew."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable

import pytest
import torch

from walkserve.runtime.peers import PeerClient, PeerError, PeerServer, peer_address
from walkserve.runtime.ranklink import LinkListener
from walkserve.runtime.shm import ShmPool, ShmPoolConfig
from walkserve.runtime.shmreader import ShmReader
from walkserve.runtime.transport import ObjectStore
from walkserve.runtime.wirevalues import ObjectRef


def test_a_peer_fetch_keeps_calling_on_wait_until_it_gives_up() -> None:
    """A rank waiting for a peer that does not answer (dead, stopped) keeps its heartbeats
    going (``on_wait``), so it is not taken for hung itself."""
    directory = tempfile.mkdtemp(prefix="walkserve-test-")
    silent = LinkListener(peer_address(directory, 1))  # takes the connection, never answers
    calls: list[int] = []
    client = PeerClient(
        0,
        {1: peer_address(directory, 1)},
        ShmReader(),
        timeout_s=0.3,
        on_wait=lambda: calls.append(1),
        wait_slice_s=0.02,
    )
    try:
        with pytest.raises(PeerError, match="rank 1 did not answer"):
            client.fetch("r", [ObjectRef(1, "k")])
        assert len(calls) >= 5
    finally:
        client.close()
        silent.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_fetch_from_a_producer_that_dies_fails_at_once_not_at_the_timeout() -> None:
    """The producer's end of the link closes (its process ended) while a fetch waits: the
    fetch fails then, naming the rank, instead of waiting out its 60 s."""
    import select
    import threading

    directory = tempfile.mkdtemp(prefix="walkserve-test-")
    listener = LinkListener(peer_address(directory, 1))
    client = PeerClient(0, {1: peer_address(directory, 1)}, ShmReader(), timeout_s=60)
    outcome: list[BaseException | None] = []

    def fetch() -> None:
        try:
            client.fetch("r", [ObjectRef(1, "k")])
            outcome.append(None)
        except BaseException as e:  # the test reads it
            outcome.append(e)

    thread = threading.Thread(target=fetch)
    try:
        thread.start()
        select.select([listener], [], [], 5)
        accepted = listener.accept()
        assert accepted is not None
        link, _ = accepted
        assert link.waiting(5000)  # the fetch came
        t0 = time.monotonic()
        link.close()  # the producer ends without answering
        listener.close()
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - t0 < 5
        assert isinstance(outcome[0], PeerError) and "rank 1" in str(outcome[0])
    finally:
        client.close()
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_fetches_inline_and_through_shared_memory_and_a_restarted_producer_is_reached() -> None:
    """A small tensor comes inline, a large one through the producer's pool (its slot free
    again once the consumer acks); a producer replaced at the same path (a restarted rank)
    answers the next fetch over a new link, and a key of the old one is unknown to it; a
    consumer that ends without acking frees what it was given."""
    directory = tempfile.mkdtemp(prefix="walkserve-test-")
    path = peer_address(directory, 1)
    pools = [ShmPool(ShmPoolConfig(when_exhausted="raise")) for _ in range(2)]
    small, large = torch.arange(16.0), torch.randn(64, 1024)  # 64 B inline, 256 KiB in shm
    store = ObjectStore(1)
    refs = [store.put("r", small), store.put("r", large)]
    server = PeerServer(path, store, pools[0], ShmReader(), 64 * 1024)
    client = PeerClient(0, {1: path}, ShmReader(), timeout_s=10)
    try:
        got = client.fetch("r", refs)
        assert torch.equal(got[(1, refs[0].key)], small)
        assert torch.equal(got[(1, refs[1].key)], large)
        assert client.bytes_in == small.nbytes + large.nbytes
        assert _wait(lambda: _idle(pools[0]))  # acked: the slot is free
        with pytest.raises(PeerError, match="rank 1: "):
            client.fetch("other", [refs[0]])  # only the request that made it reads it
        server.close()  # the rank ends; another process of it serves the same path
        store = ObjectStore(1)
        fresh = store.put("r", small * 2)
        server = PeerServer(path, store, pools[1], ShmReader(), 64 * 1024)
        assert torch.equal(client.fetch("r", [fresh])[(1, fresh.key)], small * 2)
        with pytest.raises(PeerError, match="rank 1: "):
            client.fetch("r", [refs[1]])  # the old process's value is gone with it
        # a consumer that ends between the answer and its ack: its slot is freed all the same
        big = store.put("r", large)
        other = PeerClient(0, {1: path}, ShmReader(), timeout_s=10)
        link = other._link(1)
        from walkserve.runtime.messages import Fetch, encode

        link.send_all(encode(Fetch(0, "r", [big.key])), 10)
        assert other._reply(1, link, 0).values  # given, never acked
        assert not _idle(pools[1])
        other.close()
        assert _wait(lambda: _idle(pools[1]))
    finally:
        client.close()
        server.close()
        for pool in pools:
            pool.close()
        shutil.rmtree(directory, ignore_errors=True)


def _idle(pool: ShmPool) -> bool:
    return pool.stats().in_use == 0


def _wait(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
