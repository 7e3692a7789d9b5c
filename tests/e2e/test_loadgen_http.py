"""The load generator against a real ``walkserve serve`` subprocess of the default model: a
few text, speech, image and walk requests in a closed and an open loop. What it recorded (token
ids, audio duration) is checked against the same requests run through the reference
interpreter."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed

from benchmarks import loadgen
from walkserve.adapters import default
from walkserve.adapters.hf_causal_lm import sample_request
from walkserve.adapters.registry import capture_model
from walkserve.adapters.tokenizer import ByteTokenizer

MODEL = "walkserve-default"


@pytest.fixture(scope="module")
def base_url(walkserve_serve: Any) -> Iterator[str]:
    with walkserve_serve() as server:
        yield server.url


def test_closed_and_open_loop_records_match_the_reference(base_url: str) -> None:
    assert loadgen.served_model(base_url) == MODEL
    walk = json.dumps({"prompt_ids": [[5, 6, 7]], "max_new_tokens": 3})  # the speech walk
    workload = loadgen.Workload(
        mix=loadgen.Workload.parse_mix("text=2,speech=1,image=1,walk:speak=1"),
        prompt_len=loadgen.Lengths(3, 8),
        output_len=loadgen.Lengths(4, 12),
        speech_tokens=loadgen.Lengths(8, 16),
        walk_inputs=(("speak", walk),),
        model=MODEL,
        seed=1,
    )
    requests = loadgen.plan(workload, 8, warmup=1)
    assert {p.kind for p in requests[1:]} >= {"text", "speech", "image"}
    closed, wall = asyncio.run(
        loadgen.run(base_url, requests, loadgen.Arrivals(concurrency=3), progress=False)
    )
    assert [r.index for r in closed] == [p.index for p in requests[1:]]  # warm-up left out
    assert all(r.ok and r.status == 200 for r in closed), [r.error for r in closed]

    ref = capture_model(MODEL)
    speech_tok = ByteTokenizer(default.SPEECH_VOCAB)
    by_index = {p.index: p for p in requests}
    for r in closed:
        p = by_index[r.index]
        assert r.first is not None and r.end is not None and r.first <= r.end
        if r.kind == "text":
            out = ref.run(sample_request(p.body["prompt"], p.max_tokens), walk="prefill")
            want = [int(out["token"])] + (out["tokens"][0].tolist() if "tokens" in out else [])
            if default.EOS_ID in want:
                want = want[: want.index(default.EOS_ID)]
            assert r.token_ids == want
            assert r.output_tokens == len(want) == len(r.token_times)
        if r.kind == "speech":
            ids = torch.tensor([speech_tok.encode(p.body["input"])])
            inputs = {"prompt_ids": ids, "max_new_tokens": p.max_tokens}
            samples = ref.run(inputs, walk="speak")["waveform"].numel()
            assert r.audio_seconds == pytest.approx(samples / default.SAMPLE_RATE)
            assert r.chunk_times and r.viability is not None
    summary = loadgen.summarize(closed, wall, loadgen.parse_slo("e2e=60"))
    assert summary["overall"]["goodput"]["met"] == len(closed)
    assert summary["by_kind"]["text"]["output_tokens"] == sum(
        r.output_tokens for r in closed if r.kind == "text"
    )

    # open loop, a Poisson burst: same requests, same answers
    opened, _ = asyncio.run(
        loadgen.run(base_url, requests, loadgen.Arrivals(None, rate=20.0), progress=False)
    )
    assert all(r.ok for r in opened)
    assert [r.token_ids for r in opened] == [r.token_ids for r in closed]
    assert [r.audio_seconds for r in opened] == pytest.approx([r.audio_seconds for r in closed])
