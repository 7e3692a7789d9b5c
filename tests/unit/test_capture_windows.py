"""Streams whose chunk policy needs more items than capture's short sample run makes: the
sample run (loops cut to two iterations) lets each producer run on until its consumer gets
its chunks (``interpret.stream_demands``), so a ``SlidingWindow(28, 7)`` or ``LeftContext``
consumer with the default end rule captures, chained streams included; a sample that is too
short for one chunk is a capture error naming the consumer's line. And which walk outputs
stream (``loopsem.streamed_outputs``, the last line of the text form)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.capture import (
    CaptureError,
    FixedChunk,
    LeftContext,
    SlidingWindow,
    component,
    loop,
    stream,
    walk,
)
from walkserve.capture.interpret import items_for_chunks, stream_demands
from walkserve.capture.loopsem import streamed_outputs
from walkserve.capture.render import render_text
from walkserve.lowering.lower import lower
from walkserve.runtime.local import run_local
from walkserve.testing import assert_outputs_match


@component
class CodesLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.out = nn.Linear(8, 32)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tok))


@component
class Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(32, 3)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed(codes).flatten(1))  # [B, 3 * L]


class Speech(nn.Module):
    """codes LM -> (optionally a relay loop over single codes) -> windowed codec."""

    def __init__(self, policy: object, relay: bool = False) -> None:
        super().__init__()
        self.lm = CodesLM()
        self.codec = Codec()
        self.policy = policy
        self.relay = relay

    @walk
    def speak(self, tok, n: int):
        codes = []
        for _ in range(n):
            tok = self.lm_step(tok)
            codes.append(tok)
        seq = torch.cat(codes, dim=1)  # [B, n]
        if self.relay:
            relayed = []
            for c in stream(seq, FixedChunk(1), dim=1):
                relayed.append(self.relay_step(c))
            seq = torch.cat(relayed, dim=1)
        pieces = []
        for chunk in stream(seq, self.policy, dim=1):
            pieces.append(self.decode(chunk[0] if isinstance(chunk, tuple) else chunk))
        return {"codes": seq, "wav": torch.cat(pieces, dim=1), "loud": torch.cat(pieces, 1) * 2}

    @loop
    def lm_step(self, tok):
        return self.lm(tok)[:, -1].argmax(-1, keepdim=True)

    @loop
    def relay_step(self, c):
        return (c + 1) % 32

    @loop
    def decode(self, chunk):
        return self.codec(chunk)[:, :6]


SAMPLE = {"tok": torch.tensor([[3], [5]]), "n": 40}


@pytest.mark.parametrize(
    ("policy", "relay"),
    [
        (SlidingWindow(28, 7), False),  # default end rule: drop
        (SlidingWindow(28, 7), True),  # behind a relay loop over a stream of its own
        (LeftContext(4, 25, end="drop"), False),
        (LeftContext(2, 3, first=30, end="drop"), False),
        (FixedChunk(33, end="drop"), False),
    ],
    ids=["sliding", "sliding-chained", "left-context-drop", "left-context-first", "fixed-drop"],
)
def test_wide_windows_capture_and_equal_eager(policy: object, relay: bool) -> None:
    model = Speech(policy, relay)
    captured = capture.trace(model, SAMPLE)
    for n in (40, 57):
        inputs = dict(SAMPLE, n=n)
        with torch.no_grad():
            want = model.speak(**inputs)
        assert_outputs_match(captured.run(inputs), want, bitwise=True)
    plan = lower(captured, SAMPLE, check_capture=False)  # lowering's sample runs too
    result = run_local(captured, plan, {"a": SAMPLE, "b": dict(SAMPLE, n=45)})
    assert result.failed == {}
    with torch.no_grad():
        assert_outputs_match(result.outputs["b"], model.speak(**dict(SAMPLE, n=45)))


def test_demands_propagate_through_chained_streams() -> None:
    captured = capture.trace(Speech(SlidingWindow(28, 7), relay=True), SAMPLE)
    walk_ir = captured.walk("speak")
    demands = stream_demands(walk_ir, 2)
    window = next(e for e in walk_ir.streams if e.consumer == "decode")
    assert items_for_chunks(window, 2) == 35  # two windows: 28 + 7
    assert demands["relay_step"] == {"relay_step.out0.all": 35}  # one item per iteration
    assert demands["lm_step"] == {"lm_step.tok.all": 35}  # FixedChunk(1): one chunk per item


def test_a_sample_too_short_for_one_chunk_names_the_consumer() -> None:
    with pytest.raises(CaptureError) as info:
        capture.trace(Speech(SlidingWindow(28, 7)), dict(SAMPLE, n=20))
    err = info.value
    assert err.rule == "stream-sample"
    assert "has 20 items" in str(err) and "it needs 28" in str(err) and "end='flush'" in str(err)
    assert err.source is not None and "test_capture_windows.py" in err.source


def test_which_outputs_stream() -> None:
    captured = capture.trace(Speech(SlidingWindow(28, 7)), SAMPLE)
    walk_ir = captured.walk("speak")
    # codes and wav are accumulated channels themselves; loud is glue over wav's pieces.
    assert streamed_outputs(walk_ir) == {"codes": "lm_step", "wav": "decode"}
    text = render_text(captured.graph, "speak")
    assert text.rstrip().endswith(
        "streamed: codes (loop lm_step), wav (loop decode); at the end: loud"
    )
