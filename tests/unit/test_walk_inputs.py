"""What a valid walk input is (``ir.InputSpec``, recorded at capture) and the check before
admission (``capture.check_inputs``, called by ``Conductor.submit``): every rule refuses a bad
value with an ``InputError`` (a ``ValueError``) naming the input and the rule, and accepts the
values the walk serves correctly (checked against eager where a walk runs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from walkserve import capture
from walkserve.capture import (
    CaptureError,
    Dim,
    Input,
    InputError,
    check_inputs,
    component,
    ir,
    iterations,
    loop,
    walk,
)
from walkserve.capture.serialize import from_json, to_json
from walkserve.lowering.lower import lower
from walkserve.runtime.conductor import Conductor

VOCAB = 12


@component
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(VOCAB, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).mean(dim=1)  # [B, 4]


@component
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.cell = Cell()

    @walk(inputs={"frames": Input(dims={1: Dim(1, 6)}), "limit": Input(min=1, max=50)})
    def run(self, ids, frames, scale: float, steps: int, limit: int, flag: bool = False):
        # ids: [B, T] token ids; frames: [B, F, 4] floats, F in [1, 6]
        h = self.embed(ids) + frames.mean(dim=1) * scale
        outs = []
        for _ in iterations(steps):
            h, done = self.step(h)
            outs.append(h)
            if done:
                break
        return {"h": torch.cat(outs, dim=0)}

    @loop(max_iters="limit")
    def step(self, h):
        h = self.cell(h)
        return h, (h.sum() > 1e9).all()

    @walk(inputs={"ids": Input(vocab=5, dims={0: Dim(max=2)})})
    def declared(self, ids):
        return {"h": self.cell(ids.float().repeat(1, 4)[:, :4])}


SAMPLE: dict[str, Any] = {
    "ids": torch.tensor([[1, 2, 3]]),
    "frames": torch.randn(1, 2, 4),
    "scale": 0.5,
    "steps": 3,
    "limit": 10,
}


@pytest.fixture(scope="module")
def captured() -> capture.CapturedModel:
    return capture.trace(Model(), SAMPLE, walks=["run"])


def spec(captured: capture.CapturedModel, name: str) -> ir.InputSpec:
    (found,) = [i.spec for i in captured.walk("run").inputs if i.name == name]
    assert found is not None
    return found


def test_specs_recorded_at_capture(captured: capture.CapturedModel) -> None:
    assert spec(captured, "ids") == ir.InputSpec(
        "tensor",
        "int64",
        [ir.DimRange(1, None), ir.DimRange(1, None)],  # ids: a sequence of any length
        0,
        VOCAB - 1,
        f"the vocabulary of embed ({VOCAB} ids)",  # found: the embedding reads it as it is
    )
    assert spec(captured, "frames").shape == [ir.DimRange(1, None), ir.DimRange(1, 6), 4]
    assert spec(captured, "frames").finite
    assert spec(captured, "steps") == ir.InputSpec(
        "int", min=1, max=16777216, bounds="the trip count of loop step"
    )
    assert spec(captured, "limit") == ir.InputSpec("int", min=1, max=50, bounds="declared")
    assert spec(captured, "scale") == ir.InputSpec("float", finite=True)
    assert spec(captured, "flag") == ir.InputSpec("bool")
    assert from_json(to_json(captured.graph)).walks["run"].inputs == captured.walk("run").inputs


GOOD: list[dict[str, Any]] = [
    {},
    {"ids": torch.tensor([[0, 11, 4, 4, 9]]), "frames": torch.randn(1, 6, 4)},  # longer
    {"ids": torch.zeros(3, 2, dtype=torch.long), "frames": torch.randn(3, 1, 4)},  # batch 3
    {"scale": 2, "flag": True},  # an int where a float goes
    {"steps": torch.tensor(4)},  # a one-element tensor as a loop bound
]


@pytest.mark.parametrize("change", GOOD, ids=range(len(GOOD)))
def test_valid_requests_pass_and_run_as_eager(
    captured: capture.CapturedModel, change: dict[str, Any]
) -> None:
    inputs = dict(SAMPLE, **change)
    check_inputs(captured.walk("run"), inputs)
    want = Model().run(**inputs)["h"]
    assert torch.equal(captured.run(inputs, "run")["h"], want)


BAD: dict[str, tuple[dict[str, Any], str, str, str]] = {
    "out-of-vocabulary id": (
        {"ids": torch.tensor([[1, VOCAB]])},
        "ids",
        "vocabulary",
        f"its largest value must be in [0, {VOCAB - 1}] (the vocabulary of embed",
    ),
    "negative id": (
        {"ids": torch.tensor([[-1, 2]])},
        "ids",
        "vocabulary",
        "its smallest value must be in",
    ),
    "loop bound of -1": ({"steps": -1}, "steps", "range", "must be in [1, 16777216]"),
    "max_iters of 0": ({"limit": 0}, "limit", "range", "must be in [1, 50] (declared)"),
    "loop bound too large": ({"steps": 10**8}, "steps", "range", "must be in [1, 16777216]"),
    "bool for an int": ({"steps": True}, "steps", "kind", "must be an int"),
    "int beyond 64 bits": ({"limit": 2**64}, "limit", "range", "must be in [1, 50]"),
    "float for an int": ({"steps": 2.0}, "steps", "kind", "must be an int"),
    "string for a float": ({"scale": "big"}, "scale", "kind", "must be a float"),
    "NaN scalar": ({"scale": float("nan")}, "scale", "finite", "finite number"),
    "NaN in a tensor": (
        {"frames": torch.tensor([[[0.0, float("nan"), 0.0, 0.0]]])},
        "frames",
        "finite",
        "finite numbers only",
    ),
    "inf in a tensor": (
        {"frames": torch.full((1, 2, 4), float("inf"))},
        "frames",
        "finite",
        "finite numbers only",
    ),
    "wrong dtype": ({"ids": torch.tensor([[1.0, 2.0]])}, "ids", "dtype", "must be int64"),
    "wrong rank": ({"frames": torch.randn(1, 4)}, "frames", "rank", "must have 3 dimensions"),
    "wrong fixed size": (
        {"frames": torch.randn(1, 2, 5)},
        "frames",
        "shape",
        "dimension 2 must be 4",
    ),
    "dynamic size out of range": (
        {"frames": torch.randn(1, 7, 4)},
        "frames",
        "shape",
        "dimension 1 must be in [1, 6]",
    ),
    "empty batch": (
        {"ids": torch.zeros(0, 2, dtype=torch.long)},
        "ids",
        "batch",
        "the batch dimension 0 must be in [1, any]",
    ),
    "not a tensor": ({"frames": [[0.0] * 4]}, "frames", "kind", "must be a tensor"),
    "bool for a bool is fine, an int is not": ({"flag": 1}, "flag", "kind", "must be a bool"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_requests_name_the_input_and_rule(
    captured: capture.CapturedModel, case: str
) -> None:
    change, name, rule, words = BAD[case]
    with pytest.raises(InputError) as info:
        check_inputs(captured.walk("run"), dict(SAMPLE, **change))
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.input, err.rule) == (name, rule), str(err)
    assert words in str(err) and f"input {name!r}" in str(err), str(err)


@settings(max_examples=60, deadline=None)
@given(
    frames=st.lists(
        st.sampled_from(
            [0.0, -1.5, 3.0e38, -3.0e38, 1e-45, float("nan"), float("inf"), -float("inf")]
        ),
        min_size=8,
        max_size=8,
    ),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    ids=st.lists(st.integers(-3, VOCAB + 2), min_size=1, max_size=6),
)
def test_the_finite_and_range_rules_refuse_exactly_what_they_say(
    captured: capture.CapturedModel, frames: list[float], dtype: torch.dtype, ids: list[int]
) -> None:
    """Both rules read one reduction (the smallest and largest values): a tensor is refused as
    not finite exactly when one of its numbers is NaN or infinite (as ``torch.isfinite`` says,
    in its own dtype: 3e38 overflows float16), and ids exactly when one is outside the
    vocabulary; a valid pair passes."""
    values = torch.tensor(frames).to(dtype).reshape(1, 2, 4)
    finite = bool(torch.isfinite(values).all())
    try:
        check_inputs(captured.walk("run"), dict(SAMPLE, frames=values.float()))
    except InputError as e:
        assert (e.input, e.rule) == ("frames", "finite") and not finite, str(e)
    else:
        assert finite
    try:
        check_inputs(captured.walk("run"), dict(SAMPLE, ids=torch.tensor([ids])))
    except InputError as e:
        assert (e.input, e.rule) == ("ids", "vocabulary"), str(e)
        assert min(ids) < 0 or max(ids) >= VOCAB
    else:
        assert min(ids) >= 0 and max(ids) < VOCAB


def test_declared_vocabulary_and_batch_range() -> None:
    model = Model()
    captured = capture.trace(model, {"ids": torch.tensor([[1, 2]])}, walks=["declared"])
    w = captured.walk("declared")
    check_inputs(w, {"ids": torch.tensor([[4, 0, 3], [1, 1, 1]])})
    with pytest.raises(InputError, match=r"the declared vocabulary \(5 ids\).*rule: vocabulary"):
        check_inputs(w, {"ids": torch.tensor([[5]])})
    with pytest.raises(InputError, match=r"batch dimension 0 must be in \[1, 2\].*rule: batch"):
        check_inputs(w, {"ids": torch.zeros(3, 1, dtype=torch.long)})


def test_conductor_refuses_before_admission(captured: capture.CapturedModel) -> None:
    plan = lower(captured, SAMPLE, check_capture=False)
    conductor = Conductor(captured, plan)
    with pytest.raises(InputError, match=r"input 'ids'.*rule: vocabulary"):
        conductor.submit("bad", dict(SAMPLE, ids=torch.tensor([[99]])), "run")
    with pytest.raises(InputError, match=r"input 'steps'.*rule: range"):
        conductor.submit("bad", dict(SAMPLE, steps=-1), "run")
    assert conductor.idle() and conductor.stats().live_values == 0
    conductor.submit("good", SAMPLE, "run")  # the refused id was not taken


def wrong(decl: dict[str, Input]) -> nn.Module:
    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = Cell()

        @walk(inputs=decl)
        def run(self, x):
            return {"y": self.cell(x)}

    return Wrong()


@pytest.mark.parametrize(
    ("decl", "words"),
    [
        ({"nope": Input()}, "declares ['nope'], which are not its parameters"),
        ({"x": Input(dims={3: "dynamic"})}, "declares dims [3] of 'x', which has 2 dimensions"),
        ({"x": Input(min=5.0)}, "the sample request breaks the walk's input rules"),
    ],
)
def test_bad_declarations_are_capture_errors(decl: dict[str, Input], words: str) -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(wrong(decl), {"x": torch.zeros(1, 4)})
    assert info.value.rule == "walk-inputs" and words in str(info.value), str(info.value)


def test_declaration_values_are_checked() -> None:
    with pytest.raises(ValueError, match="Dim max must be an int >= min"):
        Dim(3, 2)
    with pytest.raises(ValueError, match="vocab or min/max"):
        Input(vocab=3, max=2)
    with pytest.raises(ValueError, match=r"must be a Dim, 'dynamic' or"):
        Input(dims={1: "sometimes"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"must be a capture\.Input"):
        walk(inputs={"x": (1, 2)})  # type: ignore[dict-item]
    assert Input(vocab=lambda m: m.n).resolve(type("M", (), {"n": 7})()).vocab == 7


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    values=st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=16),
            st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.5]),
            st.integers(-1000, 1000),
        ),
        min_size=1,
        max_size=40,
    ),
    large=st.booleans(),
    shape=st.sampled_from([(-1,), (1, -1), (-1, 1), (1, -1, 1), ()]),
)
def test_extremes_read_small_tensors_as_a_reduction_would(
    dtype: torch.dtype, values: list[Any], large: bool, shape: tuple[int, ...]
) -> None:
    """A small tensor's smallest and largest values, read as Python numbers, are what the
    reduction gives (both NaN where one is NaN): the finite and range rules see the same."""
    import math

    from walkserve.capture import inputs

    if not dtype.is_floating_point:
        values = [int(v) if math.isfinite(v) else 0 for v in values]
    t = torch.tensor(values).to(dtype)
    if large:  # past the small tensors' size: the reduction itself
        t = t.repeat(inputs.SMALL_TENSOR // len(values) + 1)
    t = t[0] if shape == () else t.reshape(shape)  # (): a 0-dim tensor, its first value
    low, high = inputs._extremes(t)
    smallest, largest = torch.aminmax(t)
    want = (smallest.item(), largest.item())
    if any(isinstance(w, float) and math.isnan(w) for w in want):
        assert math.isnan(low) and math.isnan(high)
    else:
        assert (low, high) == want
