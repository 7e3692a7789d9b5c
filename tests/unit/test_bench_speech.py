"""``benchmarks/bench_speech.py``'s token check, ``greedy_deficit``, on the tiny Orpheus LM:
``generate(do_sample=False)``'s own tokens pass; one wrong token, or the right tokens one
position late (what a position or cache bug gives), do not."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed

from benchmarks.bench_speech import TIE_RTOL, greedy_deficit
from walkserve.adapters import orpheus
from walkserve.adapters.orpheus_tiny import TINY_TOKENS
from walkserve.adapters.orpheus_tokens import FRAME, orpheus_prompt

T = TINY_TOKENS


def test_greedy_deficit_passes_generate_and_catches_wrong_tokens() -> None:
    model, _ = orpheus.tiny()
    lm = orpheus.reference_lm(model)
    lm64 = orpheus.reference_lm(model).double()
    prompt = orpheus_prompt([72, 101, 108, 108, 111], T)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = lm.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30
        )
    tokens = out[0, len(prompt) :].tolist()
    assert greedy_deficit(lm64, prompt, tokens) <= TIE_RTOL
    # The least likely code of token 10's frame position instead of the greedy one.
    with torch.no_grad():
        logits = lm64(torch.tensor([prompt + tokens[:10]])).logits[0, -1]
    first = T.audio_offset + 10 % FRAME * T.codebook
    worst = first + int(logits[first : first + T.codebook].argmin())
    assert greedy_deficit(lm64, prompt, [*tokens[:10], worst, *tokens[11:]]) > TIE_RTOL
    late = [tokens[0], *tokens[:-1]]  # every token one position late
    assert greedy_deficit(lm64, prompt, late) > TIE_RTOL
