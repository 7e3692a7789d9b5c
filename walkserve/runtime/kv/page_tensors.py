"""The K and V tensors of a paged KV pool: allocated once, never reallocated, indexed by page.

Owns the two tensors and the index math into them: zeroing and copying whole pages (all layers),
and writing or gathering one layer's K/V at flat slot indices. It knows no sequences, block
tables or reference counts: the pool (``pool.py``) decides which pages to zero or copy and turns
a sequence's token positions into flat slots. What crosses the boundary is page ids, flat slot
indices and ``[N, kv_heads, dim]`` tensors; engines index ``k``/``v`` (``KVPool.k``/``KVPool.v``,
the same tensors) with slots themselves.

Layout (S = page_size, P = num_pages, L = num_layers)::

    k: [L, P, S, kv_heads, head_dim]      v: [L, P, S, kv_heads, v_head_dim]

             page 0               page 1               page P-1
    layer 0  [s0|s1|...|s(S-1)]   [s0|s1|...|s(S-1)]   ...  [s0|...|s(S-1)]
    layer 1  [s0|s1|...|s(S-1)]   [s0|s1|...|s(S-1)]   ...
    ...                           each slot s: [kv_heads, head_dim]

    token t of a sequence with block table pages=[7, 2, 9] (S = 4, 10 tokens):
        page = pages[t // S], offset = t % S, flat slot = page * S + offset
        tokens 0-3 -> page 7, 4-7 -> page 2, 8-9 -> page 9 offsets 0-1 (offsets 2-3 unused)
"""

from __future__ import annotations

import torch

from walkserve.runtime.kv.pool_types import KVPoolConfig

__all__ = ["PageTensors"]


class PageTensors:
    """``k [L, P, S, kv_heads, head_dim]`` and ``v [L, P, S, kv_heads, v_head_dim]``, zeros at
    first."""

    def __init__(self, config: KVPoolConfig, device: torch.device | str) -> None:
        self.config = config
        self.k = torch.zeros(config.shape, dtype=config.dtype, device=device)  # [L, P, S, H, D]
        self.v = torch.zeros(config.v_shape, dtype=config.dtype, device=device)  # [L, P, S, H, Dv]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V: ``2 * layers * pages * page_size * heads * dim * itemsize``."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def zero(self, pages: list[int]) -> None:
        """Zero the K/V of ``pages`` in every layer."""
        if pages:
            index = torch.tensor(pages, dtype=torch.int64, device=self.k.device)
            self.k.index_fill_(1, index, 0)
            self.v.index_fill_(1, index, 0)

    def copy(self, src: int, dst: int) -> None:
        """Page ``dst`` gets page ``src``'s K/V, in every layer."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def flat_index(self, flat: list[int]) -> torch.Tensor:
        """Flat slot indices (``page * page_size + offset``) as an index tensor on the device."""
        return torch.tensor(flat, dtype=torch.long, device=self.k.device)

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer must be in [0, {self.config.num_layers}), got {layer}")

    def check_kv(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise unless ``k``, ``v`` hold ``n`` tokens' K and V of one layer."""
        want_k = (n, self.config.kv_heads, self.config.head_dim)
        want_v = (n, self.config.kv_heads, self.config.value_dim)
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise ValueError(
                f"k and v must be {list(want_k)}, {list(want_v)}, got {list(k.shape)}, "
                f"{list(v.shape)}"
            )

    def write(self, layer: int, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[N, kv_heads, dim]`` at flat slots ``flat [N]`` of ``layer``."""
        self._layer_view(self.k, layer).index_copy_(0, flat, k.to(self.k))
        self._layer_view(self.v, layer).index_copy_(0, flat, v.to(self.v))

    def gather(self, layer: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V at flat slots ``flat [N]`` of ``layer``: ``[N, kv_heads, dim]``."""
        return (
            self._layer_view(self.k, layer).index_select(0, flat),
            self._layer_view(self.v, layer).index_select(0, flat),
        )

    def _layer_view(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """``pool[layer]`` as ``[num_pages * page_size, kv_heads, dim]`` (a view)."""
        return pool[layer].view(-1, self.config.kv_heads, pool.shape[-1])
