"""Qwen2.5-Omni's HTTP routes on real worker processes (Starlette's test client in process):
text chat runs its ``speak`` walk (a one-code talker) and equals the reference interpreter,
streamed and not. Its audio routes need a ``waveform`` output of ``speak`` (token2wav in the
walk): until the walk has one they are 400s saying so; once it has, speech must equal the
reference."""

from __future__ import annotations

import json
from typing import Any

import torch
from fastapi.testclient import TestClient

from walkserve.adapters import omni_http, qwen3_omni, qwen25_omni
from walkserve.adapters.registry import capture_model
from walkserve.api import media
from walkserve.api.app import create_app
from walkserve.api.profile import profile_for
from walkserve.runtime.server import serve

FACTORY = "walkserve.adapters.qwen25_omni:tiny"
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

        speech = {"model": FACTORY, "input": "Hi", "voice": "Chelsie", "max_tokens": 20}
        got = client.post("/v1/audio/speech", json=speech)
        if "waveform" not in ref.graph.walks["speak"].outputs:
            assert got.status_code == 400
            assert "no speech output yet" in got.json()["error"]["message"]
            audio = {"voice": "Chelsie", "format": "wav"}
            chat = client.post(
                "/v1/chat/completions",
                json={**body, "modalities": ["text", "audio"], "audio": audio},
            )
            assert chat.status_code == 400 and "no audio output" in chat.text
        else:  # token2wav landed in the walk: speech equals the reference's waveform
            assert got.status_code == 200, got.text
            ids = chat_ids(omni_http.READ_ALOUD.format(text="Hi"))
            out = ref.run(
                {
                    **inputs,
                    "input_ids": ids,
                    "max_new_tokens": omni_http.TINY_LIMITS.read_aloud_tokens,
                    "max_audio_tokens": 20,
                },
                walk="speak",
            )
            assert got.content[44:] == media.pcm16(out["waveform"])
