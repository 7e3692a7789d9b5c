"""pi0.5, a vision-language-action policy, written from the pi0 and pi0.5 papers on top of
transformers' PaliGemma and Gemma (no lerobot or openpi code: lerobot cannot be installed
beside this stack). Served as a prefix prefilled once and ten flow-matching steps of an
action expert that read its keys and values.

    config     Pi05Config: action chunk, state discretisation, prompt budget, expert width
    attention  the block-causal mask over [prefix; actions], positions, the attention call
    prefix     PrefixEncoder (a component): PaliGemma over images + prompt + state tokens
    expert     ActionExpert (a component): Gemma-shaped layers with adaptive RMSNorm on t
    walks      Pi05Policy: act (prefill, KV as request state) -> denoise (Loop(10))
    loader     tiny / medium factories, sample requests, the checkpoint directory layout
    native     the eager baselines: recompute the prefix every step, or cache it
"""

from walkserve.adapters.pi05.config import Pi05Config
from walkserve.adapters.pi05.loader import (
    backbone_config,
    build,
    from_checkpoint,
    load_checkpoint,
    medium,
    sample_inputs,
    save_checkpoint,
    tiny,
)
from walkserve.adapters.pi05.walks import Pi05Policy

__all__ = [
    "Pi05Config",
    "Pi05Policy",
    "backbone_config",
    "build",
    "from_checkpoint",
    "load_checkpoint",
    "medium",
    "sample_inputs",
    "save_checkpoint",
    "tiny",
]
