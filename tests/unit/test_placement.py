"""Placement: the file format, resolution of every node's ranks, validation messages, the
concurrency warning, and the memory estimate, on the captured example models."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typeguard import TypeCheckError

from walkserve import capture
from walkserve.adapters.examples import EXAMPLES, build_example, example_placement
from walkserve.capture import dataflow, ir
from walkserve.capture.model import CapturedModel
from walkserve.lowering.memory import MemoryLimits, estimate_memory, format_memory
from walkserve.lowering.placement import Placement, PlacementError, PlacementWarning, parse_size
from walkserve.lowering.resolved import ResolvedPlacement, resolve

CFG = "example-cfg-image"
SPEECH = "example-speech"
TEXT = "example-text"
FLOAT32 = 4


@pytest.fixture(scope="module")
def models() -> dict[str, CapturedModel]:
    return {name: capture.trace(*build_example(name)) for name in EXAMPLES}


@pytest.fixture(scope="module")
def cfg(models: dict[str, CapturedModel]) -> CapturedModel:
    return models[CFG]


def op_names(walk: ir.Walk) -> list[str]:
    return [n.name for n in dataflow.iter_nodes(walk.body) if isinstance(n, ir.Op)]


def resolve_quietly(placement: Placement, captured: CapturedModel) -> ResolvedPlacement:
    """resolve(), failing on any PlacementWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        return resolve(placement, captured)


# ------------------------------------------------------------------------------ default


def test_default_placement_puts_every_node_on_rank_0(models: dict[str, CapturedModel]) -> None:
    assert Placement.default() == Placement(ranks=1)
    for captured in models.values():
        for ranks in (1, 3):
            resolved = resolve_quietly(Placement.default(ranks), captured)
            for name, walk in captured.walks.items():
                placed = resolved.walks[name]
                assert list(placed) == op_names(walk)  # every op once; loops are not placed
                assert all(p.ranks == (0,) for p in placed.values())


# ------------------------------------------------------------------------------ files


def test_yaml_and_json_round_trip(tmp_path: Path) -> None:
    placement = Placement(
        ranks=4,
        rules={"denoiser": [0, 1, 2, 3], "generate:euler_step/denoiser_1": [2], "decoder": [3]},
        tensor_parallel={"denoiser": 2},
        replicas={"denoiser": 2},
        concurrent=[["generate:euler_step/denoiser", "generate:euler_step/denoiser_1"]],
        memory_budget_bytes={0: 2 * 2**30, 3: 512 * 2**20},
    )
    assert Placement.from_dict(placement.to_dict()) == placement
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"p{suffix}"
        placement.to_file(path)
        assert Placement.from_file(path) == placement
    shipped = Placement.from_file(example_placement(CFG, 2))
    shipped.to_file(tmp_path / "cfg.json")
    assert Placement.from_file(tmp_path / "cfg.json") == shipped


def test_file_sizes_and_json_rank_keys(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"ranks": 2, "memory_budget": {"0": "2GiB", "1": "1.5 GB"}}))
    assert dict(Placement.from_file(path).memory_budget_bytes or {}) == {
        0: 2 * 2**30,
        1: 1_500_000_000,
    }
    assert parse_size(4096) == 4096 and parse_size("512MiB") == 512 * 2**20
    with pytest.raises(PlacementError, match=r"cannot read size '2 GiBs'"):
        parse_size("2 GiBs")
    with pytest.raises(PlacementError, match=r"a size must be positive, got 0"):
        parse_size(0)


def test_unknown_file_keys_are_named(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match=r"unknown placement keys \['nodez', 'tp'\]"):
        Placement.from_dict({"ranks": 1, "nodez": {}, "tp": {}})
    path = tmp_path / "bad.yaml"
    path.write_text("ranks: 1\nnodez: {denoiser: [0]}\n")
    with pytest.raises(PlacementError, match=rf"{re.escape(str(path))}: unknown placement keys"):
        Placement.from_file(path)


def test_file_value_types_are_checked() -> None:
    with pytest.raises(PlacementError, match=r"ranks: expected an int, got '2'"):
        Placement.from_dict({"ranks": "2"})
    with pytest.raises(PlacementError, match=r"nodes\['denoiser'\]: expected a list, got 0"):
        Placement.from_dict({"ranks": 1, "nodes": {"denoiser": 0}})
    with pytest.raises(PlacementError, match=r"a placement needs 'ranks'"):
        Placement.from_dict({"nodes": {}})
    with pytest.raises(TypeCheckError):
        Placement(ranks="2")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": 0}, r"ranks must be a positive int, got 0"),
        (
            {"ranks": 2, "rules": {"denoiser": [2]}},
            r"rule 'denoiser' names rank 2, but the placement has ranks 0\.\.1 \(ranks: 2\)",
        ),
        ({"ranks": 2, "rules": {"denoiser": []}}, r"rule 'denoiser' has an empty rank list"),
        ({"ranks": 2, "rules": {"denoiser": [1, 1]}}, r"rule 'denoiser' lists a rank twice"),
        (
            {"ranks": 3, "rules": {"denoiser": [0, 1, 2]}, "tensor_parallel": {"denoiser": 2}},
            r"tensor_parallel\['denoiser'\] = 2 does not divide the 3 ranks of rule 'denoiser'",
        ),
        (
            {"ranks": 2, "tensor_parallel": {"denoiser": 2}},
            r"tensor_parallel names 'denoiser', which has no rank rule; add 'denoiser: \[ranks\]'",
        ),
        (
            {"ranks": 4, "rules": {"denoiser": [0, 1, 2, 3]}, "replicas": {"denoiser": 3}},
            r"replicas\['denoiser'\] = 3 with tensor_parallel 1 needs 3 ranks, but rule "
            r"'denoiser' has 4",
        ),
        ({"ranks": 1, "rules": {"generate:": [0]}}, r"nodes key 'generate:' is malformed"),
        (
            {"ranks": 1, "concurrent": [["text_encoder", "image_encoder"]]},
            r"'text_encoder' is not a 'walk:node' key",
        ),
        (
            {"ranks": 1, "concurrent": [["generate:text_encoder", "edit:text_encoder_1"]]},
            r"must name two or more distinct nodes of one walk",
        ),
        ({"ranks": 2, "memory_budget_bytes": {2: 10}}, r"memory_budget\[2\] names rank 2"),
    ],
)
def test_placement_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        Placement(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"denoiserr": [0]}, r"rule 'denoiserr': unknown component 'denoiserr'; did you mean "),
        (
            {"generat:euler_step/denoiser": [0]},
            r"unknown walk 'generat'; did you mean 'generate'\?",
        ),
        (
            {"generate:denoiser": [0]},
            r"walk 'generate' has no node 'denoiser'; did you mean 'euler_step/denoiser'",
        ),
        ({"generate:euler_step": [0]}, r"names a loop; loops are not placed, the nodes of"),
        ({"generate:euler_step/add": [0]}, r"names a glue op; glue runs with the component"),
    ],
)
def test_unknown_rule_targets(
    cfg: CapturedModel, rules: dict[str, list[int]], message: str
) -> None:
    with pytest.raises(PlacementError, match=message):
        resolve(Placement(ranks=1, rules=rules), cfg)


def test_concurrent_nodes_must_be_one_parallel_group(cfg: CapturedModel) -> None:
    placement = Placement(ranks=2, concurrent=[["generate:text_encoder", "generate:decoder"]])
    with pytest.raises(
        PlacementError, match=r"not branches of one Parallel group.*Parallel groups"
    ):
        resolve(placement, cfg)
    placement = Placement(ranks=2, concurrent=[["generate:text_encoder", "generate:nope"]])
    with pytest.raises(PlacementError, match=r"concurrent 'generate:nope': walk 'generate' has"):
        resolve(placement, cfg)


def test_concurrent_nodes_on_one_rank_warn(cfg: CapturedModel) -> None:
    shipped = Placement.from_file(example_placement(CFG, 2))  # denoiser_1, _2 both on rank 1
    pair = ["generate:euler_step/denoiser_1", "generate:euler_step/denoiser_2"]
    placement = dataclasses.replace(shipped, concurrent=[pair])
    message = (
        "concurrent nodes generate:euler_step/denoiser_1 and generate:euler_step/denoiser_2 are "
        "both placed on rank(s) [1], so they cannot run concurrently"
    )
    with pytest.warns(PlacementWarning, match=re.escape(message)):
        resolved = resolve(placement, cfg)
    assert len(resolved.warnings) == 1 and resolved.warnings[0].startswith(message)


# ------------------------------------------------------------------------------ resolution


def test_cfg_two_ranks_every_node(cfg: CapturedModel) -> None:
    resolved = resolve_quietly(Placement.from_file(example_placement(CFG, 2)), cfg)
    guidance = ["sub", "mul", "add", "sub_1", "mul_1", "add_1", "sub_2", "mul_2", "add_2"]
    common = {
        "text_encoder": 0,
        "full_like": 0,  # -> text_encoder_1
        "text_encoder_1": 0,
        "euler_step/denoiser": 0,
        "euler_step/denoiser_1": 1,
        "euler_step/denoiser_2": 1,
        # guidance glue: its result is carried into the next step's first branch
        **{f"euler_step/{g}": 0 for g in guidance},
        "decoder": 0,
    }
    expected = {
        # the null image context feeds the text-conditioned branch first
        "generate": {**common, "getattr_1": 0, "getitem": 0, "expand": 0},
        # in edit only the unconditioned branch reads the null image context
        "edit": {**common, "image_encoder": 1, "getattr_1": 1, "getitem": 1, "expand": 1},
    }
    for walk, nodes in expected.items():
        placed = resolved.walks[walk]
        assert set(placed) == set(nodes) == set(op_names(cfg.walk(walk)))
        assert {name: p.ranks for name, p in placed.items()} == {
            name: (rank,) for name, rank in nodes.items()
        }
    add_2 = resolved.node("generate", "euler_step/add_2")
    assert (add_2.kind, add_2.source, add_2.anchor) == ("glue", "consumer", "euler_step/denoiser")
    branch = resolved.node("edit", "euler_step/denoiser_1")
    assert (branch.source, branch.anchor) == ("node_rule", "edit:euler_step/denoiser_1")
    assert resolved.node("edit", "image_encoder").source == "component_rule"


def test_glue_follows_a_moved_consumer(cfg: CapturedModel) -> None:
    placement = Placement(ranks=2, rules={"denoiser": [1], "generate:euler_step/denoiser_2": [0]})
    resolved = resolve_quietly(placement, cfg)
    assert resolved.ranks("generate", "euler_step/add_2") == (1,)  # next step's denoiser
    assert resolved.ranks("generate", "expand") == (1,)


def test_speech_glue_unpacks_with_its_producer(models: dict[str, CapturedModel]) -> None:
    resolved = resolve_quietly(Placement.from_file(example_placement(SPEECH, 2)), models[SPEECH])
    hidden = resolved.node("speak", "think_step/getitem_1")  # thinker's hidden, streamed on
    assert (hidden.ranks, hidden.source) == ((0,), "unpacks")
    cat = resolved.node("speak", "cat_1")  # text tokens: a walk output, no consumer
    assert (cat.ranks, cat.source, cat.anchor) == ((0,), "producer", "think_step/thinker")
    assert resolved.ranks("speak", "new_full") == (1,)  # the talker's first code
    assert resolved.ranks("speak", "decode_chunk/mul") == (1,)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_resolve_gives_every_node_one_rank_list(
    models: dict[str, CapturedModel], data: st.DataObject
) -> None:
    captured = models[data.draw(st.sampled_from(sorted(models)))]
    ranks = data.draw(st.integers(1, 4))
    node_keys = [
        f"{w}:{n.name}"
        for w, walk in captured.walks.items()
        for n in dataflow.iter_nodes(walk.body)
        if dataflow.is_component(n)
    ]
    keys = data.draw(
        st.lists(st.sampled_from([*captured.graph.components, *node_keys]), unique=True)
    )
    rank_list = st.lists(st.integers(0, ranks - 1), min_size=1, max_size=ranks, unique=True)
    rules = {key: data.draw(rank_list) for key in keys}
    degrees = {
        key: data.draw(st.sampled_from([d for d in range(1, len(r) + 1) if len(r) % d == 0]))
        for key, r in rules.items()
    }
    placement = Placement(ranks=ranks, rules=rules, tensor_parallel=degrees)
    resolved = resolve_quietly(placement, captured)
    for name, walk in captured.walks.items():
        placed = resolved.walks[name]
        assert list(placed) == op_names(walk)
        for node, p in placed.items():
            assert p.ranks and len(set(p.ranks)) == len(p.ranks)
            assert all(0 <= r < ranks for r in p.ranks)
            if p.kind == "component":
                rule = rules.get(f"{name}:{node}", rules.get(p.target, [0]))
                assert p.ranks == tuple(rule)


# ------------------------------------------------------------------------------ memory


def test_memory_weights_match_hand_computed_bytes(cfg: CapturedModel) -> None:
    # decoder: Conv2d(4 -> 32, 3x3) + bias, Conv2d(32 -> 3, 3x3) + bias
    decoder_bytes = (4 * 32 * 9 + 32 + 32 * 3 * 9 + 3) * FLOAT32  # 2051 params
    resolved = resolve_quietly(Placement(ranks=2, rules={"decoder": [1]}), cfg)
    limits = MemoryLimits(workspace_fraction=0.25)
    rank1 = estimate_memory(resolved, cfg, limits)[1]
    assert (rank1.weights, rank1.kv_pool, rank1.stream_buffers) == (decoder_bytes, 0, 0)
    assert rank1.workspace == math.ceil(decoder_bytes * 0.25)
    assert rank1.total == decoder_bytes + math.ceil(decoder_bytes * 0.25)

    # the denoiser is called six times (three branches, two walks) but counted once per rank
    shipped = resolve_quietly(Placement.from_file(example_placement(CFG, 2)), cfg)
    estimates = estimate_memory(shipped, cfg, limits)
    denoiser_bytes = (
        sum(p.numel() for p in cfg.model.get_submodule("denoiser").parameters()) * FLOAT32
    )
    for rank in (0, 1):
        assert dict(estimates[rank].contributors)["weights denoiser"] == denoiser_bytes

    halved = Placement(ranks=2, rules={"decoder": [0, 1]}, tensor_parallel={"decoder": 2})
    rank1 = estimate_memory(resolve_quietly(halved, cfg), cfg, limits)[1]
    assert rank1.weights == decoder_bytes // 2


def test_memory_kv_pool_and_stream_buffers(models: dict[str, CapturedModel]) -> None:
    limits = MemoryLimits(max_len=100, max_concurrent_requests=3, workspace_fraction=0.0)
    text = models[TEXT]
    (rank0,) = estimate_memory(resolve_quietly(Placement.default(), text), text, limits).values()
    # decode loop carries k and v: [layers=2, B=1, heads=4, T=None -> 100, head_dim=12] float32
    assert rank0.kv_pool == 2 * (2 * 1 * 4 * 100 * 12) * FLOAT32 * 3

    speech = models[SPEECH]
    resolved = resolve_quietly(Placement.from_file(example_placement(SPEECH, 2)), speech)
    estimates = estimate_memory(resolved, speech, limits)
    # thinker hidden [1, 1, 48] float32 per step, codes [1, 1] int64 per step; trips <= max_len
    hidden, codes = 48 * FLOAT32 * 100 * 3, 1 * 8 * 100 * 3
    assert (estimates[0].stream_buffers, estimates[1].stream_buffers) == (0, hidden + codes)
    contributors = dict(estimates[1].contributors)
    assert contributors["stream stream.talk_step"] == hidden
    assert contributors["KV pool talker"] == 2 * (2 * 1 * 4 * 100 * 8) * FLOAT32 * 3
    assert "KV pool thinker" not in contributors


def test_over_budget_names_rank_total_budget_and_contributors(cfg: CapturedModel) -> None:
    placement = Placement(ranks=2, rules={"decoder": [1]}, memory_budget_bytes={1: 4096})
    resolved = resolve_quietly(placement, cfg)
    message = (
        "rank 1 needs an estimated 8.8 KiB (9025 bytes) but its memory budget is 4.0 KiB "
        "(4096 bytes); the biggest contributor is weights decoder (8.0 KiB, 90% of the total): "
        "shard its component over more ranks (a higher tensor_parallel), move it to a rank with "
        "room, or raise the budget. Largest contributors: weights decoder 8.0 KiB, workspace 821 B"
    )
    with pytest.raises(PlacementError, match=re.escape(message)):
        estimate_memory(resolved, cfg)
    estimates = estimate_memory(resolved, cfg, check_budget=False)
    assert estimates[1].over_budget and not estimates[0].over_budget
    assert "4.0 KiB OVER" in format_memory(estimates)


# ------------------------------------------------------------------------------ shipped files


def test_shipped_placements_resolve_and_fit(models: dict[str, CapturedModel]) -> None:
    shipped = {(name, 1) for name in EXAMPLES} | {(CFG, 2), (SPEECH, 2)}
    for name, ranks in shipped:
        placement = Placement.from_file(example_placement(name, ranks))
        assert placement.ranks == ranks
        resolved = resolve_quietly(placement, models[name])
        table = format_memory(estimate_memory(resolved, models[name]))
        assert len(table.splitlines()) == ranks + 1
    with pytest.raises(ValueError, match=r"no 3-rank placement is shipped for example-text"):
        example_placement(TEXT, 3)


def test_shipped_files_are_plain_yaml() -> None:
    path = example_placement(CFG, 2)
    data = yaml.safe_load(path.read_text())
    assert data["ranks"] == 2 and len(data["concurrent"]) == 5
