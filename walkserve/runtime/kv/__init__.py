"""Paged KV memory: one preallocated pool of pages, block tables per (request, label), copy-on-write
forks and prefix caching. ``pool.py`` owns the block tables and copy-on-write, ``pool_types.py``
the values and errors that cross its boundary, ``pages.py`` the page allocator (reference counts,
the free list), ``page_tensors.py`` the K and V tensors, ``prefix.py`` the content keys of full
pages and the LRU of evictable cached pages, ``attention.py`` paged attention over the pool. On
top of them: ``scheduler.py`` (continuous batching, pure page and token bookkeeping), ``hf.py``
(unmodified transformers causal LMs on the pool through the ``AttentionInterface`` registry),
``sampling.py`` (per-request ``SamplingParams`` and the sampling function) and ``engine.py``
(``PagedLMEngine``, the step loop). Those four are imported from their modules, not re-exported
here."""

from walkserve.runtime.kv.pool import KVPool
from walkserve.runtime.kv.pool_types import (
    BlockTable,
    KVError,
    KVPoolConfig,
    PoolExhausted,
    PoolStats,
    SeqId,
    SequenceExists,
    Slot,
    UnknownSequence,
)
from walkserve.runtime.kv.prefix import PrefixCache, PrefixStats, features_key, page_keys, root_key

__all__ = [
    "BlockTable",
    "KVError",
    "KVPool",
    "KVPoolConfig",
    "PoolExhausted",
    "PoolStats",
    "PrefixCache",
    "PrefixStats",
    "SeqId",
    "SequenceExists",
    "Slot",
    "UnknownSequence",
    "features_key",
    "page_keys",
    "root_key",
]
