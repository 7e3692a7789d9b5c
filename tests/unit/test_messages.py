"""Control-plane messages: round trips, strict decoding, and no pickle anywhere on the path."""

from __future__ import annotations

import _pickle
import copyreg
import pickle

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.runtime.messages import (
    Ack,
    AttachPools,
    Cancel,
    Heartbeat,
    Hello,
    Message,
    MessageError,
    NodeDone,
    NodeFailed,
    RunNode,
    Shutdown,
    decode,
    encode,
)
from walkserve.runtime.shm import KiB, ShmHandle, ShmPool, ShmPoolConfig
from walkserve.runtime.shmreader import ShmReader
from walkserve.runtime.tensorcodec import TensorHeader, from_bytes, to_bytes
from walkserve.runtime.wirevalues import Inline

HEADER = TensorHeader("float32", (2, 3), 24)
HANDLE = ShmHandle("0123456789abcdef", 3, 7, HEADER)
INLINE = Inline(*to_bytes(torch.arange(6, dtype=torch.float32).view(2, 3)))

EXAMPLES: list[Message] = [
    Hello(rank=0, pid=1234),
    AttachPools([]),
    Shutdown(),
    Heartbeat(rank=3, t=12.5),
    RunNode(["r1", "r2"], "denoiser", 4, [INLINE, HANDLE]),
    NodeDone(["r1"], "decoder", 0, [HANDLE]),
    NodeFailed(["r1", "r2"], "decoder", "CUDA out of memory"),
    Cancel(["r9", "r10"]),
    Ack([HANDLE, HANDLE]),
]


def raw_encode(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg


def test_inline_tensor_survives_the_trip() -> None:
    t = torch.randn(3, 5).t()
    msg = decode(encode(NodeDone(["r"], "n", 1, [Inline(*to_bytes(t))])))
    assert isinstance(msg, NodeDone)
    ref = msg.outputs[0]
    assert isinstance(ref, Inline)
    assert torch.equal(from_bytes(ref.header, ref.data), t)


def test_pool_spec_survives_the_trip() -> None:
    with ShmPool(ShmPoolConfig(min_slot_bytes=4 * KiB, max_slot_bytes=8 * KiB)) as pool:
        msg = decode(encode(AttachPools([pool.spec])))
        assert msg == AttachPools([pool.spec])


names = st.text(min_size=1, max_size=20)


@settings(max_examples=50, deadline=None)
@given(
    request_ids=st.lists(names, max_size=4),
    node=names,
    iteration=st.integers(0, 2**40),
    values=st.lists(st.lists(st.floats(width=32), max_size=6), max_size=3),
)
def test_run_node_round_trip_property(
    request_ids: list[str], node: str, iteration: int, values: list[list[float]]
) -> None:
    inputs: list[Inline | ShmHandle] = [
        Inline(*to_bytes(torch.tensor(v, dtype=torch.float32))) for v in values
    ]
    msg = RunNode(request_ids, node, iteration, inputs)
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        pytest.param({"type": "Exec", "code": "rm -rf /"}, r"Invalid value 'Exec'", id="unknown"),
        pytest.param({"rank": 0, "pid": 1}, "missing required field `type`", id="untagged"),
        pytest.param({"type": "Hello", "rank": "0", "pid": 1}, r"\$\.rank", id="wrong-type"),
        pytest.param({"type": "Hello", "rank": -1, "pid": 1}, r">= 0", id="negative"),
        pytest.param({"type": "Hello", "rank": 0}, "missing required field `pid`", id="missing"),
        pytest.param({"type": "Cancel", "request_ids": [""]}, "length >= 1", id="empty-id"),
        pytest.param(
            {
                "type": "RunNode",
                "request_ids": ["r"],
                "node": "n",
                "iteration": 0,
                "inputs": [{"type": "pickle", "data": b"\x80\x04"}],
            },
            r"\$\.inputs\[0\]",
            id="unknown-ref",
        ),
        pytest.param(
            {
                "type": "RunNode",
                "request_ids": ["r"],
                "node": "n",
                "iteration": 0,
                "inputs": [{"type": "inline", "header": msgspec.to_builtins(HEADER), "data": b""}],
            },
            "inline data has 0 bytes",
            id="inline-length",
        ),
        pytest.param(
            {
                "type": "Ack",
                "handles": [
                    {
                        "type": "shm",
                        "pool_id": "0123456789abcdef",
                        "index": 0,
                        "generation": 1,
                        "header": {"dtype": "object", "shape": [1], "nbytes": 8},
                    }
                ],
            },
            "not allowed on the wire",
            id="bad-dtype",
        ),
        pytest.param(
            {"type": "Ack", "handles": [{**msgspec.to_builtins(HANDLE), "pool_id": "../etc"}]},
            r"\$\.handles\[0\]\.pool_id",
            id="bad-pool-id",
        ),
    ],
)
def test_decode_rejects_malformed_messages(payload: dict[str, object], match: str) -> None:
    with pytest.raises(MessageError, match=match):
        decode(raw_encode(payload))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02\x03", pickle.dumps(Shutdown)])
def test_decode_rejects_non_messages(data: bytes) -> None:
    with pytest.raises(MessageError, match="invalid control-plane message"):
        decode(data)


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError, match="not a control-plane message"):
        encode(HANDLE)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- no pickle


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every pickle entry point (and torch's reduction hooks) raise."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the data path")

    for module in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(copyreg, "_reconstructor", forbidden)
    monkeypatch.setattr(copyreg, "__newobj__", forbidden)
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", forbidden)
    monkeypatch.setattr(torch.UntypedStorage, "__reduce__", forbidden)
    monkeypatch.setattr(torch.TypedStorage, "__reduce__", forbidden)


@pytest.mark.usefixtures("no_pickle")
def test_no_pickle_on_messages_and_shared_memory() -> None:
    with pytest.raises(AssertionError, match="pickle used"):
        pickle.dumps(1)
    with pytest.raises(AssertionError, match="pickle used"):
        torch.zeros(1).__reduce_ex__(2)

    for msg in EXAMPLES:
        assert decode(encode(msg)) == msg

    config = ShmPoolConfig(min_slot_bytes=4 * KiB, max_slot_bytes=64 * KiB)
    with ShmPool(config) as pool, ShmReader() as reader:
        # The spec travels like any message, then the reader attaches from it.
        spec_msg = decode(encode(AttachPools([pool.spec])))
        assert isinstance(spec_msg, AttachPools)
        reader.add(spec_msg.pools[0])
        tensors = [torch.randn(64, 64).t(), torch.tensor(3, dtype=torch.int8), torch.ones(5).bool()]
        small = Inline(*to_bytes(tensors[1]))
        refs: list[Inline | ShmHandle] = [pool.write(t) for t in tensors] + [small]
        run = decode(encode(RunNode(["r"], "n", 0, refs)))
        assert isinstance(run, RunNode)
        for ref, t in zip(run.inputs, [*tensors, tensors[1]]):
            if isinstance(ref, ShmHandle):
                assert torch.equal(reader.read(ref), t)
                assert torch.equal(reader.read(ref, copy=False), t)
                assert torch.equal(reader.read_into(ref, torch.empty_like(t)), t)
            else:
                assert torch.equal(from_bytes(ref.header, ref.data), t)
        ack = decode(encode(Ack([r for r in run.inputs if isinstance(r, ShmHandle)])))
        assert isinstance(ack, Ack)
        for handle in ack.handles:
            pool.ack(handle)
        assert pool.stats().in_use == 0
