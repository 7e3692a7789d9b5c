"""Orpheus over HTTP with the official ``openai`` client: a voice puts ``"{voice}: "`` before
the text (Orpheus's prompt format), checked against the reference interpreter on that prompt;
an unknown voice and chat audio (Orpheus has no chat) are 400s that say why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")

from walkserve.adapters.orpheus_tiny import TINY_TOKENS  # noqa: E402
from walkserve.adapters.orpheus_tokens import orpheus_prompt  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.api import media  # noqa: E402

ORPHEUS = "walkserve.adapters.orpheus:tiny"


def pcm(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32)


@pytest.fixture(scope="module")
def orpheus_client(walkserve_serve: Any) -> Iterator[Any]:
    with walkserve_serve("--model", ORPHEUS) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_orpheus_voice_prefixes_the_prompt(orpheus_client: Any) -> None:
    ref = capture_model(ORPHEUS)

    def want(text: bytes) -> torch.Tensor:
        ids = orpheus_prompt(list(text), TINY_TOKENS)
        out = ref.run({"input_ids": torch.tensor([ids]), "max_new_tokens": 42}, walk="speak")
        return pcm(media.pcm16(out["waveform"]))

    data = orpheus_client.audio.speech.create(
        model=ORPHEUS, voice="leo", input="Hi", response_format="pcm", extra_body={"max_tokens": 42}
    ).read()
    got, leo = pcm(data), want(b"leo: Hi")
    assert got.shape == leo.shape and leo.abs().max() > 1000
    assert (got - leo).abs().max().item() <= 1  # float rounding may flip one LSB
    assert not torch.equal(leo, want(b"Hi"))  # the prefix changes the audio
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'alloy'.*tara"):
        orpheus_client.audio.speech.create(model=ORPHEUS, voice="alloy", input="Hi").read()


def test_a_model_without_audio_output_says_so(orpheus_client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="has no audio output"):
        orpheus_client.chat.completions.create(
            model=ORPHEUS,
            messages=[{"role": "user", "content": "x"}],
            modalities=["text", "audio"],
            audio={"voice": "leo", "format": "wav"},
        )
