"""Tensor parallelism without processes: how heads split, which groups a placement asks for,
the rendezvous a server hands its workers, and the runner's object handles and wire form
(``runtime.tp``; the multi-process checks are in ``tests/integration/test_tp.py``)."""

from __future__ import annotations

import dataclasses
import gc
import os
import stat
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from walkserve.lowering.batched import DEFER
from walkserve.lowering.placement import Placement, PlacementError
from walkserve.runtime.tp.group import Rendezvous, TPGroupSpec, TPSetup, tp_groups
from walkserve.runtime.tp.heads import HeadSplit, split_heads
from walkserve.runtime.tp.runner import (
    TPObject,
    TPRunner,
    _enc,
    _encoder,
    _Message,
    _Step,
    _WireCall,
)


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "rank", "want"),
    [
        (8, 8, 2, 1, HeadSplit(4, 4, 4, 1)),
        (8, 4, 2, 1, HeadSplit(4, 2, 2, 1)),
        (8, 2, 4, 0, HeadSplit(2, 1, 0, 2)),  # fewer KV heads than ranks: each on 2 ranks
        (8, 2, 4, 1, HeadSplit(2, 1, 0, 2)),
        (8, 2, 4, 2, HeadSplit(2, 1, 1, 2)),
        (8, 1, 4, 3, HeadSplit(2, 1, 0, 4)),  # MQA
        (8, 2, 1, 0, HeadSplit(8, 2, 0, 1)),
    ],
)
def test_split_heads(heads: int, kv: int, tp: int, rank: int, want: HeadSplit) -> None:
    assert split_heads(heads, kv, tp, rank) == want


def test_every_query_head_reads_the_kv_head_its_rank_holds() -> None:
    heads, kv, tp = 16, 4, 8
    group = heads // kv  # query heads per KV head
    for rank in range(tp):
        split = split_heads(heads, kv, tp, rank)
        queries = range(rank * split.heads, (rank + 1) * split.heads)
        assert {q // group for q in queries} == set(
            range(split.kv_start, split.kv_start + split.kv_heads)
        )


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "match"),
    [
        (
            6,
            6,
            4,
            r"degree 4 does not divide the 6 attention heads; use a degree among \[1, 2, 3, 6\]",
        ),
        (12, 6, 4, r"neither divides the 6 KV heads nor is a multiple"),
        (8, 3, 2, r"do not group"),
    ],
)
def test_split_heads_refuses(heads: int, kv: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_heads(heads, kv, tp)


def test_tp_groups_from_a_placement() -> None:
    placement = Placement(
        ranks=5,
        rules={"thinker": [0, 1], "thinker_2": [0, 1], "lm": [2, 3, 4, 1], "codec": [4]},
        tensor_parallel={"thinker": 2, "thinker_2": 2, "lm": 1},
    )
    assert tp_groups(placement) == [TPGroupSpec((0, 1))]
    replicas = Placement(ranks=4, rules={"lm": [0, 1, 2, 3]}, tensor_parallel={"lm": 2})
    assert tp_groups(replicas) == [TPGroupSpec((0, 1)), TPGroupSpec((2, 3))]


def test_tp_groups_refuses_a_rank_in_two_groups() -> None:
    placement = Placement(
        ranks=3, rules={"a": [0, 1], "b": [1, 2]}, tensor_parallel={"a": 2, "b": 2}
    )
    with pytest.raises(PlacementError, match=r"rank 1 is in two tensor-parallel groups"):
        tp_groups(placement)


def test_group_spec() -> None:
    spec = TPGroupSpec((3, 1))
    assert (spec.leader, spec.size, spec.group_rank(1), spec.key) == (3, 2, 1, "tp/3-1/")
    with pytest.raises(ValueError, match="two or more distinct"):
        TPGroupSpec((2, 2))


def test_rendezvous_tcp_holds_a_loopback_port_and_setups_travel_as_msgpack() -> None:
    with Rendezvous.tcp() as rdv:
        host, _, port = rdv.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        setup = rdv.setup(TPGroupSpec((0, 1)), 1, device="cuda:1")
        assert (setup.backend, setup.store, setup.address) == ("nccl", "tcp", rdv.address)
        wire = msgspec.msgpack.encode(setup)
        assert msgspec.msgpack.decode(wire, type=TPSetup) == setup
        with pytest.raises(ValueError, match="not in TP group"):
            rdv.setup(TPGroupSpec((0, 1)), 2)


def test_rendezvous_file_is_private_and_removed() -> None:
    rdv = Rendezvous.file()
    mode = stat.S_IMODE(os.stat(rdv.address).st_mode)
    assert mode == 0o700
    setup = rdv.setup(TPGroupSpec((2, 3)), 2)
    assert setup.backend == "gloo" and os.path.dirname(setup.address) == rdv.address
    rdv.close()
    assert not os.path.exists(rdv.address)


class Echo:
    """Returns each call's tensor + 1 and a state object (new, or the one passed in)."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def forward_batch(self, calls: list[Any]) -> list[Any]:
        out: list[Any] = []
        for args, kwargs in calls:
            if kwargs.get("defer"):
                out.append(DEFER)
                continue
            state = args[1] if args[1] is not None else State(self, int(args[0][0]))
            out.append((args[0] + 1, state))
        return out


class State:
    def __init__(self, owner: Echo, tag: int) -> None:
        self.owner, self.tag = owner, tag

    def __del__(self) -> None:
        self.owner.freed.append(self.tag)


def step(runner: TPRunner, calls: list[Any], release: list[int] = ()) -> list[Any]:  # type: ignore[assignment]
    """One leader step without the broadcast: encode, decode as a follower would, execute."""
    wire = _encoder.encode(
        _Step(
            list(release),
            [
                _WireCall([_enc(a) for a in args], {k: _enc(v) for k, v in kw.items()})
                for args, kw in calls
            ],
        )
    )
    message = msgspec.msgpack.decode(wire, type=_Message)
    results, error = runner._execute(message)
    if error is not None:
        raise error
    return [runner._export(r) for r in results]


def test_runner_hands_out_one_handle_per_object_and_releases_at_the_step_boundary() -> None:
    echo = Echo()
    runner = TPRunner(SimpleNamespace(is_leader=True, size=2), echo)  # type: ignore[arg-type]
    a, b, deferred = step(
        runner,
        [
            ((torch.tensor([5]), None), {}),
            ((torch.tensor([7]), None), {}),
            ((torch.tensor([9]), None), {"defer": True}),
        ],
    )
    assert deferred is DEFER
    assert torch.equal(a[0], torch.tensor([6])) and isinstance(a[1], TPObject)
    again = step(runner, [((a[0], a[1]), {})])[0]
    assert again[1] is a[1]  # the same object comes back as the same handle
    handle = a[1].handle
    del a, again
    gc.collect()
    assert runner._dropped == type(runner._dropped)([handle])  # queued, not yet released
    assert runner.live_objects == 2 and echo.freed == []
    step(runner, [], release=[runner._dropped.popleft()])
    gc.collect()
    assert runner.live_objects == 1 and echo.freed == [5]
    with pytest.raises(ValueError, match="released"):
        step(runner, [((torch.tensor([1]), TPObject(handle)), {})])
    assert b[1].handle != handle


def test_call_arguments_that_cannot_travel_are_refused() -> None:
    with pytest.raises(TypeError, match="a TP call argument must be"):
        _enc(object())
    with pytest.raises(TypeError):
        _enc({1: 2})


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_plan_memory_counts_one_shard_of_a_paged_lm(kv_heads: int) -> None:
    transformers = pytest.importorskip("transformers")
    from walkserve import capture
    from walkserve.adapters.hf_causal_lm import CausalLMWalks, sample_request
    from walkserve.lowering.memory import MemoryLimits, estimate_memory
    from walkserve.lowering.resolved import resolve
    from walkserve.runtime.kv.hf import register
    from walkserve.runtime.kv.paged_lm import PagedLMConfig

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
    )
    lm = transformers.LlamaForCausalLM(config).eval()
    lm.set_attn_implementation(register())
    model = CausalLMWalks(lm, 0, PagedLMConfig(pool_tokens=64, page_size=16))
    captured = capture.trace(model, sample_request([1, 2, 3], 2))
    placement = Placement(ranks=2, rules={"lm": [0, 1]}, tensor_parallel={"lm": 2})
    estimates = estimate_memory(resolve(placement, captured), captured, MemoryLimits())
    kv_rows = kv_heads * 8
    split = 32 * 32 + 32 * 32 + 3 * 64 * 32  # q, o, gate, up, down: halved
    kv = 2 * kv_rows * 32  # k, v: halved when the KV heads split, whole when replicated
    layer = split // 2 + (kv // 2 if kv_heads == 2 else kv) + 2 * 32  # + two norms
    buffers = sum(b.numel() for b in lm.buffers())
    weights = (2 * layer + 2 * 128 * 32 // 2 + 32 + buffers) * 4  # embed, head halved; norm
    pool = 2 * 2 * 4 * 16 * 1 * 8 * 4  # K and V, 2 layers, 4 pages of 16, 1 KV head, dim 8
    for rank in (0, 1):
        contributors = dict(estimates[rank].contributors)
        assert contributors["weights lm (1/2 shard)"] == weights
        assert contributors["KV pool lm (1/2 shard)"] == pool


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    cache: Any = None


def test_a_dataclass_result_comes_back_as_its_type_with_objects_as_handles() -> None:
    """A component returning a record (a ``ModelOutput``) of tensors and a cache object: the
    leader gets the same record type, tensors as they were, the cache as a ``TPObject``."""
    echo = Echo()

    def batch(calls: list[Any]) -> list[Any]:
        return [Output(t, s) for t, s in echo.forward_batch(calls)]

    runner = TPRunner(SimpleNamespace(is_leader=True, size=2), batch)  # type: ignore[arg-type]
    (out,) = step(runner, [((torch.tensor([5]), None), {})])
    assert type(out) is Output and torch.equal(out.logits, torch.tensor([6]))
    assert isinstance(out.cache, TPObject) and runner.live_objects == 1
    (again,) = step(runner, [((out.logits, out.cache), {})])
    assert again.cache is out.cache and torch.equal(again.logits, torch.tensor([7]))


_EXPERTS = "layers.*.mlp.experts"
_TP_EXPERT_RULES = {f"{_EXPERTS}.gate_up_proj": "packed_colwise", _EXPERTS: "moe_tp_experts"}
_EP_RULES = {f"{_EXPERTS}.gate_up_proj": "grouped_gemm", _EXPERTS: "ep_dispatch_experts"}
_DENSE = {"layers.*.self_attn.q_proj": "colwise"}


def test_expert_sharding_reads_whichever_plan_names_the_experts() -> None:
    """transformers up to 5.24 names the experts in both plans; 5.25 in the EP plan only."""
    from walkserve.runtime.tp.shard import ShardingError, expert_sharding

    both = {**_DENSE, **_TP_EXPERT_RULES}
    assert expert_sharding("tensor", both, _EP_RULES, "M") == "tensor"
    assert expert_sharding("expert", both, _EP_RULES, "M") == "expert"
    assert expert_sharding("expert", _DENSE, _EP_RULES, "M") == "expert"
    with pytest.warns(UserWarning, match="whole experts are split across the ranks instead"):
        assert expert_sharding("tensor", _DENSE, _EP_RULES, "M") == "expert"
    assert expert_sharding("tensor", _DENSE, {}, "M") is None  # dense: nothing to shard
    with pytest.raises(ShardingError, match="experts='expert' needs an MoE model"):
        expert_sharding("expert", _DENSE, {}, "M")


def test_installed_transformers_names_qwen3_moe_experts_in_a_plan_walkserve_reads() -> None:
    """The installed release's Qwen3-MoE plans: its experts are sharded in both modes (never
    left whole on every rank), with a warning only where "tensor" has no TP rule to follow;
    a dense Llama has no experts."""
    import warnings

    transformers = pytest.importorskip("transformers")
    from walkserve.runtime.tp.shard import _model_plans, expert_sharding

    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    plan, ep_plan = _model_plans(transformers.Qwen3MoeForCausalLM, config)
    tensor_rules = "moe_tp_experts" in plan.values()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = expert_sharding("tensor", plan, ep_plan, "Qwen3Moe")
    assert got == ("tensor" if tensor_rules else "expert")
    assert len(seen) == (0 if tensor_rules else 1)
    assert expert_sharding("expert", plan, ep_plan, "Qwen3Moe") == "expert"
    llama = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    plan, ep_plan = _model_plans(transformers.LlamaForCausalLM, llama)
    assert ep_plan == {} and expert_sharding("tensor", plan, ep_plan, "Llama") is None
