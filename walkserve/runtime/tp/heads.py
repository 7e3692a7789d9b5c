"""How attention heads split across the ranks of a tensor-parallel group: the one rule that the
sharded weights (``shard.py``) and the paged KV pool (``kv/hf.py``, which then holds only a
rank's KV heads) both follow. Pure arithmetic, no torch.

Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
with fewer (GQA/MQA, ``tp % kv_heads == 0``) each KV head is replicated on ``tp / kv_heads``
consecutive ranks, so every rank holds exactly the one KV head its query heads read::

    heads 8, kv_heads 2, tp 4       rank    0     1     2     3
                                    q       0-1   2-3   4-5   6-7
                                    kv      0     0     1     1      (2 ranks per KV head)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HeadSplit", "split_heads"]


@dataclass(frozen=True)
class HeadSplit:
    """One rank's heads: ``heads`` query heads and ``kv_heads`` KV heads, the first of which is
    KV head ``kv_start`` of the full model; ``kv_replicas`` ranks hold each KV head."""

    heads: int
    kv_heads: int
    kv_start: int
    kv_replicas: int


def split_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int = 0) -> HeadSplit:
    """Rank ``rank``'s share of ``num_heads`` query and ``num_kv_heads`` KV heads at degree
    ``tp``; ``ValueError`` saying which degrees work when the heads do not split."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"need tp >= 1 and 0 <= rank < tp, got tp={tp}, rank={rank}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if num_heads % tp:
        raise ValueError(
            f"tensor parallel degree {tp} does not divide the {num_heads} attention heads; use "
            f"a degree among {_divisors(num_heads)}"
        )
    if num_kv_heads % tp == 0:
        kv = num_kv_heads // tp
        return HeadSplit(num_heads // tp, kv, rank * kv, 1)
    if tp % num_kv_heads == 0:
        replicas = tp // num_kv_heads
        return HeadSplit(num_heads // tp, 1, rank // replicas, replicas)
    raise ValueError(
        f"tensor parallel degree {tp} neither divides the {num_kv_heads} KV heads nor is a "
        f"multiple of them (to replicate each); use a degree among "
        f"{[d for d in _divisors(num_heads) if num_kv_heads % d == 0 or d % num_kv_heads == 0]}"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
