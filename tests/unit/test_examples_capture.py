"""Captured structure of every example model, and the reference interpreter against eager:
bit for bit, on the sample inputs and on inputs of other shapes and lengths."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.adapters.examples import EXAMPLES, build_example
from walkserve.capture import ir
from walkserve.capture.api import walk_specs
from walkserve.capture.sections import Parallel, parallel_groups, sections

CAPTURED: dict[str, tuple[capture.CapturedModel, nn.Module, dict[str, Any]]] = {}


def captured(name: str) -> tuple[capture.CapturedModel, nn.Module, dict[str, Any]]:
    if name not in CAPTURED:
        model, sample = build_example(name)
        CAPTURED[name] = (capture.trace(model, sample), model, sample)
    return CAPTURED[name]


def eager(
    model: nn.Module, cap: capture.CapturedModel, walk: str, inputs: dict[str, Any]
) -> dict[str, Any]:
    """The walk chain run by calling the model's own methods."""
    specs = walk_specs(model)
    state, client = dict(inputs), {}
    current: str | None = walk
    with torch.no_grad():
        while current is not None:
            method, spec = specs[current]
            fn = getattr(model, method)
            out = fn(**{p: state[p] for p in inspect.signature(fn).parameters})
            state.update(out)
            client.update({k: v for k, v in out.items() if k not in spec.state})
            current = cap.next_walk(state, current, out)
    return client


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), f"{key} differs"


def only(block: ir.Block, kind: type) -> list[Any]:
    return [n for n in block.nodes if isinstance(n, kind)]


def test_cfg_image_structure() -> None:
    cap, _, _ = captured("example-cfg-image")
    for walk in ("generate", "edit"):
        (loop,) = only(cap.walk(walk).body, ir.LoopNode)
        assert not loop.dynamic and loop.trips == ir.FixedTrips(19)  # 19 updates, 20 grid points
        roles = {p.name.split("/")[-1]: p.role for p in loop.params}
        assert isinstance(roles["z"], ir.Carried)  # the latent is carried
        assert [n for n, r in roles.items() if isinstance(r, ir.Carried)] == ["z"]
        steps = {n: r.source for n, r in roles.items() if isinstance(r, ir.PerStep)}
        assert set(steps) == {"t", "t_next"}
        assert (steps["t"].start, steps["t_next"].start) == (0, 1)  # sigmas[k], sigmas[k + 1]
        denoisers = [
            n.name for n in loop.body.nodes if isinstance(n, ir.Op) and n.target == "denoiser"
        ]
        assert len(denoisers) == 3
        assert parallel_groups(loop.body) == [denoisers]
        tree = sections(loop.body)
        assert any(isinstance(item, Parallel) and len(item.items) == 3 for item in tree.items)
    edit_components = {
        n.target
        for n in cap.walk("edit").body.nodes
        if isinstance(n, ir.Op) and n.kind == "component"
    }
    assert {"text_encoder", "image_encoder"} <= edit_components


def test_speech_structure() -> None:
    cap, _, _ = captured("example-speech")
    walk = cap.walk("speak")
    policies = {s.consumer: s.policy for s in walk.streams}
    assert policies == {
        "talk_step": {"kind": "fixed", "size": 1, "end": "flush", "pad_value": 0.0},
        "decode_chunk": {
            "kind": "left_context",
            "context": 2,
            "chunk": 3,
            "end": "flush",
            "pad_value": 0.0,
        },
    }
    loops = {n.name: n for n in only(walk.body, ir.LoopNode)}
    assert loops["think_step"].dynamic and loops["think_step"].max_iters == "max_new_tokens"
    assert loops["talk_step"].trips == ir.StreamTrips("stream.talk_step")
    assert loops["decode_chunk"].trips == ir.StreamTrips("stream.decode_chunk")
    sources = {s.consumer: s.source for s in walk.streams}
    assert sources["talk_step"] in loops["think_step"].accumulated  # the thinker's hidden states
    assert sources["decode_chunk"] in loops["talk_step"].accumulated  # the talker's codes


@pytest.mark.parametrize(
    "name,walk,loop_name,bound",
    [
        ("example-world", "rollout", "step", "horizon"),
        ("example-text", "decode", "decode_step", "max_new_tokens"),
    ],
)
def test_dynamic_loops_have_max_iters(name: str, walk: str, loop_name: str, bound: str) -> None:
    cap, _, _ = captured(name)
    (loop,) = only(cap.walk(walk).body, ir.LoopNode)
    assert loop.name == loop_name and loop.dynamic and loop.stop is not None
    assert loop.max_iters == bound
    assert {"k_cache", "v_cache"} <= {
        p.name.split("/")[-1] for p in loop.params if isinstance(p.role, ir.Carried)
    }


def test_text_walk_transition() -> None:
    cap, _, _ = captured("example-text")
    assert cap.walk("prefill").next == "decode" and cap.walk("prefill").state == [
        "k_cache",
        "v_cache",
    ]
    assert cap.graph.entry_walks() == ["prefill"]


def _variants(name: str, sample: dict[str, Any]) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(7)
    out = [dict(sample)]
    if name == "example-cfg-image":
        for length in (3, 11):
            out.append(
                {
                    **sample,
                    "prompt_ids": torch.randint(1, 64, (1, length), generator=g),
                    "noise": torch.randn(sample["noise"].shape, generator=g),
                }
            )
    elif name == "example-speech":
        out.append({**sample, "prompt_ids": sample["prompt_ids"][:, :3], "max_new_tokens": 2})
        out.append({**sample, "max_new_tokens": 30})
    elif name == "example-world":
        out.append(
            {**sample, "horizon": 2, "frames": torch.randn(sample["frames"].shape, generator=g)}
        )
        out.append({**sample, "frames": sample["frames"][:, :1]})
    elif name == "example-text":
        out.append({**sample, "prompt_ids": sample["prompt_ids"][:, :2], "max_new_tokens": 5})
        out.append({**sample, "max_new_tokens": 1})
    return out


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_interpreter_equals_eager_bit_for_bit(name: str) -> None:
    cap, model, sample = captured(name)
    for inputs in _variants(name, sample):
        for walk in cap.graph.entry_walks():
            assert_bitwise(cap.run(inputs, walk=walk), eager(model, cap, walk, inputs))


def test_interpreter_does_not_call_walk_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    cap, model, sample = captured("example-speech")
    expected = eager(model, cap, "speak", sample)
    calls: list[str] = []
    for attr in ("speak", "think_step", "talk_step", "decode_chunk"):
        original: Callable[..., Any] = getattr(type(model), attr)
        monkeypatch.setattr(
            type(model), attr, lambda *a, _n=attr, _f=original, **k: calls.append(_n) or _f(*a, **k)
        )
    assert_bitwise(cap.run(sample, walk="speak"), expected)
    assert calls == []


def test_capture_runs_components_only_a_few_times() -> None:
    # Tracing never runs components; recording shapes runs each loop for two iterations.
    model, sample = build_example("example-cfg-image")
    calls = {"denoiser": 0}
    model.denoiser.register_forward_hook(
        lambda *_: calls.__setitem__("denoiser", calls["denoiser"] + 1)
    )
    capture.trace(model, sample)
    assert calls["denoiser"] == 2 * 3 * 2  # 2 walks x 3 branches x 2 recorded iterations (not 19)
