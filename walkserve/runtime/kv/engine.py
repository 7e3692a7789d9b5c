"""``PagedLMEngine``: continuous batching of a transformers causal LM over the paged KV pool.

Owns the step loop and nothing else; the parts are separate objects::

    plan = scheduler.schedule()             # pure: which token ranges run (scheduler.py)
    logits = runner.forward(plan chunks)    # one packed forward over the pool (hf.py)
    new = scheduler.update(plan, greedy)    # append tokens, finish on EOS / max_new_tokens

Decoding is greedy (``argmax``), token-exact with ``generate(do_sample=False)``; sampling is
not implemented yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from walkserve.runtime.kv.hf import PagedCausalLMRunner, SeqChunk, pool_for
from walkserve.runtime.kv.scheduler import ContinuousScheduler

__all__ = ["EngineStats", "PagedLMEngine"]


@dataclass(frozen=True)
class EngineStats:
    pages_in_use: int
    pages_cached: int  # evictable pages kept for prefix hits
    preemptions: int
    prefix_hits: int  # full pages reused from the prefix cache
    running: int
    waiting: int
    finished: int
    cancelled: int
    steps: int
    tokens_forwarded: int  # query tokens run through the model, recomputation included


class PagedLMEngine:
    """Many requests of one model, batched in one forward per step (greedy decoding)."""

    def __init__(
        self,
        model: nn.Module,
        pool_pages: int,
        page_size: int,
        max_batch_tokens: int,
        namespace: str = "",
    ) -> None:
        self.pool = pool_for(model, pool_pages, page_size)
        self.runner = PagedCausalLMRunner(model, self.pool)
        self.scheduler = ContinuousScheduler(self.pool, max_batch_tokens, namespace)
        self._steps = 0
        self._tokens = 0

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos: int | Sequence[int] | None = None,
    ) -> None:
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.scheduler.add(request_id, prompt_ids, max_new_tokens, eos_ids)

    def cancel(self, request_id: str) -> bool:
        return self.scheduler.cancel(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> dict[str, int]:
        """One continuous-batching step; the token each request got (none while it prefills)."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return {}
        chunks = [SeqChunk(c.token_ids, c.start, c.block_table) for c in plan.chunks]
        logits = self.runner.forward(chunks)  # [chunks, vocab]
        greedy = logits.argmax(-1).tolist()
        sampled = {c.request_id: t for c, t in zip(plan.chunks, greedy) if c.samples}
        self._steps += 1
        self._tokens += plan.num_tokens
        return self.scheduler.update(plan, sampled)

    def run(self) -> dict[str, list[int]]:
        """Step until no request is left; every request's new tokens, in order."""
        outputs: dict[str, list[int]] = {}
        while self.has_unfinished():
            for request_id, token in self.step().items():
                outputs.setdefault(request_id, []).append(token)
        return outputs

    def stats(self) -> EngineStats:
        pool, sched = self.pool.stats(), self.scheduler.stats()
        return EngineStats(
            pages_in_use=pool.pages_in_use,
            pages_cached=pool.pages_cached,
            preemptions=sched.preemptions,
            prefix_hits=pool.prefix_hits,
            running=sched.running,
            waiting=sched.waiting,
            finished=sched.finished,
            cancelled=sched.cancelled,
            steps=self._steps,
            tokens_forwarded=self._tokens,
        )
