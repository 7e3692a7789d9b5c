"""Tensor-parallel groups and replicas in the plan and the batcher, without processes: a TP
group is dispatched to through its leader (the plan records the group and its components),
replicas share the work, and an item that reads a value held on one replica (its KV cache)
goes to that replica (the served checks are in ``tests/integration/test_tp_serve.py``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from walkserve import capture
from walkserve.adapters.examples import build_example
from walkserve.capture.model import CapturedModel
from walkserve.lowering.lower import lower
from walkserve.lowering.placement import Placement, PlacementError, tensor_parallel_placement
from walkserve.lowering.plan import ExecutablePlan, NodePlan, RegionPlan
from walkserve.runtime.batcher import Batcher
from walkserve.runtime.conductor import WorkItem
from walkserve.runtime.wirevalues import ObjectRef


@pytest.fixture(scope="module")
def text() -> tuple[CapturedModel, dict[str, Any]]:
    model, sample = build_example("example-text")
    return capture.trace(model, sample), sample


def plan_for(text: tuple[CapturedModel, dict[str, Any]], placement: Placement) -> ExecutablePlan:
    captured, sample = text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lower(captured, sample, placement, check_capture=False)


def node_ranks(plan: ExecutablePlan) -> set[tuple[int, ...]]:
    return {tuple(n.ranks) for w in plan.walks for n in plan.nodes(w)}


def test_a_tp_group_is_dispatched_to_through_its_leader(text: Any) -> None:
    plan = plan_for(text, tensor_parallel_placement(text[0], 2))
    assert [(g.ranks, g.components) for g in plan.tp_groups] == [([0, 1], ["lm"])]
    assert node_ranks(plan) == {(0,)}
    assert plan.regions  # the leader runs the decode loop by itself, as one rank would
    assert plan.ranks[1].nodes == plan.ranks[0].nodes  # the follower hosts them too
    assert "tensor-parallel group ranks [0, 1] (leader 0): lm" in plan.format()
    assert ExecutablePlan.from_json(plan.to_json()).tp_groups == plan.tp_groups


def test_replicas_of_tp_groups_and_plain_replicas(text: Any) -> None:
    plan = plan_for(text, tensor_parallel_placement(text[0], 2, replicas=2))
    assert [g.ranks for g in plan.tp_groups] == [[0, 1], [2, 3]]
    assert node_ranks(plan) == {(0, 2)}
    assert {r.rank for rs in plan.regions.values() for r in rs} == {0}
    assert {tuple(r.replicas) for rs in plan.regions.values() for r in rs} == {(0, 2)}
    plan = plan_for(text, tensor_parallel_placement(text[0], 1, replicas=3))
    assert plan.tp_groups == [] and node_ranks(plan) == {(0, 1, 2)}
    decode = plan.regions["decode"]  # the decode loop: a region of each replica
    assert [r.ranks for r in decode] == [[0, 1, 2]] and "ranks [0, 1, 2]" in plan.format()
    with pytest.raises(PlacementError, match="--data-parallel-size must be a positive int"):
        tensor_parallel_placement(text[0], 2, replicas=0)


def test_a_node_beside_a_group_keeps_its_rank(text: Any) -> None:
    placement = Placement(ranks=2, rules={"lm": [1, 0]}, tensor_parallel={"lm": 2})
    plan = plan_for(text, placement)
    assert [g.ranks for g in plan.tp_groups] == [[1, 0]] and node_ranks(plan) == {(1,)}


def item(i: int, request: str, held: int | None = None) -> WorkItem:
    call: tuple[list[Any], dict[str, Any]] = ([1], {})
    if held is not None:
        call = ([1, (ObjectRef(held, f"k{i}"),)], {})
    return WorkItem(i, request, "decode", "step/lm", "component", ("lm",), (), False, call)


def test_replicas_share_work_and_state_stays_where_it_lives() -> None:
    nodes = {("decode", "step/lm"): NodePlan("step/lm", "component", ["lm"], "lm", [0, 2])}
    batcher = Batcher(nodes, {})
    first = batcher.batches([item(0, "a")])
    second = batcher.batches([item(1, "b")])  # rank of `first` has a batch in flight
    assert {first[0].rank, second[0].rank} == {0, 2}
    for b in (*first, *second):
        batcher.returned(b)
    # held on 2: every item with a value there goes there, whatever the load
    sticky = [batcher.batches([item(10 + k, "a", held=2)])[0] for k in range(3)]
    assert [b.rank for b in sticky] == [2, 2, 2]
    free = batcher.batches([item(20, "c")])  # the least loaded: rank 0
    assert free[0].rank == 0
    assert batcher.per_rank == {0: 2, 2: 4}
    assert batcher.batches([item(30, "d", held=5)])[0].rank in (0, 2)  # not a replica's


def test_a_crowd_of_new_requests_spreads_and_a_dead_replica_gets_none() -> None:
    nodes = {("decode", "step/lm"): NodePlan("step/lm", "component", ["lm"], "lm", [0, 2])}
    batcher = Batcher(nodes, {})
    crowd = batcher.batches([item(k, f"r{k}") for k in range(4)])
    assert sorted((b.rank, len(b.items)) for b in crowd) == [(0, 2), (2, 2)]
    dead = {0}
    batcher = Batcher(nodes, {}, alive=lambda rank: rank not in dead)
    assert {b.rank for b in batcher.batches([item(k, f"r{k}") for k in range(4)])} == {2}
    assert batcher.batches([item(9, "a", held=0)])[0].rank == 0  # its state is there: it fails


def test_a_region_of_replicas_goes_where_its_state_is_else_to_the_least_busy() -> None:
    region = RegionPlan("region0", 0, [], ["step"], ["cache"], ["tokens"], replicas=[0, 1])
    batcher = Batcher({}, {("decode", "region0"): region})

    def start(i: int, held: int | None = None) -> WorkItem:
        env = {} if held is None else {"cache": ObjectRef(held, f"k{i}")}
        return WorkItem(i, f"r{i}", "decode", "region0", "region", (), (), False, env=env)

    assert batcher.quiet()
    assert sorted(b.rank for b in batcher.batches([start(0), start(1)])) == [0, 1]
    assert [b.rank for b in batcher.batches([start(2, held=1)])] == [1]
    assert [b.rank for b in batcher.batches([start(3)])] == [0]  # rank 1 runs two now
    batcher.region_returned(1)
    batcher.region_returned(1)
    assert [b.rank for b in batcher.batches([start(4)])] == [1]
    for rank in (0, 0, 1):
        assert not batcher.quiet()  # a region item is out (a burst would join it: no hold)
        batcher.region_returned(rank)
    assert batcher.quiet()


def test_the_batcher_is_quiet_when_no_item_is_out() -> None:
    nodes = {("decode", "step/lm"): NodePlan("step/lm", "component", ["lm"], "lm", [0])}
    batcher = Batcher(nodes, {})
    (batch,) = batcher.batches([item(0, "a"), item(1, "b")])
    assert not batcher.quiet()
    batcher.returned(batch)
    assert batcher.quiet()
