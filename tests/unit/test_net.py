"""``runtime.net`` without worker processes: key files, control addresses, the link model fit
(against torch's least squares), host names in placements, cross-host edges, and the Mooncake
transport between two engines of this process (skipped when mooncake does not import)."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest
import torch

from walkserve import capture
from walkserve.adapters.examples import example_placement
from walkserve.adapters.registry import load_model
from walkserve.lowering.lower import lower
from walkserve.lowering.placement import LOCAL_HOST, Placement, PlacementError
from walkserve.runtime.config import PoolConfig
from walkserve.runtime.messages import Ack, Probe, decode, encode
from walkserve.runtime.net.auth import KeyPair, ensure_keys, load_worker_keys
from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.net.link import LinkModel, cross_host_edges, fit_link
from walkserve.runtime.net.mooncake import available as mooncake_available
from walkserve.runtime.net.remote import commands_address, parse_tcp
from walkserve.runtime.tensorcodec import TensorHeader
from walkserve.runtime.wirevalues import Seq


def test_keys_are_made_once_with_private_secrets(tmp_path: Path) -> None:
    keys = ensure_keys(tmp_path / "k", [1, 3])
    assert sorted(keys.clients) == [1, 3]
    root = tmp_path / "k"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for name in ("server.secret", "rank-1.secret", "rank-3.secret"):
        assert stat.S_IMODE((root / name).stat().st_mode) == 0o600
    again = ensure_keys(root, [1, 3])
    assert again == keys  # reused, not regenerated
    server_public, pair = load_worker_keys(root, 3)
    assert server_public == keys.server.public and pair.public == keys.clients[3]
    with pytest.raises(ValueError, match=r"rank-2\.public"):
        load_worker_keys(root, 2)
    with pytest.raises(ValueError, match="40 Z85"):
        KeyPair("short", "short")


def test_control_addresses() -> None:
    assert parse_tcp("tcp://10.0.0.7:5555") == ("10.0.0.7", 5555)
    assert commands_address("tcp://h:5555") == "tcp://h:5556"
    for bad in ("ipc:///tmp/x", "tcp://h", "tcp://h:65535", "h:1"):
        with pytest.raises(ValueError, match=r"tcp://HOST:PORT|port must"):
            parse_tcp(bad)
    with pytest.raises(ValueError, match="keys_dir"):
        PoolConfig(bind="tcp://127.0.0.1:0", remote_ranks=(1,))
    with pytest.raises(ValueError, match="remote_data"):
        PoolConfig(remote_data="pigeon")  # type: ignore[arg-type]


def test_worker_command_refuses_a_bad_conductor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from walkserve.cli import main

    assert main(["worker", "--conductor", "ipc:///x", "--rank", "1", "--keys", str(tmp_path)]) == 2
    assert "tcp://HOST:PORT" in capsys.readouterr().err


def test_a_placement_with_other_hosts_needs_a_bind() -> None:
    from walkserve.runtime.server import serve

    placement = Placement.from_dict({"ranks": 2, "hosts": {1: "node-b"}})
    with pytest.raises(ValueError, match=r"ranks \[1\] on other hosts.*bind="):
        serve("example-cfg-image", placement)


def test_handles_and_probes_travel_as_messages() -> None:
    h = MooncakeHandle("10.0.0.2:15000", 140000000, 3, TensorHeader("float32", (2, 3), 24))
    assert decode(encode(Ack([h]))) == Ack([h])
    assert decode(encode(Probe(1, Seq("tuple", [h, 2])))) == Probe(1, Seq("tuple", [h, 2]))


def test_link_fit_matches_relative_least_squares() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [1 << 10, 64 << 10, 1 << 20, 8 << 20] * 3
    secs = [50e-6 + n / 2e9 + 1e-6 * float(torch.rand((), generator=g)) for n in sizes]
    link = fit_link(list(zip(sizes, secs)))
    # rows scaled by 1 / t: least squares of the relative error
    a = torch.tensor([[1.0 / t, n / t] for n, t in zip(sizes, secs)], dtype=torch.float64)
    b = torch.ones(len(sizes), 1, dtype=torch.float64)
    intercept, slope = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
    assert link.alpha_s == pytest.approx(intercept, rel=1e-6)
    assert link.beta_bytes_per_s == pytest.approx(1 / slope, rel=1e-6)
    assert link.seconds(1 << 20) == pytest.approx(intercept + slope * (1 << 20), rel=1e-6)
    assert link.alpha_s == pytest.approx(50e-6, rel=0.05)  # what the samples were made from
    assert link.beta_bytes_per_s == pytest.approx(2e9, rel=0.05)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(10, 1.0), (10, 2.0)])


def test_placement_hosts_round_trip_and_validation() -> None:
    p = Placement.from_dict({"ranks": 2, "hosts": {"1": "node-b"}})  # JSON keys are strings
    assert p.host_of(0) == LOCAL_HOST and p.host_of(1) == "node-b"
    assert Placement.from_dict(p.to_dict()) == p
    with pytest.raises(PlacementError, match="hosts\\[2\\] names rank 2"):
        Placement(ranks=2, hosts={2: "x"})
    with pytest.raises(PlacementError, match="not a host name"):
        Placement(ranks=2, hosts={1: "bad host"})


def test_cross_host_edges_of_cfg_branches() -> None:
    name = "example-cfg-image"
    model, sample = load_model(name)
    captured = capture.trace(model, sample)
    base = Placement.from_file(example_placement(name, 2))
    plan = lower(captured, sample, base, check_capture=False)
    assert cross_host_edges(captured, plan, base, {}) == []  # one host: nothing crosses
    split = Placement.from_dict({**base.to_dict(), "hosts": {1: "b"}})
    link = LinkModel(1e-4, 1e9)
    edges = cross_host_edges(captured, plan, split, {1: link})
    assert edges
    on_b = {n.name for w in plan.walks for n in plan.nodes(w) if n.ranks[0] == 1}
    for e in edges:
        assert e.consumer in on_b or e.producer in on_b
        hops = (e.src_host == "b") + (e.dst_host == "b")
        assert e.seconds == pytest.approx(hops * link.seconds(e.nbytes))
    assert all(math.isnan(e.seconds) for e in cross_host_edges(captured, plan, split, {}))
    # rank to rank (Mooncake): one hop whichever way; none between nodes of host b
    direct = cross_host_edges(captured, plan, split, {1: link}, direct=True)
    crossing = [e for e in edges if e.src_host != e.dst_host or e.producer is None]
    assert [(e.value, e.consumer) for e in direct] == [(e.value, e.consumer) for e in crossing]
    assert all(e.seconds == pytest.approx(link.seconds(e.nbytes)) for e in direct)
    # both ranks on one other host: through the conductor that is two hops, directly none
    away = Placement.from_dict({**base.to_dict(), "hosts": {0: "b", 1: "b"}})
    links = {0: link, 1: link}
    between = [e for e in cross_host_edges(captured, plan, away, links) if e.producer]
    assert between and all(e.seconds == pytest.approx(2 * link.seconds(e.nbytes)) for e in between)
    assert all(
        e.producer is None for e in cross_host_edges(captured, plan, away, links, direct=True)
    )


@pytest.fixture(scope="module")
def engines():  # type: ignore[no-untyped-def]
    ok, why = mooncake_available()
    if not ok:
        pytest.skip(f"mooncake-transfer-engine does not import here: {why}")
    from walkserve.runtime.net.mooncake import MooncakeConfig, MooncakeEngine

    small = MooncakeConfig(send_bytes=4 << 20, recv_bytes=4 << 20)
    return MooncakeEngine(small), MooncakeEngine(small)


def test_mooncake_transport_round_trip_reuses_registered_buffers(engines) -> None:  # type: ignore[no-untyped-def]
    from walkserve.runtime.net.mooncake import MooncakeTransport

    a, b = engines
    producer = MooncakeTransport(a, inline_max_bytes=1024)
    consumer = MooncakeTransport(b, inline_max_bytes=1024)
    g = torch.Generator().manual_seed(1)
    value = (
        torch.randn(300, 7, generator=g),  # 8400 B: through the engine
        torch.arange(10),  # 80 B: inline
        [torch.randint(0, 9, (64, 64), generator=g, dtype=torch.int32).t(), 3.5, None],
    )
    registered = (a.send_arena.base, b.recv_arena.base)
    for _ in range(3):  # the same blocks, again and again
        payload = producer.send(value, "r")
        got, tokens = consumer.receive(payload, "r")
        assert len(tokens) == 2 and all(isinstance(t, MooncakeHandle) for t in tokens)
        assert torch.equal(got[0], value[0]) and torch.equal(got[1], value[1])
        assert torch.equal(got[2][0], value[2][0]) and got[2][1:] == [3.5, None]
        assert producer.held == 2
        tensors = 300 * 7 * 4 + 10 * 8 + 64 * 64 * 4  # every tensor counts, whichever path
        assert producer.bytes_out == consumer.bytes_in == tensors * (1 + _)
        producer.release(tokens)
        assert producer.held == 0 and b.recv_arena.in_use == 0
    assert (a.send_arena.base, b.recv_arena.base) == registered
    huge = torch.zeros(5 << 20, dtype=torch.uint8)  # larger than the send buffer: inline
    payload = producer.send(huge, "r")
    assert not isinstance(payload, MooncakeHandle)
    assert torch.equal(consumer.receive(payload, "r")[0], huge)


def test_a_held_tensor_is_exported_for_other_hosts_and_freed_with_its_key(engines) -> None:  # type: ignore[no-untyped-def]
    """``ObjectStore.hold`` with exports: the reference names a block of the producer's send
    buffer (``at``) that another engine reads one-sided; the block lives as long as the key
    (released, or its request dropped), and a tensor that finds no room is not held (its
    bytes go to the conductor instead)."""
    from walkserve.runtime.net.mooncake import SendPool
    from walkserve.runtime.transport import ObjectStore, TransportError

    a, b = engines
    store = ObjectStore(0, exports=SendPool(a))
    x = torch.randn(64, 33)
    ref = store.hold("r", x)
    assert ref is not None and isinstance(ref.at, MooncakeHandle) and ref.shape == [64, 33]
    assert torch.equal(store.get("r", ref), x)  # in place on its own rank
    assert torch.equal(b.pull(ref.at), x) and b.recv_arena.in_use == 0  # from another host
    assert store.exported == 1 and a.send_arena.in_use == 1
    store.release("r", [ref.key, "o-unknown"])
    assert store.exported == 0 and a.send_arena.in_use == 0 and len(store) == 0
    refs = [store.hold("q", torch.full((8,), float(k))) for k in range(3)]
    assert all(r is not None and r.at is not None for r in refs)
    assert a.send_arena.in_use == 3
    assert store.drop("q") == 3
    assert store.exported == 0 and a.send_arena.in_use == 0
    assert store.hold("q", torch.ones(4)) is not None  # a dropped request keeps nothing
    assert a.send_arena.in_use == 0 and len(store) == 0
    assert store.hold("r", torch.zeros(5 << 20, dtype=torch.uint8)) is None  # no room
    assert len(store) == 0 and a.send_arena.in_use == 0
    few = ObjectStore(0, max_per_request=1, exports=SendPool(a))
    assert few.hold("r", x) is not None
    with pytest.raises(TransportError, match="holds 1 values"):
        few.hold("r", x)  # one too many: refused, and its block freed
    assert few.exported == 1 and a.send_arena.in_use == 1
    few.drop("r")
    assert a.send_arena.in_use == 0
    plain = ObjectStore(1)  # one host: held, nothing exported
    kept = plain.hold("r", x)
    assert kept is not None and kept.at is None and plain.exported == 0
    # read on this host only (``export=False``): held, not written to the send buffer
    near = ObjectStore(0, exports=SendPool(a))
    kept = near.hold("r", x, export=False)
    assert kept is not None and kept.at is None and torch.equal(near.get("r", kept), x)
    assert near.exported == 0 and a.send_arena.in_use == 0
    assert near.hold("r", x) is not None and a.send_arena.in_use == 1
    assert near.counters() == {"objects/exported": 1, "objects/exported_bytes": x.nbytes}
    near.drop("r")
    assert a.send_arena.in_use == 0


def test_a_held_view_does_not_keep_its_whole_block() -> None:
    """A tensor held for a request that is a view of a larger block (a cohort's rows) is kept
    as a copy of its own rows, so that the block is freed with its other views."""
    from walkserve.runtime.transport import ObjectStore

    store = ObjectStore(0)
    block = torch.randn(16, 30, 8)
    rows = block.narrow(0, 3, 1)
    kept = store.get("r", store.put("r", rows))
    assert torch.equal(kept, rows)
    assert kept.untyped_storage().nbytes() == rows.numel() * rows.element_size()
    whole = torch.randn(4, 4)
    assert store.get("r", store.put("r", whole)) is whole  # its own storage: kept as it is
