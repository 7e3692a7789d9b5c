"""``PagedLM``: an unmodified Hugging Face causal LM as a ``kv_cache`` component whose cache is
the paged pool, so that the runtime's own workers batch many requests' steps into one forward.

Owns, per component instance (that is, per worker process that hosts it): one ``KVPool``
(allocated on the first forward, never in a process that only captures), the runner that runs
packed forwards over it (``hf.PagedCausalLMRunner``), the sequences of every live cache value,
and recompute-preemption when the pool is full. What crosses its boundary:

- in: a call ``lm(input_ids [B, T], cache, step, temperature, top_p, top_k, seed, ...)`` per
  request, ``cache`` None for a new request (prefill) or the ``PagedKV`` an earlier call
  returned; the further sampling inputs (penalties, ``min_tokens``, ``constraints``,
  ``logprobs``) are ``forward``'s keyword arguments;
- out: ``(token [B, 1] int64, cache)``: the token sampled after each row's last input token,
  and the same ``PagedKV`` (it is updated in place, as transformers' ``DynamicCache`` is); with
  ``with_logprobs=True`` (a constant of the call site) also ``logprobs [B, 1, n]`` float32 and
  ``logprob_ids [B, 1, n]`` int64: the sampled token's raw log-probability and the ``n - 1``
  most likely ids' (``n`` is the call's ``logprobs``, 0: empty).

The walks carry the ``PagedKV`` as request state (an object: it never leaves the worker; the
runtime's ``ObjectRef``). It holds no tensors, only sequence ids; its pages are freed when the
last reference to it goes (the request finished, failed or was cancelled), from whichever
thread drops it: a release that finds the pool busy is queued and done at the next forward.

Batching: the runtime calls ``forward_batch`` with every ready call of this node (prefills of
new requests and decode steps of running ones, any lengths). All rows go in one packed forward
(``hf.py``: one row of tokens, explicit positions, logits of each row's last token only)::

    calls     A: prefill [1, 5]   B: decode [1, 1]   C: decode [1, 1]
    packed    [a0 a1 a2 a3 a4 | b | c]              -> logits [3, vocab] -> 3 tokens

Pool full: a call the pool has no room for now is answered ``DEFER`` (the runtime sends it
again with a later batch), as a continuous-batching scheduler keeps requests waiting: running
requests grow first (evicting the sequences of requests not in the batch, least recently used
first, then preempting the youngest running request, which is recomputed from its tokens when
admitted again); new requests are admitted only with room to spare (``_schedule``). Prefix
caching: a new sequence reuses the cached full pages of an identical token prefix
(``pool.allocate_with_prefix``).

Chunked prefill (``PagedLMConfig.max_step_tokens``): one forward computes at most that many
tokens. The calls of a batch are served shortest first (decode steps of one token before
prefills); a call whose new tokens do not fit gets what is left, rounded down to whole pages,
and is answered ``DEFER``; when the runtime sends it again with a later batch it goes on from
the tokens already computed (a running cache's rows remember them; a new request's prompt
finds its computed pages through the prefix cache: a recompute if they were evicted
meanwhile, never a wrong token). So a long prompt never holds the rank for more than one
step's budget at a time, and the other requests' steps go on between its chunks::

    budget 8, page 4     A: prefill of 13 new tokens    B, C: decode steps (1 token each)
    forward 1            b | c | a0..a4 (6 left: 4, a page) -> B, C sampled; A DEFER
    forward 2            b | c | a4..a9                       -> B, C sampled; A DEFER
    forward 3            b | c | a10..a12                     -> B, C, A sampled

Sampling: temperature 0 is greedy (argmax; ``generate(do_sample=False)``). Otherwise the draw of
row ``r`` at step ``step`` uses a generator seeded from ``(seed, r, step)``, so a request's
tokens depend on its inputs only, not on its batch, its timing, or an eviction. A
``repetition_penalty`` (transformers' rule) applies to the row's tokens so far, prompt included;
the presence and frequency penalties (OpenAI's) to the tokens generated after the prompt.

Per-request state beyond the KV (set by the call that makes the cache, kept by its rows): the
prompt length (which tokens are generated), the ``constraints`` (``grammar.Constraints``: a
logit bias, and a grammar whose ``Guide`` masks each draw and advances with each sampled
token). ``min_tokens`` keeps the component's ``stop_ids`` (the model's EOS) from being drawn
until that many tokens were generated.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from walkserve.lowering.batched import DEFER, Deferred
from walkserve.runtime.kv import grammar
from walkserve.runtime.kv.engine_report import EngineChoice
from walkserve.runtime.kv.hf import (
    SeqChunk,
)
from walkserve.runtime.kv.hf_attention import ModelAttention, use_paged_attention
from walkserve.runtime.kv.paged_state import (
    DeferredRelease,
    PagedKV,
    PagedLMConfig,
    PagedLMStats,
    PagedState,
    Row,
    Unit,
)
from walkserve.runtime.kv.pool_types import PoolExhausted
from walkserve.runtime.kv.row_sampling import TextSampler, vocab_size
from walkserve.runtime.kv.sampling import seeded_token, step_seed

__all__ = [
    "DeferredRelease",
    "PagedKV",
    "PagedLM",
    "PagedLMConfig",
    "PagedLMStats",
    "pool_nbytes",
    "seeded_token",
    "step_seed",
]

Call = tuple[Sequence[Any], dict[str, Any]]


class PagedLM(nn.Module):
    """``lm`` (any transformers ``*ForCausalLM`` using the attention-function registry) over a
    paged pool; see the module docstring for the calling convention. ``attention``: what
    ``hf_attention.probe_attention(lm)`` found, when the caller probed already (else the pool's
    first allocation probes). Raises ``UnsupportedAttention`` for a model that computes attention
    outside transformers' interface."""

    def __init__(
        self,
        lm: nn.Module,
        config: PagedLMConfig | None = None,
        attention: ModelAttention | None = None,
        *,
        stop_ids: Sequence[int] = (),
        vocabulary: grammar.Vocabulary | None = None,
    ) -> None:
        """``stop_ids``: the ids that end a request (the walks' EOS), which ``min_tokens``
        holds back; ``vocabulary``: the tokenizer's bytes, for grammars (None: a request
        with a grammar fails)."""
        super().__init__()
        self.sampler = TextSampler(stop_ids, vocabulary)
        use_paged_attention(lm)
        self.lm = lm
        self.config_kv = config or PagedLMConfig()
        self.engine_choice = EngineChoice("paged", type(lm).__name__)
        self._attention = attention
        self._state: PagedState | None = None
        self._namespace = f"{type(lm).__name__}:{id(self)}"
        self._signature = inspect.signature(self.forward)  # binds each call's arguments

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        cache: PagedKV | None = None,
        step: int | torch.Tensor = 0,  # int, or [B, 1]: tokens generated before this call
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        repetition_penalty: float = 1.0,  # transformers' rule, on the row's tokens so far
        presence_penalty: float = 0.0,  # OpenAI's, on the generated tokens
        frequency_penalty: float = 0.0,
        min_tokens: int = 0,  # stop_ids are not drawn before this many generated tokens
        constraints: torch.Tensor | None = None,  # [1, L] uint8 (grammar.encode); new rows
        logprobs: int = 0,  # columns of the logprob outputs (with_logprobs)
        with_logprobs: bool = False,  # a constant of the call site: two more outputs
    ) -> Any:  # (token [B, 1] int64, cache[, logprobs [B, 1, n], logprob_ids [B, 1, n]])
        args = (input_ids, cache, step, temperature, top_p, top_k, seed, repetition_penalty)
        kwargs = {
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "min_tokens": min_tokens,
            "constraints": constraints,
            "logprobs": logprobs,
            "with_logprobs": with_logprobs,
        }
        out = self.forward_batch([(args, kwargs)])
        assert not isinstance(out[0], Deferred)  # a lone call runs (or raises)
        return out[0]

    # ---------------------------------------------------------------- batch

    def forward_batch(self, calls: Sequence[Call]) -> list[Any]:
        """Every call of one ready batch that the pool has room for, in one packed forward;
        ``DEFER`` for the others (see ``_schedule``)."""
        state = self._ensure_state()
        with state.lock, torch.no_grad():
            state.drain()
            units = []
            for index, (args, kwargs) in enumerate(calls):
                bound = self._signature.bind(*args, **kwargs).arguments
                new = bound.get("cache") is None
                cache = self._cache(state, bound)
                rows = [state.rows[seq] for seq in cache.seqs]
                ids = bound["input_ids"]
                if new:
                    self._start_rows(rows, ids, bound)
                want = [r.tokens + [int(t) for t in ids[i].tolist()] for i, r in enumerate(rows)]
                units.append(Unit(index, bound, cache, rows, want))
            chosen = self._schedule(state, units)
            ends = self._budget(state, chosen)
            logits = self._forward(
                state, [(r, w, ends[id(r)]) for u in chosen for r, w in zip(u.rows, u.want)]
            )
            out: list[Any] = [DEFER] * len(units)
            for u in chosen:
                if all(ends[id(r)] == len(w) for r, w in zip(u.rows, u.want)):
                    for r, w in zip(u.rows, u.want):
                        r.tokens = w  # fed: the next call's tokens follow these
                    out[u.index] = self._sample_unit(u, logits)
            return out

    def _budget(self, state: PagedState, chosen: list[Unit]) -> dict[int, int]:
        """Chunked prefill: how far each chosen row computes in this forward (``id(row)`` ->
        its end), within ``max_step_tokens``. Units with the fewest new tokens go first. A
        unit that fits runs whole; one that does not gets what is left, each row up to a page
        boundary short of its last token (whose logits the call samples from once its other
        tokens are in), so at least the first unit always computes something."""
        page = state.pool.page_size
        most = self.config_kv.max_step_tokens
        most = None if most is None else max(most, page)
        ends: dict[int, int] = {}

        def need(u: Unit) -> int:
            return sum(len(w) - r.computed for r, w in zip(u.rows, u.want))

        left = most
        for u in sorted(chosen, key=need):
            whole = left is None or need(u) <= left
            for r, w in zip(u.rows, u.want):
                if whole:
                    end = len(w)
                else:
                    assert left is not None
                    end = min(len(w) - 1, (r.computed + left) // page * page)
                    end = max(end, r.computed)
                ends[id(r)] = end
                if left is not None:
                    left -= end - r.computed
        return ends

    def _start_rows(self, rows: list[Row], ids: torch.Tensor, args: dict[str, Any]) -> None:
        """A new request's rows: its prompt length and its constraints (subclasses keep more
        of the call's ``args`` in ``Row.extra``)."""
        n_vocab = vocab_size(self.lm)
        constraints = args.get("constraints")
        self.sampler.start([r.sampling for r in rows], ids.shape[1], constraints, n_vocab)

    def _prefix_ids(self, row: Row, want: list[int]) -> list[int]:
        """The ids that name ``want``'s K/V in the prefix cache: the tokens themselves; a
        subclass whose K/V depend on more than the ids (image features at placeholder ids)
        gives ids that say so."""
        return want

    def _sample_unit(self, u: Unit, logits: dict[int, torch.Tensor]) -> Any:
        """One call's outputs: its tokens [B, 1] and cache, and its logprobs if asked."""
        rows = [logits[id(r)] for r in u.rows]
        token, *rest = self.sampler.sample_call(u.args, rows, u.want, [r.sampling for r in u.rows])
        return (token, u.cache, *rest)

    def _cache(self, state: PagedState, args: dict[str, Any]) -> PagedKV:
        ids, cache = args["input_ids"], args.get("cache")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, tokens >= 1], got {_shape(ids)}")
        if cache is None:
            return PagedKV(state, ids.shape[0])
        if not isinstance(cache, PagedKV) or cache._state() is not state:
            raise ValueError(f"cache must be a PagedKV made by this component, got {cache!r}")
        if len(cache) != ids.shape[0]:
            raise ValueError(f"cache has {len(cache)} rows, input_ids {ids.shape[0]}")
        if any(seq not in state.rows for seq in cache.seqs):
            raise ValueError(f"{cache!r} was released")
        return cache

    def _schedule(self, state: PagedState, units: list[Unit]) -> list[Unit]:
        """Reserve pages for the units that run now, as a continuous-batching scheduler does:

        1. *running* units (every row holds pages), oldest admission first, grow by their new
           tokens; when the pool is full, sequences of requests not in this batch are evicted
           first (least recently used), then the youngest running unit of the batch is
           preempted (its pages freed; it is deferred and recomputed when admitted again);
        2. *waiting* units (new requests, or evicted ones), first come first served, are
           admitted only with a free page to spare per running row (so that the next decode
           step does not preempt at once), and not at all in a step that had to preempt.

        At least one unit runs: if none could, the oldest is admitted into a pool emptied of
        everything else, or the call fails because it is larger than the whole pool.
        """
        in_batch = {id(r) for u in units for r in u.rows}
        running = sorted((u for u in units if u.resident), key=lambda u: u.admitted)
        waiting = sorted((u for u in units if not u.resident), key=lambda u: u.arrived)
        chosen: list[Unit] = []
        deferred: list[Unit] = []
        while running:
            unit = running.pop(0)
            while not self._grow(state, unit):
                if self._evict_idle(state, in_batch):
                    continue
                victim = running.pop() if running else unit
                self._preempt(state, victim)
                deferred.append(victim)
                if victim is unit:
                    break
            else:
                chosen.append(unit)
        spare = sum(len(u.rows) for u in chosen)
        for unit in waiting:
            if deferred:
                deferred.append(unit)
                continue
            need = sum(state.pool.pages_for(len(w)) for w in unit.want) + spare
            while state.pool.pages_available < need and self._evict_idle(state, in_batch):
                pass
            if state.pool.pages_available >= need and self._admit(state, unit):
                chosen.append(unit)
                spare += len(unit.rows)
            else:
                deferred.append(unit)
        if not chosen:
            oldest = min(deferred, key=lambda u: u.arrived)
            while self._evict_idle(state, in_batch):
                pass
            if not self._admit(state, oldest):
                tokens = max(len(w) for w in oldest.want)
                raise ValueError(
                    f"a sequence of {tokens} tokens needs {state.pool.pages_for(tokens)} KV "
                    f"pages; the pool has {state.pool.num_pages}: serve with a bigger pool_tokens"
                )
            chosen.append(oldest)
        return chosen

    def _grow(self, state: PagedState, unit: Unit) -> bool:
        """Room for a running unit's new tokens (all rows or none grow)."""
        pool = state.pool
        grow = [len(w) - pool.num_tokens(r.seq) for r, w in zip(unit.rows, unit.want)]
        pages = sum(
            pool.pages_for(len(w)) - pool.pages_for(pool.num_tokens(r.seq)) + 1  # + a CoW copy
            for r, w in zip(unit.rows, unit.want)
        )
        if pages > pool.pages_available:
            return False
        try:
            for r, n in zip(unit.rows, grow):
                if n > 0:
                    pool.append(r.seq, n)
        except PoolExhausted:
            return False
        return True

    def _admit(self, state: PagedState, unit: Unit) -> bool:
        """Pages for a waiting unit's rows, reusing cached prefix pages; all rows or none."""
        done: list[Row] = []
        try:
            for r, w in zip(unit.rows, unit.want):
                r.computed = state.pool.allocate_with_prefix(
                    r.seq,
                    self._prefix_ids(r, w),
                    namespace=self._namespace,
                    max_cached_tokens=len(w) - 1,  # the last token's logits are needed
                )
                r.resident, r.admitted = True, next(state.clock)
                done.append(r)
        except PoolExhausted:
            for r in done:
                self._evict(state, r)
            return False
        return True

    def _evict_idle(self, state: PagedState, in_batch: set[int]) -> bool:
        """Free the least recently used resident sequence of a request not in this batch."""
        idle = [r for r in state.rows.values() if r.resident and id(r) not in in_batch]
        if not idle:
            return False
        self._evict(state, min(idle, key=lambda r: r.last_used))
        return True

    def _preempt(self, state: PagedState, unit: Unit) -> None:
        for r in unit.rows:
            if r.resident:
                self._evict(state, r)

    def _evict(self, state: PagedState, row: Row) -> None:
        state.pool.free(row.seq)
        row.resident, row.computed = False, 0
        state.evictions += 1

    def _forward(
        self, state: PagedState, rows: list[tuple[Row, list[int], int]]
    ) -> dict[int, torch.Tensor]:
        """One packed forward: each row's tokens ``want[computed:end]`` (rows with nothing to
        compute this time are left out); logits by ``id(row)``. Rows keep their ``tokens``
        (what earlier calls fed) until their call completes, so that a call sent again after
        a partial chunk asks for the same ``want``."""
        pool = state.pool
        rows = [(r, want, end) for r, want, end in rows if end > r.computed]
        chunks = [
            SeqChunk(tuple(want[r.computed : end]), r.computed, r.seq) for r, want, end in rows
        ]
        logits = (
            self._logits(state, [r for r, _, _ in rows], chunks) if chunks else None
        )  # [rows, vocab]
        now = next(state.clock)
        for r, _, end in rows:
            state.tokens += end - r.computed
            r.computed, r.last_used = end, now
            pool.mark_computed(r.seq, r.computed)
        if chunks:
            state.forwards += 1
        assert logits is not None or not rows
        return {id(r): logits[i] for i, (r, _, _) in enumerate(rows)} if logits is not None else {}

    def _logits(self, state: PagedState, rows: list[Row], chunks: list[SeqChunk]) -> torch.Tensor:
        """One packed forward of ``chunks`` (``rows[i]``'s new tokens): logits [rows, vocab]
        after each chunk's last token. A subclass that feeds more than token embeddings (image
        features) runs its own."""
        return state.runner.forward(chunks)

    # ---------------------------------------------------------------- state

    def _ensure_state(self) -> PagedState:
        if self._state is None:
            self._state = PagedState(self.lm, self.config_kv, self._attention)
        return self._state

    def kv_pool_nbytes(self, tensor_parallel: int = 1) -> int:
        """Bytes of the pool this component allocates in each process that runs it, one of
        ``tensor_parallel`` ranks holding its share of each layer's KV heads (as
        ``runtime.tp.heads`` splits them). Allocates nothing; probes the model's attention
        once (a short forward) unless it was given."""
        from walkserve.runtime.kv.hf_attention import probe_attention

        if self._attention is None:
            self._attention = probe_attention(self.lm)
        itemsize = next(self.lm.parameters()).element_size()
        return pool_nbytes(self._attention, self.config_kv, itemsize, tensor_parallel)

    def release_kv(self) -> None:
        """Drop the pool (a process that only captured or checked the model); live caches of
        this component become unusable."""
        self._state = None

    def kv_stats(self, wait: bool = True) -> PagedLMStats | None:
        """The pool's figures; None before the first forward allocated it, or when ``wait`` is
        False and a forward holds the pool."""
        state = self._state
        if state is None or not state.lock.acquire(blocking=wait):
            return None
        try:
            state.drain()
            pool = state.pool.stats()
            return PagedLMStats(
                pages_in_use=pool.pages_in_use,
                pages_cached=pool.pages_cached,
                num_pages=state.pool.num_pages,
                live_sequences=len(state.rows),
                evictions=state.evictions,
                prefix_hits=pool.prefix_hits,
                forwards=state.forwards,
                tokens_forwarded=state.tokens,
            )
        finally:
            state.lock.release()


def pool_nbytes(
    attention: ModelAttention, config: PagedLMConfig, itemsize: int, tensor_parallel: int = 1
) -> int:
    """Bytes of a pool of ``config``'s size for these attention layers, one of
    ``tensor_parallel`` ranks holding its share of each layer's KV heads."""
    from walkserve.runtime.tp.heads import split_heads

    slots = config.num_pages * config.page_size
    total = 0
    for a in attention.layers:
        kv = split_heads(a.num_heads, a.kv_heads, tensor_parallel).kv_heads
        total += slots * kv * (a.head_dim + a.v_head_dim) * itemsize
    return total


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
