"""pi0's attention pattern over ``[prefix; actions]`` and the one attention call both the
cached expert and the full (recomputing) pass use.

The sequence is cut into blocks; a query sees every valid key of its own block and of every
earlier block (block-causal). The prefix (images, prompt, discretised state) is block 0, so
it attends bidirectionally within itself and never to the actions; the action tokens are
block 1: they see the whole valid prefix and each other. Padding keys (``valid`` False) are
seen by nobody; padding queries' outputs are never read.

    keys:        img img txt pad st | a0 a1 a2
    prefix q     x   x   x   .   x  | .  .  .
    action q     x   x   x   .   x  | x  x  x

Positions count valid tokens only (``cumsum(valid) - 1``), so action ``i`` sits at position
``n_valid_prefix + i`` whether or not the prompt was padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PREFIX_BLOCK = 0
ACTION_BLOCK = 1


def block_causal_mask(valid: Tensor, blocks: Tensor) -> Tensor:
    """valid [B, S] bool, blocks [S] int (non-decreasing) -> [B, S, S] bool: query ``i`` may
    see key ``j`` iff ``valid[j]`` and ``blocks[j] <= blocks[i]``."""
    causal = blocks[None, :] <= blocks[:, None]  # [S, S]
    return valid[:, None, :] & causal[None]


def sequence_blocks(prefix_len: int, actions: int, device: torch.device) -> Tensor:
    """[prefix_len + actions] block ids: the prefix's, then the action chunk's."""
    return torch.cat(
        [
            torch.full((prefix_len,), PREFIX_BLOCK, device=device),
            torch.full((actions,), ACTION_BLOCK, device=device),
        ]
    )


def action_query_mask(prefix_mask: Tensor, actions: int) -> Tensor:
    """The action queries' rows of ``block_causal_mask`` over ``[prefix; actions]``:
    prefix_mask [B, P] bool -> [B, actions, P + actions] bool."""
    b, p = prefix_mask.shape
    valid = torch.cat([prefix_mask, prefix_mask.new_ones(b, actions)], dim=1)  # [B, P + H]
    return block_causal_mask(valid, sequence_blocks(p, actions, prefix_mask.device))[:, p:]


def positions(valid: Tensor) -> Tensor:
    """valid [B, S] bool -> [B, S] int64 RoPE positions: valid tokens numbered from 0 in
    order; a padding token repeats its predecessor's (it is never attended to)."""
    return (valid.long().cumsum(dim=-1) - 1).clamp(min=0)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention: q [B, Hq, S, hd], k/v [B, Hkv, T, hd], mask [B, S, T] bool
    -> [B, Hq, S, hd], scaled by hd**-0.5 as Gemma does."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=q.shape[-1] ** -0.5, enable_gqa=True
    )
