"""``omni_paged.PagedDecoder`` on Qwen3-Omni's tiny thinker: one packed forward of several calls
(a prefill with an image beside decode steps) gives each call upstream's own logits; the
decoder's attention implementation is the paged one during the forward only; a call the pool
has no room for waits (``DEFER``) until a finished request's pages are freed."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from walkserve.adapters import qwen3_omni as q
from walkserve.lowering.batched import DEFER
from walkserve.runtime.kv.paged_lm import PagedLMConfig

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model() -> Any:
    return q.tiny_upstream()


def test_a_packed_forward_gives_each_call_upstreams_logits(model: Any) -> None:
    thinker = q.ThinkerOnPool(model.thinker)
    config = model.config
    text = q.chat_prompt(config, [10, 11, 12, 13])
    image = q.image_request(config, (8, 12), [10, 11])
    positions, _ = q.MropePositions(model.thinker)(image["input_ids"], image["image_grid_thw"])
    impl = model.thinker.config.text_config._attn_implementation
    # Both prefills alone first (their caches), then a text decode step packed with a new
    # image prefill.
    first = thinker(input_ids=text)
    step_ids = first.logits.argmax(-1)  # [1, 1]
    at = torch.full((4, 1, 1), text.shape[1])
    media = {k: image[k] for k in ("pixel_values", "image_grid_thw")}
    calls = [
        ((), {"input_ids": step_ids, "cache": first.cache, "position_ids": at}),
        ((), {"input_ids": image["input_ids"], "position_ids": positions, **media}),
    ]
    step, prefill = thinker.forward_batch(calls)
    assert model.thinker.config.text_config._attn_implementation == impl  # restored
    with torch.no_grad():
        want_text = model.thinker(input_ids=torch.cat([text, step_ids], 1)).logits[:, -1:]
        want_image = model.thinker(
            input_ids=image["input_ids"], position_ids=positions, **media
        ).logits[:, -1:]
    torch.testing.assert_close(step.logits, want_text, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefill.logits, want_image, rtol=1e-5, atol=1e-5)
    assert thinker.packing() == (3, 2)  # three calls, two forwards


def test_a_call_without_room_waits_for_freed_pages(model: Any) -> None:
    thinker = q.ThinkerOnPool(model.thinker, PagedLMConfig(pool_tokens=32, page_size=16))
    prompt = q.chat_prompt(model.config, list(range(10, 30)))  # 29 tokens: both pages
    held = thinker(input_ids=prompt)
    calls = [((), {"input_ids": prompt})]
    with pytest.raises(ValueError, match="does not fit the pool"):
        thinker.forward_batch(calls)  # alone in its batch, it could never run
    grow = ((), {"input_ids": held.logits.argmax(-1), "cache": held.cache})
    assert thinker.forward_batch([grow, *calls])[1] is DEFER  # the running one grows first
    stats = thinker.kv_stats()
    assert stats is not None and stats.pages_in_use == 2
    del held, grow
    gc.collect()  # the request is gone: its pages go with its cache
    (out,) = thinker.forward_batch(calls)
    assert out is not DEFER and out.logits.shape == (1, 1, q.TINY_VOCAB)
