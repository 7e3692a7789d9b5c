"""The Orpheus token layout: which ids of the LM's vocabulary are SNAC codes, how one frame's
seven codes map onto SNAC's three levels, and the prompt that starts speech. Index math and
ids only, no models: the walks (``orpheus``) and the random instances (``orpheus_tiny``) read it.

What crosses its boundary: ``OrpheusTokens`` (one vocabulary's special ids and audio token
range; ``ORPHEUS_TOKENS`` is Orpheus 3B's, ``orpheus_tiny`` holds the random instances'),
``FRAME`` and ``LEVEL_POSITIONS`` (the layout
below), ``orpheus_prompt`` (text ids -> prompt ids) and ``audio_frames`` (generated ids ->
whole frames [1, F, 7]).

Token layout (Orpheus). Audio token ``t`` at position ``k`` of its frame (``k`` in 0..6) carries
SNAC code ``t - audio_offset - k * codebook``. A frame's seven codes go to SNAC's three levels
(1, 2 and 4 codes per frame, coarse to fine):

    frame f:   k=0  k=1  k=2  k=3  k=4  k=5  k=6
    level 0:   c0                                  -> codes[0][:, f]
    level 1:        c1             c4              -> codes[1][:, 2f], codes[1][:, 2f+1]
    level 2:             c2   c3        c5   c6    -> codes[2][:, 4f .. 4f+3]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "FRAME",
    "LEVEL_POSITIONS",
    "ORPHEUS_TOKENS",
    "OrpheusTokens",
    "audio_frames",
    "orpheus_prompt",
]

FRAME = 7  # audio tokens per SNAC frame
LEVEL_POSITIONS = ((0,), (1, 4), (2, 3, 5, 6))  # frame positions of SNAC levels 0, 1, 2


@dataclass(frozen=True)
class OrpheusTokens:
    """Special token ids and the audio token range of one Orpheus vocabulary."""

    audio_offset: int  # token id of code 0 at frame position 0 (Orpheus: <custom_token_10>)
    codebook: int  # codes per SNAC level
    start_of_human: int
    end_of_text: int
    end_of_human: int
    start_of_ai: int
    start_of_speech: int
    end_of_speech: int  # the LM's stop token

    def __post_init__(self) -> None:
        if self.codebook <= 0 or self.audio_offset < 0:
            raise ValueError(f"codebook must be > 0 and audio_offset >= 0, got {self}")
        specials = (
            self.start_of_human,
            self.end_of_text,
            self.end_of_human,
            self.start_of_ai,
            self.start_of_speech,
            self.end_of_speech,
        )
        if any(self.audio_offset <= t < self.vocab_end for t in specials):
            raise ValueError(f"special token ids must lie outside the audio token range: {self}")

    @property
    def vocab_end(self) -> int:
        """One past the last audio token id."""
        return self.audio_offset + FRAME * self.codebook


# Orpheus 3B (Llama 3.2 vocabulary, <custom_token_N> = 128256 + N) with SNAC 24 kHz.
ORPHEUS_TOKENS = OrpheusTokens(
    audio_offset=128266,
    codebook=4096,
    start_of_human=128259,
    end_of_text=128009,
    end_of_human=128260,
    start_of_ai=128261,
    start_of_speech=128257,
    end_of_speech=128258,
)


def orpheus_prompt(text_ids: Sequence[int], tokens: OrpheusTokens) -> list[int]:
    """Orpheus's prompt: ``start_of_human, text, end_of_text, end_of_human, start_of_ai,
    start_of_speech``; the LM continues with audio tokens."""
    return [
        tokens.start_of_human,
        *text_ids,
        tokens.end_of_text,
        tokens.end_of_human,
        tokens.start_of_ai,
        tokens.start_of_speech,
    ]


def audio_frames(generated: Sequence[int], tokens: OrpheusTokens) -> Tensor:
    """Generated token ids -> audio token ids as whole frames [1, F, 7], the way Orpheus's
    non-streamed decode crops them: tokens outside the audio range dropped, then the last
    incomplete frame."""
    audio = [t for t in generated if tokens.audio_offset <= t < tokens.vocab_end]
    whole = len(audio) // FRAME * FRAME
    return torch.tensor(audio[:whole], dtype=torch.int64).reshape(1, -1, FRAME)
