"""Tiny random-weight instances of transformers decoder architectures, one per feature the paged
attention must honour (or refuse): for the tests, the README's architecture table and demos.

``ZOO`` maps a name to a ``ZooEntry``: the transformers config and model classes, the config
arguments (tiny: vocab 128, hidden 32, 2-4 layers, windows of 8 tokens so that a test's prompts
cross them), and what the entry exercises. ``build(name)`` makes the model with seeded random
weights and *sharpened* output embeddings (scaled by ``SHARPEN``): random logits are otherwise
so close that a greedy choice can hang on float rounding (a 1e-7 difference between two
correct attention implementations would flip a token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["EOS", "SHARPEN", "VOCAB", "ZOO", "ZooEntry", "build", "config"]

VOCAB = 128
EOS = 2
SHARPEN = 6.0
WINDOW = 8
_UNIVERSAL = ("initializer_range", "tie_word_embeddings")

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "pad_token_id": 0,
    "initializer_range": 0.2,  # varied greedy output from random weights
    "tie_word_embeddings": False,  # sharpening a tied head would scale the inputs too
}


@dataclass(frozen=True)
class ZooEntry:
    """``engine``: the engine ``hf_engine.text_engine`` must choose; ``why``: words its reason
    must contain when that is the fallback; ``why_since``: transformers release -> the words from
    that release on, where upstream changed the model so that a different check refuses it
    (``reason_words``); ``note``: the README's word on its state."""

    config_class: str  # a transformers class name
    model_class: str
    features: str  # what it exercises, for the README table
    kwargs: dict[str, Any] = field(default_factory=dict)
    common: bool = True  # start from _COMMON
    engine: str = "paged"
    why: str = ""
    why_since: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def reason_words(self, transformers_version: str) -> str:
        """``why`` for that transformers release: the words of the latest ``why_since`` release
        it is at or past, else ``why``."""
        from packaging.version import Version

        installed = Version(transformers_version)
        words = self.why
        for release, since in sorted(self.why_since.items(), key=lambda kv: Version(kv[0])):
            if installed >= Version(release):
                words = since
        return words


ZOO: dict[str, ZooEntry] = {
    "llama": ZooEntry("LlamaConfig", "LlamaForCausalLM", "grouped-query attention, RoPE"),
    "mistral": ZooEntry(
        "MistralConfig",
        "MistralForCausalLM",
        "sliding window on every layer",
        {"sliding_window": WINDOW},
    ),
    "qwen2-sliding": ZooEntry(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        "full layers then sliding ones (max_window_layers)",
        {
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 2,
        },
    ),
    "gemma": ZooEntry(
        "GemmaConfig",
        "GemmaForCausalLM",
        "head_dim != hidden / heads, scaled embeddings",
        {"head_dim": 16},
    ),
    "gemma2": ZooEntry(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "attention and final logit soft-capping, query_pre_attn_scalar, alternating sliding/full",
        {
            "head_dim": 8,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": ZooEntry(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "sliding pattern (2 sliding : 1 full), q/k norm, local RoPE base",
        {
            "num_hidden_layers": 3,
            "head_dim": 8,
            "sliding_window": WINDOW,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 8,
        },
    ),
    "gpt2": ZooEntry(
        "GPT2Config",
        "GPT2LMHeadModel",
        "learned absolute positions, n_head / n_embd names, no KV-head field, scale by layer",
        {
            "vocab_size": VOCAB,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 512,
            "bos_token_id": 1,
            "eos_token_id": EOS,
            "scale_attn_by_inverse_layer_idx": True,
        },
        common=False,
    ),
    "gpt-neox": ZooEntry(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        "partial rotary (25%), parallel residual",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "rotary_pct": 0.25,
            "max_position_embeddings": 512,
            "bos_token_id": 1,
            "eos_token_id": EOS,
        },
        common=False,
    ),
    "phi": ZooEntry(
        "PhiConfig",
        "PhiForCausalLM",
        "partial rotary (50%), parallel attention/MLP",
        {"partial_rotary_factor": 0.5},
    ),
    "stablelm": ZooEntry(
        "StableLmConfig",
        "StableLmForCausalLM",
        "partial rotary (25%)",
        {"partial_rotary_factor": 0.25},
    ),
    "olmo2": ZooEntry("Olmo2Config", "Olmo2ForCausalLM", "q/k norm over all heads"),
    "granite": ZooEntry(
        "GraniteConfig",
        "GraniteForCausalLM",
        "attention multiplier (non-default scaling), embedding/residual/logit multipliers",
        {
            "attention_multiplier": 0.9,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 0.5,
        },
    ),
    "starcoder2": ZooEntry(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        "sliding window, biases, LayerNorm",
        {"sliding_window": WINDOW},
    ),
    "mixtral": ZooEntry(
        "MixtralConfig",
        "MixtralForCausalLM",
        "mixture of experts, sliding window",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    "qwen3-moe": ZooEntry(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "mixture of experts, q/k norm",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8},
    ),
    "gpt-oss": ZooEntry(
        "GptOssConfig",
        "GptOssForCausalLM",
        "attention sinks (s_aux), alternating sliding/full, mixture of experts",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": WINDOW},
    ),
    "deepseek-v3": ZooEntry(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "multi-head latent attention: key head 12, value head 6; mixture of experts",
        {
            "num_key_value_heads": 4,
            "moe_intermediate_size": 16,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 8,
            "v_head_dim": 6,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "gemma3n": ZooEntry(
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        "cross-layer KV sharing (the last 2 layers reuse earlier layers' K/V), AltUp, "
        "per-layer inputs",
        {
            "num_hidden_layers": 4,
            "head_dim": 8,
            "sliding_window": WINDOW,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB,
            "laurel_rank": 4,
            "altup_num_inputs": 2,
            "activation_sparsity_pattern": [0.0] * 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        note="each sharing layer keeps its own copy of the K/V it is handed (exact; no memory "
        "saved)",
    ),
    "gemma3-vlm": ZooEntry(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        "a vision-language model's text tower (text-only requests; SigLIP vision tower unused)",
        {
            "text_config": {
                **_COMMON,
                "num_hidden_layers": 3,
                "head_dim": 8,
                "sliding_window": WINDOW,
                "sliding_window_pattern": 3,
                "query_pre_attn_scalar": 8,
            },
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 16,
                "patch_size": 4,
            },
            "mm_tokens_per_image": 4,
            "image_token_index": 5,
            "boi_token_index": 6,
            "eoi_token_index": 7,
            "bos_token_id": 1,
            "eos_token_id": EOS,
            "pad_token_id": 0,
        },
        common=False,
    ),
    "jamba": ZooEntry(
        "JambaConfig",
        "JambaForCausalLM",
        "hybrid: Mamba layers beside attention (recurrent)",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 2,
            "mamba_d_state": 4,
            "mamba_dt_rank": 4,
        },
        engine="hf-cache",
        why="never call transformers' attention interface",
        note="its Mamba layers never call the attention interface: their recurrent state has "
        "no place in the pool",
    ),
    "qwen3-next": ZooEntry(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "hybrid: gated delta-net linear attention beside full attention, MoE",
        {
            "num_hidden_layers": 4,
            "head_dim": 8,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "full_attention_interval": 2,
        },
        engine="hf-cache",
        why="linear_attention",
        note="its linear-attention layers keep a recurrent state, not K/V",
    ),
    "falcon": ZooEntry(
        "FalconConfig",
        "FalconForCausalLM",
        "attention outside transformers' interface (to 5.24), a mask it materialises (5.25)",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "new_decoder_architecture": True,
            "num_kv_heads": 2,
            "bos_token_id": 1,
            "eos_token_id": EOS,
        },
        common=False,
        engine="hf-cache",
        why="computes attention itself",
        # 5.25 moved Falcon onto the interface, but it asks for a materialised mask to add
        # ALiBi to (allow_is_causal_skip=False): a mask a PagedMask cannot stand in for
        why_since={"5.25": "mask is not plain causal"},
        note="its attention is its own code (transformers to 5.24), or it asks for a mask "
        "tensor to add ALiBi onto (5.25), which the paged pool does not build",
    ),
    "bloom": ZooEntry(
        "BloomConfig",
        "BloomForCausalLM",
        "ALiBi positions, attention outside the interface",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "n_layer": 2,
            "n_head": 4,
            "bos_token_id": 1,
            "eos_token_id": EOS,
        },
        common=False,
        engine="hf-cache",
        why="computes attention itself",
        note="ALiBi, in its own attention code (not the interface); paged attention has no ALiBi",
    ),
}


def config(name: str) -> Any:
    """The tiny config of zoo entry ``name``."""
    import transformers

    entry = ZOO[name]
    base = _COMMON if entry.common else {k: _COMMON[k] for k in _UNIVERSAL}
    kwargs = {**base, **entry.kwargs}
    return getattr(transformers, entry.config_class)(**kwargs)


def build(name: str, seed: int = 0, attn_implementation: str | None = None) -> nn.Module:
    """Zoo entry ``name`` with seeded random weights and sharpened output embeddings, in eval
    mode."""
    import transformers

    cfg = config(name)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, ZOO[name].model_class)(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN)
    return model  # type: ignore[no-any-return]


ENGINE_WORDS = {"paged": "paged", "hf-cache": "fallback (its own cache per request)"}


def readme_table() -> str:
    """The README's table of architectures: what each zoo entry exercises and its engine (the
    tests assert both, and that the README holds this table)."""
    rows = [
        "| architecture (zoo name) | what it exercises | engine |",
        "| --- | --- | --- |",
    ]
    for name, entry in ZOO.items():
        engine = ENGINE_WORDS[entry.engine]
        if entry.note:
            engine += f": {entry.note}"
        rows.append(f"| `{entry.model_class}` ({name}) | {entry.features} | {engine} |")
    return "\n".join(rows)
