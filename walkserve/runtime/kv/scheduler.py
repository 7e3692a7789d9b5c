"""Continuous-batching scheduler over the paged KV pool: which tokens of which requests run in
the next forward.

Owns the requests' token state (prompt, output, how many tokens' K/V the pool holds), the
waiting and running queues, and every page decision: admission (``allocate_with_prefix``),
growth (``append``), preemption (``preempt``), registering computed pages (``mark_computed``)
and freeing. It runs no model and touches no tensor: a test drives it with fabricated tokens.

What crosses its boundary:

- in: ``add``/``cancel`` of requests; after each forward, ``update(plan, sampled)`` with the
  token sampled for every chunk that reached the end of its request's tokens;
- out: ``StepPlan`` (chunks: request, token range, its ``SeqId`` in the pool; requests
  preempted this step)
  and ``update``'s ``{request_id: new_token}``.

One request's tokens and what the pool holds of them::

    tokens    [ p0 p1 ... p(n-1) | o0 o1 ... o(k-1) ]      prompt, then output so far
    computed  -----------------^                           K/V in the pool for tokens[:computed]
    chunk     tokens[computed : computed + q]              q <= max_batch_tokens left this step

A chunk that ends at ``len(tokens)`` yields the next token (its last row's logits). Prefill is a
chunk of many tokens (split over steps when the token budget is short), decode a chunk of one.

Preemption is recompute: a preempted request loses its pages, goes back to the front of the
waiting queue, and on readmission its prompt *and* output are prefilled again (prefix pages it
registered may still be cached), so its next token is computed from the same tokens: never a
wrong token. The youngest running request is preempted first; nothing is admitted in a step
that preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from walkserve.runtime.kv.layer_groups import GroupedKVPool
from walkserve.runtime.kv.pool import KVPool
from walkserve.runtime.kv.pool_types import PoolExhausted, SeqId

__all__ = ["Chunk", "ContinuousScheduler", "SchedulerStats", "StepPlan"]

LABEL = "text"
"""The one pool label a text request uses."""


@dataclass
class _Request:
    id: str
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    output: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose K/V the pool holds

    @property
    def seq(self) -> SeqId:
        return SeqId(self.id, LABEL)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        return (self.prompt[start:end] if start < n else []) + self.output[
            max(start - n, 0) : max(end - n, 0)
        ]

    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens or (
            bool(self.output) and self.output[-1] in self.eos
        )


@dataclass(frozen=True)
class Chunk:
    """Tokens ``[start, end)`` of a request run this step; the pool holds ``[0, start)``."""

    request_id: str
    start: int
    end: int
    token_ids: tuple[int, ...]
    seq: SeqId  # where its K/V are in the pool
    samples: bool  # True: ``end`` is the request's token count, the chunk yields a token


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[Chunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    preemptions: int
    finished: int
    cancelled: int


class ContinuousScheduler:
    """FIFO continuous batching with chunked prefill, recompute preemption and prefix reuse."""

    def __init__(
        self, pool: KVPool | GroupedKVPool, max_batch_tokens: int, namespace: str = ""
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.namespace = namespace
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # admission order: the last is the youngest
        self._preemptions = 0
        self._finished = 0
        self._cancelled = 0

    # ---------------------------------------------------------------------- requests

    def add(
        self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int]
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1")
        # The last output token is never fed back, so the pool holds at most this many tokens.
        most = len(prompt_ids) + max_new_tokens - 1
        if self.pool.pages_for(most) > self.pool.num_pages:
            raise ValueError(
                f"request {request_id!r} may need {self.pool.pages_for(most)} pages "
                f"({most} tokens); the pool has {self.pool.num_pages}: use a bigger pool"
            )
        req = _Request(request_id, [int(t) for t in prompt_ids], max_new_tokens, frozenset(eos))
        self._requests[request_id] = req
        self._waiting.append(req)

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its pages; False if unknown/finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self.pool.free_request(request_id)
        self._cancelled += 1
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` is waiting or running (not finished nor cancelled)."""
        return request_id in self._requests

    def output(self, request_id: str) -> list[int]:
        return list(self._requests[request_id].output)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            preemptions=self._preemptions,
            finished=self._finished,
            cancelled=self._cancelled,
        )

    # ---------------------------------------------------------------------- one step

    def schedule(self) -> StepPlan:
        """Chunks for the next forward: running requests first (oldest first), then admissions."""
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted: list[str] = []
        index = 0
        while index < len(self._running) and budget > 0:
            req = self._running[index]
            n = min(req.num_tokens - req.computed, budget)
            if not self._reserve(req, req.computed + n, preempted):
                break  # req itself was preempted: it was the youngest left
            chunks.append(self._chunk(req, n))
            budget -= n
            index += 1
        while self._waiting and budget > 0 and not preempted:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            self._running.append(req)
            n = min(req.num_tokens - req.computed, budget)
            chunks.append(self._chunk(req, n))
            budget -= n
        return StepPlan(tuple(chunks), tuple(preempted))

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> dict[str, int]:
        """Record a finished forward: K/V of every chunk is in the pool; ``sampled`` has the
        next token of every ``samples`` chunk. Returns the new tokens by request."""
        new: dict[str, int] = {}
        for chunk in plan.chunks:
            req = self._requests.get(chunk.request_id)
            if req is None:  # cancelled while the step ran
                continue
            req.computed = chunk.end
            self.pool.mark_computed(req.seq, req.computed)
            if not chunk.samples:
                continue
            token = sampled[chunk.request_id]
            req.output.append(token)
            new[req.id] = token
            if req.done():
                self._running.remove(req)
                self.pool.free_request(req.id)
                del self._requests[req.id]
                self._finished += 1
        return new

    # ---------------------------------------------------------------------- pages

    def _chunk(self, req: _Request, n: int) -> Chunk:
        end = req.computed + n
        return Chunk(
            request_id=req.id,
            start=req.computed,
            end=end,
            token_ids=tuple(req.tokens(req.computed, end)),
            seq=req.seq,
            samples=end == req.num_tokens,
        )

    def _admit(self, req: _Request) -> bool:
        """Allocate pages for all of ``req``'s tokens, reusing cached prefix pages. Keeps one
        free page per running request so that admission does not force a preemption next
        step."""
        need = self.pool.pages_for(req.num_tokens) + len(self._running)
        if self._running and not self.pool.can_allocate(need):
            return False
        try:
            cached = self.pool.allocate_with_prefix(
                req.seq,
                req.tokens(0, req.num_tokens),
                namespace=self.namespace,
                max_cached_tokens=req.num_tokens - 1,  # the last token's logits are needed
            )
        except PoolExhausted:
            return False
        req.computed = cached
        return True

    def _reserve(self, req: _Request, n_tokens: int, preempted: list[str]) -> bool:
        """Grow ``req``'s pages to hold ``n_tokens``, preempting the youngest running requests
        as needed. False when ``req`` itself had to be preempted."""
        grow = n_tokens - self.pool.num_tokens(req.seq)
        while grow > 0:
            try:
                self.pool.append(req.seq, grow)
                return True
            except PoolExhausted:
                victim = self._running.pop()
                self.pool.preempt(victim.id)
                victim.computed = 0
                self._waiting.appendleft(victim)
                self._preemptions += 1
                preempted.append(victim.id)
                if victim is req:
                    return False
        return True
