"""Random Orpheus-shaped upstream pairs built in code (nothing downloaded), for tests and the
speech benchmark: ``random_pair(config, seed)`` builds an unmodified
``transformers.LlamaForCausalLM`` and ``snac.SNAC`` of ``RandomConfig``'s sizes with seeded
random weights, which ``orpheus.build`` wraps in the walks. ``TINY_CONFIG`` (on ``TINY_TOKENS``)
is what ``orpheus:tiny`` serves, ``BENCH_CONFIG`` (on ``BENCH_TOKENS``) the benchmark's
``orpheus:bench``.

The random LM is steered to emit well-formed frames, because Orpheus's own
inference does not constrain decoding: ``steer_to_frames`` writes a "frame position" direction
into the embeddings and output rows: the embedding of every audio token at position ``k`` (and
of ``start_of_speech``, as position 6) gets a large component on hidden channel ``k``, and the
output rows of position ``(k + 1) % 7`` a matching weight on channel ``k``. Greedy decoding then
picks position ``k + 1``'s range after position ``k``; the code within the range is left to the
random weights. Nothing else of the upstream model is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from walkserve.adapters.orpheus_tokens import FRAME, OrpheusTokens

__all__ = [
    "BENCH_CONFIG",
    "BENCH_TOKENS",
    "TINY_CONFIG",
    "TINY_TOKENS",
    "RandomConfig",
    "random_pair",
    "steer_to_frames",
]

# The tiny models' vocabulary: bytes 0..255, the specials at Orpheus's custom-token positions.
TINY_TOKENS = OrpheusTokens(
    audio_offset=266,
    codebook=64,
    start_of_human=259,
    end_of_text=256,
    end_of_human=260,
    start_of_ai=261,
    start_of_speech=257,
    end_of_speech=258,
)


def steer_to_frames(lm: Any, tokens: OrpheusTokens, strength: float = 10.0) -> None:
    """Make a random LM emit well-formed frames greedily (see the module docstring): hidden
    channel ``k`` marks "the current token is at frame position k"."""
    emb = lm.get_input_embeddings().weight  # [V, D]
    head = lm.get_output_embeddings().weight  # [V, D]
    if emb.data_ptr() == head.data_ptr():
        raise ValueError("steer_to_frames needs untied input and output embeddings")
    with torch.no_grad():
        emb[:, :FRAME] = 0.0
        head[:, :FRAME] = 0.0
        for k in range(FRAME):
            here = tokens.audio_offset + k * tokens.codebook
            emb[here : here + tokens.codebook, k] = strength
            nxt = tokens.audio_offset + (k + 1) % FRAME * tokens.codebook
            head[nxt : nxt + tokens.codebook, k] = strength
        emb[tokens.start_of_speech, FRAME - 1] = strength


@dataclass(frozen=True)
class RandomConfig:
    """Sizes of a random Orpheus-shaped pair (LM + SNAC)."""

    tokens: OrpheusTokens = TINY_TOKENS
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    snac_encoder_dim: int = 8
    snac_encoder_rates: tuple[int, ...] = (2, 4, 4)
    snac_decoder_dim: int = 64
    snac_decoder_rates: tuple[int, ...] = (4, 4, 2)
    snac_codebook_dim: int = 4
    snac_noise: bool = False
    init_range: float = 0.15

    def __post_init__(self) -> None:
        if self.hidden <= FRAME:
            raise ValueError(f"hidden must exceed {FRAME} (frame-position channels)")


TINY_CONFIG = RandomConfig()  # ``orpheus:tiny``'s pair


def random_pair(config: RandomConfig, seed: int = 0) -> tuple[Any, Any]:
    """A random LM and SNAC of ``config``'s sizes in eval mode, the LM steered to emit frames
    (``steer_to_frames``), the SNAC as upstream builds it (weight norm not folded)."""
    from snac import SNAC
    from transformers import LlamaConfig, LlamaForCausalLM

    t = config.tokens
    torch.manual_seed(seed)
    lm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=t.vocab_end,
            hidden_size=config.hidden,
            intermediate_size=config.intermediate,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads,
            max_position_embeddings=4096,
            initializer_range=config.init_range,
            tie_word_embeddings=False,
            bos_token_id=t.start_of_human,
            eos_token_id=t.end_of_speech,
        )
    ).eval()
    steer_to_frames(lm, t)
    snac = SNAC(
        sampling_rate=24000,
        encoder_dim=config.snac_encoder_dim,
        encoder_rates=list(config.snac_encoder_rates),
        decoder_dim=config.snac_decoder_dim,
        decoder_rates=list(config.snac_decoder_rates),
        attn_window_size=None,
        codebook_size=t.codebook,
        codebook_dim=config.snac_codebook_dim,
        vq_strides=[4, 2, 1],
        noise=config.snac_noise,
        depthwise=True,
    ).eval()
    return lm, snac


# The benchmark's CPU-friendly pair: a 4-layer Llama (~16M parameters, most in the 28.9k-token
# embeddings) with Orpheus's 4096-code audio vocabulary, and a snac_24khz-shaped SNAC (19.8M).
BENCH_TOKENS = OrpheusTokens(**{**TINY_TOKENS.__dict__, "codebook": 4096})
BENCH_CONFIG = RandomConfig(
    tokens=BENCH_TOKENS,
    hidden=256,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=768,
    snac_encoder_dim=48,
    snac_encoder_rates=(2, 4, 8, 8),
    snac_decoder_dim=1024,
    snac_decoder_rates=(8, 8, 4, 2),
    snac_codebook_dim=8,
    snac_noise=False,
    init_range=0.02,  # wider random layers drown the frame-position channels at this width
)
