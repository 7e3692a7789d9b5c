"""The shared-memory pool in one process: slots, generations, forged handles, backpressure.

The reader attaches by name exactly as in another process; cross-process behaviour is in
``tests/integration/test_shm_processes.py``.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from walkserve.runtime.shm import (
    InvalidHandle,
    KiB,
    PoolClosed,
    PoolExhausted,
    SegmentSpec,
    ShmHandle,
    ShmPool,
    ShmPoolConfig,
    ShmPoolSpec,
    StaleHandle,
)
from walkserve.runtime.shmreader import ShmReader
from walkserve.runtime.tensorcodec import TensorHeader

SMALL = ShmPoolConfig(
    min_slot_bytes=4 * KiB, max_slot_bytes=16 * KiB, slots_per_class=2, when_exhausted="raise"
)


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    with ShmPool(SMALL) as p:
        yield p


@pytest.fixture
def reader(pool: ShmPool) -> Iterator[ShmReader]:
    with ShmReader([pool.spec]) as r:
        yield r


def shm_entries(pool_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if pool_id in n]


def forge(handle: ShmHandle, **changes: object) -> ShmHandle:
    return msgspec.structs.replace(handle, **changes)


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(torch.randn(8, 16), id="float32"),
        pytest.param(torch.randn(8, 16).to(torch.bfloat16).t(), id="bfloat16-transposed"),
        pytest.param(torch.arange(40, dtype=torch.int64)[::3], id="int64-strided"),
        pytest.param(torch.tensor(True), id="bool-0d"),
        pytest.param(torch.zeros(0, 5, dtype=torch.complex64), id="empty"),
        pytest.param(torch.randint(0, 255, (16 * KiB,), dtype=torch.uint8), id="largest-class"),
    ],
)
def test_round_trip(pool: ShmPool, reader: ShmReader, tensor: torch.Tensor) -> None:
    handle = pool.write(tensor)
    assert handle.pool_id == pool.pool_id
    out = reader.read(handle)
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)
    into = torch.empty_like(tensor)
    assert reader.read_into(handle, into) is into
    assert torch.equal(into, tensor)
    pool.ack(handle)


def test_size_class_is_the_smallest_that_fits(pool: ShmPool) -> None:
    sizes = [c.slot_bytes for c in pool.stats().classes]
    assert sizes == [4 * KiB, 8 * KiB, 16 * KiB]
    for nbytes, cls in [(1, 0), (4 * KiB, 0), (4 * KiB + 1, 1), (16 * KiB, 2)]:
        pool.write(torch.zeros(nbytes, dtype=torch.uint8))
        assert pool.stats().classes[cls].in_use >= 1
    with pytest.raises(ValueError, match="exceeds the largest slot"):
        pool.write(torch.zeros(16 * KiB + 1, dtype=torch.uint8))


# ------------------------------------------------------------- holding and generations


def test_copy_survives_release_and_reuse(pool: ShmPool, reader: ShmReader) -> None:
    handle = pool.write(torch.full((256,), 7.0))
    kept = reader.read(handle)
    pool.ack(handle)
    pool.write(torch.full((256,), -1.0))  # reuses the slot
    assert torch.equal(kept, torch.full((256,), 7.0))


def test_stale_handle_is_rejected_after_release_and_after_reuse(
    pool: ShmPool, reader: ShmReader
) -> None:
    old = pool.write(torch.full((256,), 1.0))
    view = reader.read(old, copy=False)  # zero-copy: valid until the ack
    assert torch.equal(view, torch.full((256,), 1.0))
    pool.ack(old)
    with pytest.raises(StaleHandle, match="generation"):
        reader.read(old)
    new = pool.write(torch.full((256,), 2.0))
    assert new.index == old.index and new.generation > old.generation
    with pytest.raises(StaleHandle):
        reader.read(old)
    with pytest.raises(StaleHandle):
        reader.read_into(old, torch.empty(256))
    assert torch.equal(reader.read(new), torch.full((256,), 2.0))
    del view


def test_held_slot_is_never_overwritten(pool: ShmPool, reader: ShmReader) -> None:
    held = pool.write(torch.full((100,), 5.0), readers=2)
    pool.ack(held)  # one of two readers is done
    others = [pool.write(torch.full((100,), float(i))) for i in range(SMALL.slots_per_class - 1)]
    with pytest.raises(PoolExhausted):
        pool.write(torch.zeros(100))
    assert held.index not in {h.index for h in others}
    assert torch.equal(reader.read(held), torch.full((100,), 5.0))
    pool.ack(held)
    with pytest.raises(StaleHandle):
        pool.ack(held)  # a third ack for two readers


def test_idle_counts_return_to_initial_after_acks(pool: ShmPool) -> None:
    assert pool.stats().in_use == 0
    handles = [pool.write(torch.zeros(n, dtype=torch.uint8), readers=3) for n in (10, 5000, 9000)]
    handles += [pool.write(torch.zeros(10, dtype=torch.uint8))]
    stats = pool.stats()
    assert stats.in_use == 4 and stats.idle == 0
    for h in handles[:3]:
        pool.ack(h)
        pool.ack(h)
    pool.ack(handles[3])
    assert pool.stats().in_use == 3
    for h in handles[:3]:
        pool.ack(h)
    stats = pool.stats()
    assert stats.in_use == 0
    assert [c.idle for c in stats.classes] == [2, 1, 1]
    assert [c.created for c in stats.classes] == [2, 1, 1]


# -------------------------------------------------------------------- forged handles


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"generation": 99}, StaleHandle, "generation"),
        ({"generation": 0}, StaleHandle, "generation"),
        ({"index": 6}, InvalidHandle, "out of range"),
        ({"index": 10**9}, InvalidHandle, "out of range"),
        ({"index": 1}, InvalidHandle, "does not exist"),  # never created
        ({"pool_id": "0" * 16}, InvalidHandle, "unknown pool"),
        ({"header": TensorHeader("uint8", (8 * KiB,), 8 * KiB)}, InvalidHandle, "at most"),
        ({"header": TensorHeader("uint8", (2 * KiB,), 2 * KiB)}, InvalidHandle, "holds 1024"),
    ],
)
def test_forged_handles_are_rejected(
    pool: ShmPool,
    reader: ShmReader,
    changes: dict[str, object],
    error: type[Exception],
    match: str,
) -> None:
    handle = pool.write(torch.zeros(256))  # 1 KiB in slot 0 of the 4 KiB class
    forged = forge(handle, **changes)
    with pytest.raises(error, match=match):
        reader.read(forged)
    with pytest.raises(error, match=match):
        reader.read(forged, copy=False)
    with pytest.raises(InvalidHandle):
        pool.ack(forged)
    pool.ack(handle)  # the real handle is unaffected
    assert pool.stats().in_use == 0


def test_read_into_checks_dtype_and_shape(pool: ShmPool, reader: ShmReader) -> None:
    handle = pool.write(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="out is"):
        reader.read_into(handle, torch.empty(16))
    with pytest.raises(ValueError, match="out is"):
        reader.read_into(handle, torch.empty(4, 4, dtype=torch.float64))


def test_spec_names_are_fixed_by_the_pool(pool: ShmPool) -> None:
    wire = msgspec.msgpack.encode(pool.spec)
    assert msgspec.msgpack.decode(wire, type=ShmPoolSpec) == pool.spec
    segments = list(pool.spec.segments)
    segments[0] = SegmentSpec("/etc/passwd", segments[0].capacity)
    with pytest.raises(ValueError, match="unexpected name"):
        ShmPoolSpec(pool.pool_id, tuple(segments))
    with pytest.raises(ValueError, match="hex"):
        ShmPoolSpec("../x", ())


def test_reader_does_not_register_with_resource_tracker(
    pool: ShmPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = pool.write(torch.ones(3))
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(multiprocessing.resource_tracker, "register", lambda *a: calls.append(a))
    with ShmReader([pool.spec]) as reader:
        reader.read(handle)
    assert calls == []


# ---------------------------------------------------------------------- backpressure


def test_exhausted_pool_raises_at_once_in_raise_mode(pool: ShmPool) -> None:
    for _ in range(SMALL.slots_per_class):
        pool.write(torch.zeros(10))
    t0 = time.monotonic()
    with pytest.raises(PoolExhausted, match="4096-byte"):
        pool.write(torch.zeros(10))
    assert time.monotonic() - t0 < 0.5
    pool.write(torch.zeros(2000))  # another class still has room


def test_blocking_write_waits_for_an_ack_then_times_out() -> None:
    config = ShmPoolConfig(
        min_slot_bytes=4 * KiB, max_slot_bytes=4 * KiB, slots_per_class=1, block_timeout_s=0.2
    )
    with ShmPool(config) as pool:
        first = pool.write(torch.zeros(10))
        timer = threading.Timer(0.05, pool.ack, args=(first,))
        timer.start()
        second = pool.write(torch.ones(10))  # blocks until the timer's ack
        timer.join()
        assert second.index == first.index
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted, match="within timeout"):
            pool.write(torch.zeros(10))
        assert 0.15 < time.monotonic() - t0 < 2.0


def test_close_wakes_blocked_writers_and_unlinks_everything() -> None:
    config = ShmPoolConfig(min_slot_bytes=4 * KiB, max_slot_bytes=8 * KiB, slots_per_class=1)
    pool = ShmPool(config)
    held = [pool.write(torch.zeros(10)), pool.write(torch.zeros(1500))]
    assert len(shm_entries(pool.pool_id)) == 2
    errors: list[BaseException] = []

    def blocked_write() -> None:
        try:
            pool.write(torch.zeros(10))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=blocked_write)
    thread.start()
    time.sleep(0.05)
    pool.close()
    thread.join(timeout=5)
    assert len(errors) == 1 and isinstance(errors[0], PoolClosed)
    assert shm_entries(pool.pool_id) == []
    pool.ack(held[0])  # late acks are ignored
    pool.close()  # idempotent
    with pytest.raises(PoolClosed):
        pool.write(torch.zeros(10))


def test_reader_view_outlives_close_of_both_sides(pool: ShmPool) -> None:
    handle = pool.write(torch.arange(10.0))
    reader = ShmReader([pool.spec])
    view = reader.read(handle, copy=False)
    reader.close()
    pool.close()
    assert torch.equal(view, torch.arange(10.0))  # the mapping lives as long as the view


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_slot_bytes": 1000},
        {"min_slot_bytes": 2048},
        {"min_slot_bytes": 8 * KiB, "max_slot_bytes": 4 * KiB},
        {"slots_per_class": 0},
        {"when_exhausted": "drop"},
        {"block_timeout_s": 0},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ShmPoolConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_readers_count_is_rejected(pool: ShmPool) -> None:
    with pytest.raises(ValueError, match="readers"):
        pool.write(torch.zeros(1), readers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_written_and_read_into_directly(pool: ShmPool, reader: ShmReader) -> None:
    t = torch.randn(48, 40, device="cuda").t()  # non-contiguous, on the GPU
    handle = pool.write(t)
    out = torch.empty(t.shape, device="cuda")
    assert reader.read_into(handle, out) is out
    assert torch.equal(out, t)
    assert torch.equal(reader.read(handle), t.cpu())
    pool.ack(handle)


# -------------------------------------------------------------------- state machine


class PoolMachine(RuleBasedStateMachine):
    """Random writes (1-3 readers) and acks: every held handle reads back its own bytes,
    every released one is stale, and the stats match a model of held slots."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.pool = ShmPool(SMALL)
        self.reader = ShmReader([self.pool.spec])
        self.outstanding: dict[ShmHandle, tuple[torch.Tensor, int]] = {}
        self.released: list[ShmHandle] = []
        self.counter = 0

    @rule(
        target=held, nbytes=st.sampled_from([0, 1, 4000, 4097, 16 * KiB]), readers=st.integers(1, 3)
    )
    def write(self, nbytes: int, readers: int) -> MultipleResults[ShmHandle]:
        self.counter += 1
        tensor = torch.full((nbytes,), self.counter % 251, dtype=torch.uint8)
        try:
            handle = self.pool.write(tensor, readers=readers)
        except PoolExhausted:
            cls = 0 if nbytes <= 4 * KiB else 1 if nbytes <= 8 * KiB else 2
            slots = [h for h in self.outstanding if self._class_of(h) == cls]
            assert len(slots) == SMALL.slots_per_class
            return multiple()
        assert handle not in self.outstanding
        self.outstanding[handle] = (tensor, readers)
        return multiple(handle)

    @rule(target=held, handle=consumes(held))
    def ack(self, handle: ShmHandle) -> MultipleResults[ShmHandle]:
        tensor, readers = self.outstanding[handle]
        self.pool.ack(handle)
        if readers > 1:
            self.outstanding[handle] = (tensor, readers - 1)
            return multiple(handle)  # still held by the other readers
        del self.outstanding[handle]
        self.released.append(handle)
        return multiple()

    @invariant()
    def held_handles_read_back_and_released_ones_are_stale(self) -> None:
        for handle, (tensor, _) in self.outstanding.items():
            assert torch.equal(self.reader.read(handle), tensor)
        for handle in self.released[-5:]:
            with pytest.raises(StaleHandle):
                self.reader.read(handle)
        assert self.pool.stats().in_use == len(self.outstanding)

    def teardown(self) -> None:
        self.reader.close()
        self.pool.close()
        assert shm_entries(self.pool.pool_id) == []

    @staticmethod
    def _class_of(handle: ShmHandle) -> int:
        return handle.index // SMALL.slots_per_class


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
