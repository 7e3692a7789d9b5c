"""Worker processes for real: a spawned pool runs plan nodes of the example models on two ranks.

Every numeric check compares the workers' outputs with the same node run in this process
(``BatchedComponent`` for the component op, ``Interpreter.op`` for glue) on inputs recorded
from a reference run of the model, and requires exact equality: the workers run the same
process-local math with the same torch thread count. The pools forbid pickle inside the
workers; one test forbids it in this process during a full round trip too.
"""

from __future__ import annotations

import _pickle
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters.registry import load_model
from walkserve.capture import dataflow, ir
from walkserve.capture.interpret import Interpreter
from walkserve.lowering.callables import build_callables
from walkserve.lowering.lower import lower
from walkserve.lowering.plan import ExecutablePlan
from walkserve.lowering.split import fuse_elementwise
from walkserve.runtime.config import SupervisionConfig
from walkserve.runtime.pool import (
    BatchError,
    BatchResult,
    PoolConfig,
    WorkerDied,
    WorkerPool,
    WorkerStartError,
)
from walkserve.runtime.runner import NodeRunner, RunItem
from walkserve.runtime.shm import KiB, ShmHandle, ShmPool, ShmPoolConfig
from walkserve.runtime.shmreader import ShmReader
from walkserve.runtime.tensorcodec import from_bytes, to_bytes
from walkserve.runtime.transport import (
    LocalTransport,
    ObjectStore,
    ShmTransport,
    TransportError,
    Unencodable,
    from_inline,
    inline,
)
from walkserve.runtime.wirevalues import ObjectRef, Seq

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

THREADS = 1  # workers and the in-process reference alike
CONFIG = PoolConfig(start_timeout_s=90.0, forbid_pickle=True)
TIMEOUT_S = 30.0
Prepared = tuple[capture.CapturedModel, ExecutablePlan]
_CACHE: dict[str, Prepared] = {}


def full_like_apart(op: ir.Op) -> bool:
    """The default glue fusion, except ``torch.full_like``: the tests use the cfg-image walk's
    ``full_like`` (zeros shaped like ``prompt_ids``) as a small glue node of its own."""
    return fuse_elementwise(op) and op.target != "function:torch.full_like"


def prepare(name: str) -> Prepared:
    """Captured model and a plan with every node on both ranks."""
    if name not in _CACHE:
        model, sample = load_model(name, 0)
        captured = capture.trace(model, sample)
        plan = lower(captured, sample, check_capture=False, glue=full_like_apart, regions=False)
        for walk in plan.walks:
            for node in plan.nodes(walk):
                node.ranks = [0, 1]
        _CACHE[name] = (captured, plan)
    return _CACHE[name]


def requests(name: str, n: int = 3) -> list[dict[str, Any]]:
    """``n`` requests of one shape (so that they share a batched call), different values."""
    _, sample = load_model(name, 0)
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        r = dict(sample)
        if name == "example-cfg-image":
            r["noise"] = torch.randn(sample["noise"].shape, generator=g)
            r["prompt_ids"] = torch.randint(1, 64, sample["prompt_ids"].shape, generator=g)
        else:
            r["prompt_ids"] = torch.randint(2, 60, sample["prompt_ids"].shape, generator=g)
        out.append(r)
    return out


class Recorded:
    """What a reference run of one request bound: every value's first binding (loop bodies:
    the first iteration), and every op's first materialized arguments."""

    def __init__(self, captured: capture.CapturedModel, walk: str, inputs: dict[str, Any]):
        self.values: dict[str, Any] = {}
        self.args: dict[str, tuple[list[Any], dict[str, Any]]] = {}

        def observe(name: str, value: Any) -> None:
            self.values.setdefault(name, value)

        def observe_op(op: ir.Op, args: list[Any], kwargs: dict[str, Any]) -> None:
            self.args.setdefault(op.name, (args, kwargs))

        with torch.no_grad():
            Interpreter(captured, observe=observe, observe_op=observe_op).run_walk(walk, inputs)


def reference_outputs(
    captured: capture.CapturedModel,
    plan: ExecutablePlan,
    walk: str,
    node: str,
    recorded: list[Recorded],
) -> list[dict[str, Any]]:
    """The node run here: one ``BatchedComponent`` call over the recorded arguments, then its
    fused glue (or all of a glue node) per request through ``Interpreter.op``."""
    (plan_node,) = [n for n in plan.nodes(walk) if n.name == node]
    walk_ir = captured.graph.walks[walk]
    ops = {n.name: n for n in dataflow.iter_nodes(walk_ir.body) if isinstance(n, ir.Op)}
    envs = [{k: r.values[k] for k in plan_node.inputs} for r in recorded]
    interp = Interpreter(captured)
    glue = plan_node.ops
    with torch.no_grad():
        if plan_node.kind == "component":
            call = build_callables(captured, plan)[f"{walk}:{node}"]
            outs = call([r.args[plan_node.ops[0]] for r in recorded])
            for env, out in zip(envs, outs):
                env[plan_node.ops[0]] = out
            glue = plan_node.ops[1:]
        for env in envs:
            for name in glue:
                env[name] = interp.op(ops[name], env)
    return [{k: env[k] for k in plan_node.outputs} for env in envs]


def items_for(
    plan: ExecutablePlan,
    captured: capture.CapturedModel,
    walk: str,
    node: str,
    recorded: list[Recorded],
) -> list[tuple[int, str, dict[str, Any]]]:
    (plan_node,) = [n for n in plan.nodes(walk) if n.name == node]
    return [
        (10 + i, f"req-{i}", {k: r.values[k] for k in plan_node.inputs})
        for i, r in enumerate(recorded)
    ]


def assert_same(got: dict[int, dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert sorted(got) == [10 + i for i in range(len(expected))]
    for i, exp in enumerate(expected):
        out = got[10 + i]
        assert out.keys() == exp.keys()
        for key, value in exp.items():
            assert type(out[key]) is type(value), key
            if isinstance(value, torch.Tensor):
                assert out[key].dtype == value.dtype and out[key].shape == value.shape, key
                assert torch.equal(out[key], value), key
            else:
                assert out[key] == value, key


def shm_names(pool_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if pool_id in n)


def zombies() -> list[int]:
    """Child processes of this process that exited and were not reaped."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            out.append(int(stat.parent.name))
    return out


def pool_segments(pool: WorkerPool) -> list[str]:
    ids = [pool.shm_pool_id] + [h.shm_pool for h in pool.health().values() if h.shm_pool]
    return [name for pool_id in ids for name in shm_names(pool_id)]


def wait_for(condition: Callable[[], bool], timeout: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def output_slots_idle(pool: WorkerPool, rank: int) -> bool:
    """Every segment of ``rank``'s output pool is idle: its generation (bytes 8..16 of the
    segment, see ``shm``'s layout) is even."""
    pool_id = pool.health()[rank].shm_pool
    assert pool_id is not None
    names = shm_names(pool_id)
    gens = [int.from_bytes((Path("/dev/shm") / n).read_bytes()[8:16], "little") for n in names]
    return all(g % 2 == 0 for g in gens)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cfg_pool() -> Iterator[WorkerPool]:
    captured, plan = prepare("example-cfg-image")
    with WorkerPool("example-cfg-image", 0, captured, plan, 2, THREADS, CONFIG) as pool:
        yield pool


@pytest.fixture(scope="module")
def speech_pool() -> Iterator[WorkerPool]:
    captured, plan = prepare("example-speech")
    with WorkerPool("example-speech", 0, captured, plan, 2, THREADS, CONFIG) as pool:
        yield pool


# ------------------------------------------------------------------------------ batches


@pytest.mark.parametrize("rank", [0, 1])
def test_component_node_matches_in_process_batch(cfg_pool: WorkerPool, rank: int) -> None:
    captured, plan = prepare("example-cfg-image")
    walk, node = "generate", "euler_step/denoiser_2"  # denoiser + fused guidance and Euler step
    recorded = [Recorded(captured, walk, r) for r in requests("example-cfg-image")]
    result = cfg_pool.submit_batch(
        rank, walk, node, items_for(plan, captured, walk, node, recorded)
    ).result(TIMEOUT_S)
    assert isinstance(result, BatchResult) and result.rank == rank
    expected = reference_outputs(captured, plan, walk, node, recorded)
    assert_same(result.outputs, expected)
    # And the batch is the model's step: close to the unbatched reference run.
    for i, r in enumerate(recorded):
        got = result.outputs[10 + i]["euler_step/add_2"]
        assert torch.allclose(got, r.values["euler_step/add_2"], rtol=1e-5, atol=1e-6)


def test_glue_and_kv_component_nodes_of_speech(speech_pool: WorkerPool) -> None:
    captured, plan = prepare("example-speech")
    recorded = [Recorded(captured, "speak", r) for r in requests("example-speech")]
    for rank, node in [(0, "cat_1"), (1, "think_step/thinker"), (0, "getattr_1")]:
        items = items_for(plan, captured, "speak", node, recorded)
        result = speech_pool.submit_batch(rank, "speak", node, items).result(TIMEOUT_S)
        assert_same(result.outputs, reference_outputs(captured, plan, "speak", node, recorded))


def test_part_of_a_node_runs_as_the_conductor_splits_it(cfg_pool: WorkerPool) -> None:
    """A component without its fused glue, then that glue alone (later, as glue), and the
    values asked for."""
    captured, plan = prepare("example-cfg-image")
    walk, node = "generate", "euler_step/denoiser_2"
    (plan_node,) = [n for n in plan.nodes(walk) if n.name == node]
    recorded = [Recorded(captured, walk, r) for r in requests("example-cfg-image")]
    items = items_for(plan, captured, walk, node, recorded)
    head, tail = plan_node.ops[:1], plan_node.ops[1:]
    first = cfg_pool.submit_batch(0, walk, node, items, ops=head).result(TIMEOUT_S)
    assert all(set(v) == set(head) for v in first.outputs.values())
    glue_items = [
        (item, rid, {**inputs, head[0]: first.outputs[item][head[0]]})
        for item, rid, inputs in items
    ]
    want = ["euler_step/add_2", "euler_step/mul"]
    second = cfg_pool.submit_batch(1, walk, node, glue_items, ops=tail, outputs=want)
    got = second.result(TIMEOUT_S).outputs
    expected = reference_outputs(captured, plan, walk, node, recorded)
    for i in range(len(recorded)):
        assert set(got[10 + i]) == set(want)
        assert torch.equal(got[10 + i]["euler_step/add_2"], expected[i]["euler_step/add_2"])
    with pytest.raises(BatchError, match="not a subsequence"):
        cfg_pool.submit_batch(0, walk, node, items, ops=[tail[1], tail[0]]).result(TIMEOUT_S)


def test_large_tensors_travel_through_shared_memory(cfg_pool: WorkerPool) -> None:
    big = torch.arange(40_000, dtype=torch.int64).view(1, -1)  # 320 KB each way
    small = torch.ones(1, 8, dtype=torch.int64)
    before = cfg_pool.shm_stats()
    items = [(0, "big", {"prompt_ids": big}), (1, "small", {"prompt_ids": small})]
    result = cfg_pool.submit_batch(1, "generate", "full_like", items).result(TIMEOUT_S)
    assert torch.equal(result.outputs[0]["full_like"], torch.zeros_like(big))
    assert torch.equal(result.outputs[1]["full_like"], torch.zeros_like(small))
    after = cfg_pool.shm_stats()
    assert sum(c.created for c in after.classes) >= max(1, sum(c.created for c in before.classes))
    assert after.in_use == 0  # the worker acked the input slot
    assert shm_names(cfg_pool.health()[1].shm_pool or "missing")  # it wrote the output there
    assert wait_for(lambda: output_slots_idle(cfg_pool, 1))  # and we acked it


def test_spawned_ranks_talk_over_rank_links_and_large_messages_cross_them_whole() -> None:
    """Each spawned rank's link is up (its process's pid the kernel's word); a message of 2 MB
    each way (tensors inline, past the kernel's socket buffer, so both sides cut it) arrives
    whole; ZeroMQ in their place (``rank_links=False``) gives the same outputs. A rank that
    reads nothing (stopped) is sent commands until what waits reaches the link's bound: the
    next one fails, naming why; once it reads again it answers every command taken."""
    captured, plan = prepare("example-cfg-image")
    big = torch.arange(250_000, dtype=torch.int64).view(1, -1)  # 2 MB
    items = [(0, "big", {"prompt_ids": big}), (1, "small", {"prompt_ids": big[:, :8]})]
    outputs = {}
    for links in (True, False):
        config = dataclasses.replace(
            CONFIG, inline_max_bytes=4 << 20, rank_links=links, link_max_unsent=1 << 20
        )
        with WorkerPool("example-cfg-image", 0, captured, plan, 2, THREADS, config) as pool:
            ranks = pool._ranks.values()
            assert all((state.link is not None) == links for state in ranks)
            assert sorted(s.rank for s, _ in pool._links.values()) == ([0, 1] if links else [])
            result = pool.submit_batch(0, "generate", "full_like", items).result(TIMEOUT_S)
            assert pool.shm_stats().in_use == 0 and not any(
                c.created for c in pool.shm_stats().classes
            )  # inline both ways: nothing went through shared memory
            outputs[links] = result.outputs
            if links:
                pid = pool.pid(1)
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                try:
                    taken = []
                    for k in range(20):  # the kernel's buffer fills, then the link's bound
                        f = pool.submit_batch(
                            1, "generate", "full_like", [(0, f"s{k}", items[0][2])]
                        )
                        if f.done() and f.exception() is not None:
                            break
                        taken.append(f)
                    assert taken and len(taken) < 20
                    with pytest.raises(WorkerDied, match="rank 1 reads no commands"):
                        f.result(0)
                finally:
                    os.kill(pid, signal.SIGCONT)
                for f in taken:  # it reads again: every command the link took is answered
                    got = f.result(TIMEOUT_S).outputs[0]["full_like"]
                    assert torch.equal(got, torch.zeros_like(big))
                assert pool._ranks[1].link is not None and not pool._ranks[1].link.pending()
    for i, want in ((0, torch.zeros_like(big)), (1, torch.zeros(1, 8, dtype=torch.int64))):
        assert torch.equal(outputs[True][i]["full_like"], want)
        assert torch.equal(outputs[False][i]["full_like"], want)


def test_a_failing_request_fails_alone_in_its_batch(cfg_pool: WorkerPool) -> None:
    ok = torch.ones(1, 8, dtype=torch.int64)
    items = [(0, "a", {"prompt_ids": ok}), (1, "b", {"prompt_ids": "not a tensor"})]
    items.append((2, "c", {"prompt_ids": ok}))
    result = cfg_pool.submit_batch(0, "generate", "full_like", items).result(TIMEOUT_S)
    assert sorted(result.errors) == [1] and sorted(result.outputs) == [0, 2]
    assert "full_like" in result.errors[1] and "rank 0" in result.errors[1]
    assert torch.equal(result.outputs[2]["full_like"], torch.zeros_like(ok))

    # A batched call of a stateless component that raises is retried request by request:
    # the bad one fails, the other gets what it gets alone.
    captured, plan = prepare("example-cfg-image")
    recorded = [Recorded(captured, "generate", r) for r in requests("example-cfg-image", 2)]
    items = items_for(plan, captured, "generate", "euler_step/denoiser", recorded)
    items[0][2]["euler_step/z"] = torch.ones(1, 3, 5, 5)  # wrong channels: conv raises
    result = cfg_pool.submit_batch(0, "generate", "euler_step/denoiser", items).result(TIMEOUT_S)
    assert sorted(result.errors) == [10] and "denoiser" in result.errors[10]
    alone = reference_outputs(captured, plan, "generate", "euler_step/denoiser", recorded[1:])
    assert_same({10: result.outputs[11]}, alone)
    # Every item failing is the batch failing.
    with pytest.raises(BatchError, match="denoiser") as failed:
        cfg_pool.submit_batch(0, "generate", "euler_step/denoiser", items[:1]).result(TIMEOUT_S)
    assert sorted(failed.value.errors) == [10]

    # An unknown node fails its batch too; the worker serves on.
    with pytest.raises(BatchError, match="not placed"):
        cfg_pool.submit_batch(0, "generate", "nope", [(0, "a", {})]).result(TIMEOUT_S)
    result = cfg_pool.submit_batch(0, "generate", "full_like", [(0, "a", {"prompt_ids": ok})])
    assert torch.equal(result.result(TIMEOUT_S).outputs[0]["full_like"], torch.zeros_like(ok))
    assert all(h.status == "ready" for h in cfg_pool.health().values())
    assert cfg_pool.shm_stats().in_use == 0


def test_no_pickle_in_a_full_round_trip(
    cfg_pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool is running (spawn pickled its plain str/int start-up arguments before this).
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    for module in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", forbidden)
    with pytest.raises(AssertionError):
        pickle.dumps(1)

    big = torch.arange(20_000, dtype=torch.int64).view(1, -1)
    items = [(0, "a", {"prompt_ids": big}), (1, "b", {"prompt_ids": big[:, :8]})]
    result = cfg_pool.submit_batch(1, "generate", "full_like", items).result(TIMEOUT_S)
    assert torch.equal(result.outputs[0]["full_like"], torch.zeros_like(big))
    captured, plan = prepare("example-cfg-image")
    recorded = [Recorded(captured, "generate", r) for r in requests("example-cfg-image", 2)]
    items2 = items_for(plan, captured, "generate", "text_encoder_1", recorded)
    result = cfg_pool.submit_batch(0, "generate", "text_encoder_1", items2).result(TIMEOUT_S)
    node = next(n for n in plan.nodes("generate") if n.name == "text_encoder_1")
    want = set(node.outputs)
    assert "text_encoder_1" in want and set(result.outputs[10]) == want
    # The workers forbid pickle themselves (PoolConfig.forbid_pickle) and still serve.
    assert all(h.status == "ready" for h in cfg_pool.health().values())


# --------------------------------------------------------------------------- lifecycle


def test_killed_worker_is_reported_and_cleaned_up_then_restart_is_clean() -> None:
    captured, plan = prepare("example-cfg-image")
    big = torch.arange(20_000, dtype=torch.int64).view(1, -1)
    config = dataclasses.replace(CONFIG, supervision=SupervisionConfig(restart=False))
    pool = WorkerPool("example-cfg-image", 0, captured, plan, 2, THREADS, config)
    pids = [pool.pid(r) for r in pool.ranks]
    try:
        # Rank 1 writes an output segment, so there is something of its own to clean up.
        pool.submit_batch(1, "generate", "full_like", [(0, "a", {"prompt_ids": big})]).result(
            TIMEOUT_S
        )
        rank1_pool = pool.health()[1].shm_pool
        assert rank1_pool is not None and shm_names(rank1_pool)
        pid = pool.pid(1)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the next batch is surely in flight when it dies
        future = pool.submit_batch(1, "generate", "full_like", [(0, "b", {"prompt_ids": big})])
        assert pool.shm_stats().in_use == 1 and pool.health()[1].in_flight == 1
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=r"worker rank 1 \(pid \d+\) died \(killed by SIGKILL"):
            future.result(TIMEOUT_S)
        health = pool.health()
        assert health[1].status == "dead" and health[1].exitcode == -signal.SIGKILL
        assert health[1].in_flight == 0 and "SIGKILL" in (health[1].error or "")
        assert health[0].status == "ready"
        assert pool.shm_stats().in_use == 0  # the input slot it held is free again
        assert shm_names(rank1_pool) == []  # its own segments are unlinked
        with pytest.raises(WorkerDied, match="rank 1"):
            pool.submit_batch(1, "generate", "full_like", [(0, "c", {"prompt_ids": big})]).result(
                TIMEOUT_S
            )
        done = pool.submit_batch(0, "generate", "full_like", [(0, "d", {"prompt_ids": big})])
        assert torch.equal(done.result(TIMEOUT_S).outputs[0]["full_like"], torch.zeros_like(big))
        segments = pool_segments(pool)
    finally:
        pool.close()
    assert pool.health()[0].status == "closed" and pool.health()[1].status == "dead"
    assert [n for n in segments if Path("/dev/shm", n).exists()] == []
    assert zombies() == []
    for pid in pids:
        assert pid is not None and not Path(f"/proc/{pid}").exists()

    # A second pool after the first: starts, serves, and closes without leaving anything.
    with WorkerPool("example-cfg-image", 0, captured, plan, 2, THREADS, CONFIG) as second:
        second.submit_batch(0, "generate", "full_like", [(0, "a", {"prompt_ids": big})]).result(
            TIMEOUT_S
        )
        segments = pool_segments(second)
        pids = [second.pid(r) for r in second.ranks]
        assert segments
    assert [n for n in segments if Path("/dev/shm", n).exists()] == []
    assert zombies() == []
    for pid in pids:
        assert pid is not None and not Path(f"/proc/{pid}").exists()


def test_a_worker_that_cannot_set_up_fails_the_start_with_its_reason() -> None:
    captured, plan = prepare("example-cfg-image")
    one_rank = ExecutablePlan.from_json(plan.to_json())
    for walk in one_rank.walks:
        for node in one_rank.nodes(walk):
            node.ranks = [0]
    with pytest.raises(WorkerStartError, match=r"rank 0: setup failed: ValueError: unknown model"):
        WorkerPool("no-such-model", 0, captured, one_rank, 1, THREADS, CONFIG)
    with pytest.raises(ValueError, match=r"placed on ranks \[1\]"):
        WorkerPool("example-cfg-image", 0, captured, plan, 1, THREADS, CONFIG)
    if not torch.cuda.is_available():  # a plan for a GPU the worker does not see
        one_rank.device = "cuda"
        with pytest.raises(WorkerStartError, match=r"rank 0: the plan runs on 'cuda' but"):
            WorkerPool("example-cfg-image", 0, captured, one_rank, 1, THREADS, CONFIG)
    assert zombies() == []


# ------------------------------------------------------------------------ in-process parts


def test_worker_module_imports_no_torch() -> None:
    """spawn imports ``worker`` in the child before ``worker_main`` sets OMP_NUM_THREADS."""
    code = "import sys, walkserve.runtime.worker; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_runner_runs_nodes_in_process() -> None:
    captured, plan = prepare("example-cfg-image")
    recorded = [Recorded(captured, "generate", r) for r in requests("example-cfg-image")]
    runner = NodeRunner(captured, plan, 1)
    node = "euler_step/denoiser_2"
    (plan_node,) = [n for n in plan.nodes("generate") if n.name == node]
    items = [
        RunItem(item, tuple(plan_node.ops), inputs, tuple(plan_node.outputs))
        for item, _, inputs in items_for(plan, captured, "generate", node, recorded)
    ]
    results = runner.run("generate", node, items)
    expected = reference_outputs(captured, plan, "generate", node, recorded)
    assert_same({r.item: r.values for r in results}, expected)
    assert runner.has("generate", "full_like") and not runner.has("generate", "nope")


def test_transports_and_object_store() -> None:
    config = ShmPoolConfig(min_slot_bytes=64 * KiB, max_slot_bytes=1 << 20)
    with ShmPool(config) as pool, ShmReader([pool.spec]) as reader:
        store = ObjectStore(rank=3)
        worker = ShmTransport(pool, reader, objects=store)
        conductor = ShmTransport(pool, reader)
        cache = {"k": torch.ones(2)}  # a stand-in for a Hugging Face cache object
        value = (torch.arange(3), torch.zeros(70_000), [1, 2.5, None, True, "s"], cache)
        value += (torch.Size([2, 3]),)
        payload = worker.send(value, "r1")
        assert isinstance(payload, Seq) and payload.kind == "tuple"
        assert isinstance(payload.items[1], ShmHandle)
        assert payload.items[3] == ObjectRef(3, "o0")
        # The conductor keeps the object handle as it is; the worker resolves it.
        held, tokens = conductor.receive(payload, "r1")
        assert held[3] == ObjectRef(3, "o0") and tokens == [payload.items[1]]
        assert torch.equal(held[1], torch.zeros(70_000)) and held[2] == [1, 2.5, None, True, "s"]
        assert type(held[4]) is torch.Size
        conductor.release(tokens)
        assert pool.stats().in_use == 0
        back, _ = worker.receive(ObjectRef(3, "o0"), "r1")
        assert back is cache
        with pytest.raises(TransportError, match="never cross processes"):
            ObjectStore(rank=0).get("r1", ObjectRef(3, "o0"))
        with pytest.raises(TransportError, match="no object"):
            worker.receive(ObjectRef(3, "o0"), "another request")
        assert store.drop("r1") == 1 and len(store) == 0
        with pytest.raises(Unencodable):
            conductor.send({"a": 1}, "r1")
    local = LocalTransport()
    obj = object()
    assert local.receive(local.send(obj, "r"), "r") == (obj, [])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(4, 3).t(),  # strided
        torch.tensor(5),
        torch.zeros(0, 3),
        torch.randn(2, 2).bfloat16(),
        torch.rand(3) > 0.5,
        (torch.randn(3) + 1j * torch.randn(3)).conj(),  # lazy conjugation
        torch.arange(10)[2:7],  # storage offset
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_inline_fast_path_matches_tensorcodec(tensor: torch.Tensor) -> None:
    ref = inline(tensor)
    assert (ref.header, ref.data) == to_bytes(tensor)
    back = from_inline(ref)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, from_bytes(ref.header, ref.data))
