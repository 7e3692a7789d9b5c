"""The HTTP layer's pure parts, without a server: the toy tokenizer, WAV and PNG encoding, JSON
tensors, text assembly (EOS, stop strings, held-back text), and the default model's walks
against eager PyTorch."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import pytest
import torch

from walkserve.adapters import default
from walkserve.adapters.registry import profile_for
from walkserve.adapters.tokenizer import ByteTokenizer
from walkserve.api import jsontensor, media
from walkserve.api.textgen import TextAssembler
from walkserve.capture import trace
from walkserve.capture.model import CapturedModel


def test_byte_tokenizer_round_trips_with_a_full_byte_vocabulary() -> None:
    tok = ByteTokenizer(259)
    assert tok.lossless and tok.encode("hi") == [107, 108]
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"
    assert tok.decode([0, 1, 2, 107]) == "h"  # special ids dropped
    small = ByteTokenizer(64)
    assert not small.lossless and all(3 <= i < 64 for i in small.encode("héllo ✓"))
    with pytest.raises(ValueError, match="vocab_size > specials"):
        ByteTokenizer(3)


def test_wav_and_pcm() -> None:
    wave = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    pcm = media.pcm16(wave)
    assert struct.unpack("<4h", pcm) == (0, 32767, -32767, 32767)
    data = media.wav(wave, 16000)
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[4:8])[0] == 36 + 8
    assert data[44:] == pcm
    assert struct.unpack("<I", media.wav_header(16000, None)[40:44])[0] == 0xFFFFFFFF


def test_png_holds_the_pixels() -> None:
    image = torch.rand(3, 4, 5) * 2 - 1
    data = media.png(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (5, 4)
    (length,) = struct.unpack(">I", data[33:37])
    raw = zlib.decompress(data[41 : 41 + length])
    rows = [raw[r * 16 + 1 : (r + 1) * 16] for r in range(4)]
    pixels = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(4, 5, 3)
    assert torch.equal(pixels, media.image_to_uint8(image))


@pytest.fixture(scope="module")
def captured() -> CapturedModel:
    model, sample = default.build(0)
    return trace(model, sample)


def test_json_tensors(captured: CapturedModel) -> None:
    ids = torch.tensor([[4, 5]])
    b64 = {"b64": base64.b64encode(ids.numpy().tobytes()).decode(), "dtype": "int64"}
    got = jsontensor.decode_inputs(
        captured, "speak", {"prompt_ids": {**b64, "shape": [1, 2]}, "max_new_tokens": 3}
    )
    prompt_ids = got["prompt_ids"]
    assert isinstance(prompt_ids, torch.Tensor) and torch.equal(prompt_ids, ids)
    assert got["max_new_tokens"] == 3
    assert jsontensor.required_inputs(captured, "speak").keys() == {
        "prompt_ids",
        "max_new_tokens",
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt_ids": [[1]]}, "needs inputs ['max_new_tokens']"),
        ({"prompt_ids": [[1]], "max_new_tokens": 2, "x": 1}, "takes no inputs ['x']"),
        ({"prompt_ids": [[1.5]], "max_new_tokens": 2}, "must hold integers"),
        ({"prompt_ids": [[1], [2, 3]], "max_new_tokens": 2}, "rectangular"),
        ({"prompt_ids": [[1]], "max_new_tokens": True}, "JSON int"),
        ({"prompt_ids": {**b64, "shape": [3]}, "max_new_tokens": 2}, "needs 24"),
        ({"prompt_ids": {**b64, "dtype": "complex"}, "max_new_tokens": 2}, "keys b64, dtype"),
    ]
    for raw, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            jsontensor.decode_inputs(captured, "speak", raw)
    out = jsontensor.to_json(torch.tensor([1.5, 2.0]), "b64")
    assert out["dtype"] == "float32" and out["shape"] == [2]
    assert jsontensor.to_json(torch.tensor([[1, 2]]), "list") == [[1, 2]]


def test_text_assembler_stops_and_holds_back() -> None:
    task = profile_for(default.NAME).text
    assert task is not None
    tok = ByteTokenizer(default.TEXT_VOCAB)
    text = TextAssembler(task, ["lo"], max_tokens=10)
    sent = ""
    for token in tok.encode("hello"):
        if text.feed(token):
            break
        sent += text.take()
    assert sent == "hel"  # the second "l" was held back: it might start the stop string
    text.finish()
    assert sent + text.take() == "hel" and text.finish_reason == "stop"
    eos = TextAssembler(task, [], max_tokens=10)
    assert not eos.feed(tok.encode("a")[0]) and eos.feed(default.EOS_ID)
    assert eos.tokens == tok.encode("a") and eos.generated == 2 and eos.finish_reason == "stop"
    length = TextAssembler(task, [], max_tokens=1)
    assert length.feed(50) and length.finish_reason == "length"


def test_default_model_walks_match_eager(captured: CapturedModel) -> None:
    model, sample = default.build(0)
    upstream = default.text_lm(0)  # the same weights, with transformers' own attention
    ids = sample["input_ids"]
    with torch.no_grad():
        want = upstream.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=sample["max_new_tokens"],
        )[0, ids.shape[1] :]
        speech = model.speak(sample["prompt_ids"], 16)
        image = model.generate(sample["prompt_ids"], sample["noise"])
        edited = model.edit(sample["prompt_ids"], sample["image"], sample["noise"])
    text = captured.run(sample, walk="prefill")
    assert torch.cat([text["token"], text["tokens"]], 1)[0].tolist() == want.tolist()
    got = captured.run(sample, walk="speak")
    assert all(torch.equal(got[k], speech[k]) for k in speech)
    assert torch.equal(captured.run(sample, walk="generate")["image"], image["image"])
    assert torch.equal(captured.run(sample, walk="edit")["image"], edited["image"])
    assert captured.graph.entry_walks() == ["prefill", "prefill_ext", "speak", "generate", "edit"]


def test_parse_form_splits_fields_and_files() -> None:
    import httpx

    from walkserve.api.form import parse_form

    request = httpx.Request(
        "POST",
        "http://x/",
        files={"image": ("a.png", b"\x89PNG\r\n--\x00\xff", "image/png")},
        data={"prompt": "héllo", "n": "1"},
    )
    form = parse_form(request.read(), request.headers["content-type"])
    assert form.fields == {"prompt": "héllo", "n": "1"}
    assert form.files["image"].data == b"\x89PNG\r\n--\x00\xff"
    assert form.files["image"].filename == "a.png"
    with pytest.raises(ValueError, match="multipart/form-data"):
        parse_form(b"{}", "application/json")


def test_image_edits_is_404_without_an_edit_walk() -> None:
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from walkserve.api.app import create_app
    from walkserve.api.profile import ModelProfile

    app = create_app(SimpleNamespace(captured=None), ModelProfile("example-speech"))  # type: ignore[arg-type]
    r = TestClient(app).post("/v1/images/edits", files={"image": ("a.png", b"x", "image/png")})
    assert r.status_code == 404
    assert "has no image edit walk" in r.json()["error"]["message"]
