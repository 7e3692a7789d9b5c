"""Qwen2.5-Omni's HTTP routes on real worker processes (Starlette's test client in process):
text chat runs its ``speak`` walk (a one-code talker) and equals the reference interpreter,
streamed and not; speech (voice Ethan) and chat with audio (voice Chelsie) equal the
reference's waveform as pcm16 (within one LSB) and transcript. token2wav draws its noise from
the request's seed (default 0), so served and reference runs match."""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
from fastapi.testclient import TestClient

from walkserve.adapters import omni_http, qwen3_omni, qwen25_omni
from walkserve.adapters.registry import capture_model, profile_for
from walkserve.api import media
from walkserve.api.app import create_app
from walkserve.runtime.server import serve

FACTORY = "walkserve.adapters.qwen25_omni:tiny_audible"  # its waveform survives pcm16
EOS = qwen25_omni._Ids.im_end_token_id


def chat_ids(text: str) -> torch.Tensor:
    return qwen3_omni.chat_prompt(qwen25_omni._Ids(), list(b"\n" + text.encode()), 10)


def reply_text(out: dict[str, Any], max_tokens: int) -> str:
    tokens = [int(out["first_token"]), int(out["second_token"])]
    tokens = (tokens + out["text_tokens"].reshape(-1).tolist())[:max_tokens]
    tokens = tokens[: tokens.index(EOS)] if EOS in tokens else tokens
    return bytes(t for t in tokens if t < 238).decode("utf-8", errors="replace")


def test_qwen25_chat_text_and_audio_routes() -> None:
    ref = capture_model(FACTORY)
    profile = profile_for(FACTORY)
    messages = [{"role": "user", "content": "Hi"}]
    inputs = {
        "input_ids": chat_ids("Hi"),
        "max_new_tokens": 6,
        "max_audio_tokens": 1,
        "text_bos_id": qwen25_omni.TINY_SPEAKER_BOS,
    }
    want = reply_text(ref.run(inputs, walk="speak"), 6)
    body = {"model": FACTORY, "messages": messages, "max_tokens": 6}
    with serve(FACTORY) as server, TestClient(create_app(server, profile)) as client:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == want
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200, streamed.text
        text = ""
        for line in streamed.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
        assert text == want

        speech = {"model": FACTORY, "input": "Hello", "voice": "Ethan", "max_tokens": 20}
        got = client.post("/v1/audio/speech", json=speech)
        assert got.status_code == 200, got.text
        read = chat_ids(omni_http.READ_ALOUD.format(text="Hello"))
        out = ref.run(
            {
                "input_ids": read,
                "max_new_tokens": omni_http.TINY_LIMITS.read_aloud_tokens,
                "max_audio_tokens": 20,
                "text_bos_id": qwen25_omni.TINY_SPEAKER_BOS_2,
            },
            walk="speak",
        )
        assert_pcm_close(got.content[44:], media.pcm16(out["waveform"]))

        audio = {"voice": "Chelsie", "format": "pcm16"}
        chat = client.post(
            "/v1/chat/completions",
            json={**body, "modalities": ["text", "audio"], "audio": audio},
        )
        assert chat.status_code == 200, chat.text
        message = chat.json()["choices"][0]["message"]
        limits = {"max_audio_tokens": omni_http.TINY_LIMITS.chat_audio_tokens}
        out = ref.run({**inputs, **limits}, walk="speak")
        assert message["audio"]["transcript"] == reply_text(out, 6)
        assert_pcm_close(base64.b64decode(message["audio"]["data"]), media.pcm16(out["waveform"]))


def assert_pcm_close(got: bytes, want: bytes) -> None:
    a = torch.frombuffer(bytearray(got), dtype=torch.int16).to(torch.int32)
    b = torch.frombuffer(bytearray(want), dtype=torch.int16).to(torch.int32)
    assert a.shape == b.shape and a.numel() > 0 and b.abs().max() > 1000  # audible
    assert (a - b).abs().max().item() <= 1  # float rounding may flip one LSB
