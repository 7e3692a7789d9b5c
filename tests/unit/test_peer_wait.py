"""A rank's peer fetch (``runtime.peers``) that gets no answer keeps calling ``on_wait`` (the
worker's heartbeat) until it gives up, so a dead or stopped producer does not make its
consumer look hung."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import zmq

from walkserve.runtime.messages import ObjectRef
from walkserve.runtime.peers import PeerClient, PeerError, peer_address
from walkserve.runtime.shmreader import ShmReader


def test_a_peer_fetch_keeps_calling_on_wait_until_it_gives_up() -> None:
    """A rank waiting for a peer that does not answer (dead, stopped) keeps its heartbeats
    going (``on_wait``), so it is not taken for hung itself."""
    ctx = zmq.Context()
    directory = tempfile.mkdtemp(prefix="walkserve-test-")
    silent = ctx.socket(zmq.ROUTER)  # takes the fetch, never answers
    silent.bind(peer_address(directory, 1))
    calls: list[int] = []
    client = PeerClient(
        ctx,
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
        silent.close(0)
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)
