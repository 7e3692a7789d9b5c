"""The Orpheus adapter served by real worker processes: ``serve("walkserve.adapters.orpheus:tiny")``
on one rank, on two (LM on rank 0, SNAC decoder on rank 1) and under the shipped placement file
(LM on rank 0, the decoder replicated on both), 8 concurrent requests of mixed lengths against
the reference interpreter (``walkserve.testing.assert_outputs_match``), and the first audio
chunk arriving while the LM is still generating."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import orpheus
from walkserve.adapters.orpheus_tiny import TINY_TOKENS
from walkserve.adapters.orpheus_tokens import orpheus_prompt
from walkserve.lowering.placement import Placement
from walkserve.runtime.server import Server, serve
from walkserve.testing import assert_outputs_match

FACTORY = "walkserve.adapters.orpheus:tiny"
TWO_RANKS = Placement(ranks=2, rules={"lm": [0], "codec": [1]})
PLACEMENT_FILE = "walkserve/adapters/placements/orpheus.2ranks.yaml"


@pytest.fixture(scope="module")
def reference() -> capture.CapturedModel:
    model, sample = orpheus.tiny()
    return capture.trace(model, sample)


def requests(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        text = torch.randint(0, 256, (2 + i % 5,), generator=g).tolist()
        ids = torch.tensor([orpheus_prompt(text, TINY_TOKENS)])
        out.append({"input_ids": ids, "max_new_tokens": 8 + 6 * i})  # 8 .. 50 tokens
    return out


def check_concurrent(server: Server, reference: capture.CapturedModel) -> None:
    reqs = requests(8)
    handles = [server.submit(r, "speak") for r in reqs]  # all in flight at once
    for handle, r in zip(handles, reqs):
        assert_outputs_match(handle.result(timeout=300), reference.run(r, "speak"))
    frames = orpheus.sample_inputs(TINY_TOKENS, 8)["frames"]
    got = server.submit({"frames": frames}, "decode").result(timeout=120)
    assert_outputs_match(got, reference.run({"frames": frames}, "decode"))
    stats = server.stats()
    assert stats.live_requests == 0 and stats.live_values == 0


def test_one_rank_and_the_speech_route(reference: capture.CapturedModel) -> None:
    with serve(FACTORY) as server:
        check_concurrent(server, reference)
        assert max(server.batch_sizes) > 1, server.batch_sizes
        check_speech_route(server, reference)


def check_speech_route(server: Server, reference: capture.CapturedModel) -> None:
    """``/v1/audio/speech`` finds the walk through ``orpheus.tiny_profile`` (in process, with
    Starlette's test client): WAV and streamed PCM equal the reference walk's waveform."""
    from fastapi.testclient import TestClient

    from walkserve.adapters.registry import profile_for
    from walkserve.api import media
    from walkserve.api.app import create_app

    profile = profile_for(FACTORY)
    assert profile.speech is not None and profile.speech.walk == "speak"
    text = "Hi there"
    ids = orpheus_prompt(list(text.encode()), TINY_TOKENS)
    want = reference.run({"input_ids": torch.tensor([ids]), "max_new_tokens": 40}, "speak")
    want_pcm = pcm(media.pcm16(want["waveform"]))
    body = {"model": FACTORY, "input": text, "max_tokens": 40}
    with TestClient(create_app(server, profile)) as client:
        wav = client.post("/v1/audio/speech", json=body)
        assert wav.status_code == 200, wav.text
        assert wav.content[:4] == b"RIFF" and wav.content[24:28] == (24000).to_bytes(4, "little")
        assert_pcm_close(pcm(wav.content[44:]), want_pcm)
        streamed = client.post(
            "/v1/audio/speech", json={**body, "stream": True, "response_format": "pcm"}
        )
        assert streamed.status_code == 200, streamed.text
        assert_pcm_close(pcm(streamed.content), want_pcm)


def pcm(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32)


def assert_pcm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.numel() > 0
    assert (got - want).abs().max().item() <= 1  # float rounding may flip one LSB


def test_two_ranks_stream_audio_before_the_lm_finishes(reference: capture.CapturedModel) -> None:
    with serve(FACTORY, TWO_RANKS) as server:
        check_concurrent(server, reference)
        assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}
        # One long request: 64 tokens make 6 full windows; the first fires at token 28.
        ids = requests(1)[0]["input_ids"]
        handle = server.submit({"input_ids": ids, "max_new_tokens": 64}, "speak")
        arrivals = [(time.perf_counter(), item) for item in handle.stream(timeout=120)]
        out = handle.result(timeout=120)
        first_audio = min(t for t, i in arrivals if i.channel == "waveform")
        last_token = max(t for t, i in arrivals if i.channel == "tokens")
        assert first_audio < last_token, "no audio arrived before the LM's last token"
        token_items = [i for _, i in arrivals if i.channel == "tokens"]
        before = [i for t, i in arrivals if i.channel == "tokens" and t < first_audio]
        assert len(before) < len(token_items)
        audio = [i.value for _, i in arrivals if i.channel == "waveform"]
        assert len(audio) > 1 and torch.equal(torch.cat(audio, dim=-1), out["waveform"])
        want = reference.run({"input_ids": ids, "max_new_tokens": 64}, "speak")
        assert_outputs_match(out, want)


def test_placement_file_decodes_windows_on_both_ranks(reference: capture.CapturedModel) -> None:
    """Each streamed window is a region of either replica (the batcher picks the less busy
    one), and rank 1, which holds the decoder only, takes windows of concurrent requests
    (what the bench gains from); outputs are the reference interpreter's."""
    with serve(FACTORY, Placement.from_file(PLACEMENT_FILE)) as server:
        windows = [r for r in server.plan.regions["speak"] if "play_window/codec" in r.items]
        assert [r.replicas for r in windows] == [[0, 1]], server.plan.regions["speak"]
        check_concurrent(server, reference)
        assert server.batcher.items_per_rank.get(1, 0) > 0, server.batcher.items_per_rank
