"""``PagedLMEngine``: continuous batching of a transformers causal LM over the paged KV pool.

Owns the step loop and nothing else; the parts are separate objects::

    plan = scheduler.schedule()             # pure: which token ranges run (scheduler.py)
    logits = runner.forward(plan chunks)    # one packed forward over the pool (hf.py)
    tokens = sample(logits, params, generators, seen)   # per request (sampling.py)
    new = scheduler.update(plan, tokens)    # append tokens, finish on EOS / stop / max_new_tokens

Each request has its own ``SamplingParams`` and, when it samples, its own ``torch.Generator``
seeded from ``params.seed``, so its tokens do not depend on the other requests of its batch.
The default (temperature 0) is greedy, token-exact with ``generate(do_sample=False)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from walkserve.runtime.kv.hf import PagedCausalLMRunner, SeqChunk, pool_for
from walkserve.runtime.kv.sampling import GREEDY, SamplingParams, sample
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


@dataclass
class _SamplingState:
    """What the engine keeps per live request for sampling."""

    params: SamplingParams
    generator: torch.Generator | None  # None: greedy, draws nothing
    seen: list[int] = field(default_factory=list)  # prompt + output; kept only for a penalty


class PagedLMEngine:
    """Many requests of one model, batched in one forward per step, each with its own
    ``SamplingParams`` (greedy by default)."""

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
        self._sampling: dict[str, _SamplingState] = {}
        self._steps = 0
        self._tokens = 0

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos: int | Sequence[int] | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> None:
        """Queue a request; it finishes after ``max_new_tokens``, or after a token of ``eos``
        or ``sampling.stop_token_ids``."""
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        stop = eos_ids + list(sampling.stop_token_ids)
        self.scheduler.add(request_id, prompt_ids, max_new_tokens, stop)
        generator: torch.Generator | None = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.runner.device)
            if sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(sampling.seed)
        seen = [int(t) for t in prompt_ids] if sampling.repetition_penalty != 1.0 else []
        self._sampling[request_id] = _SamplingState(sampling, generator, seen)

    def cancel(self, request_id: str) -> bool:
        self._sampling.pop(request_id, None)
        return self.scheduler.cancel(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> dict[str, int]:
        """One continuous-batching step; the token each request got (none while it prefills)."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return {}
        chunks = [SeqChunk(c.token_ids, c.start, c.seq) for c in plan.chunks]
        logits = self.runner.forward(chunks)  # [chunks, vocab]
        rows = [i for i, c in enumerate(plan.chunks) if c.samples]
        states = [self._sampling[plan.chunks[i].request_id] for i in rows]
        tokens = sample(
            logits[rows],  # [samplers, vocab]
            [s.params for s in states],
            [s.generator for s in states],
            [s.seen for s in states],
        )
        sampled = {plan.chunks[i].request_id: t for i, t in zip(rows, tokens)}
        self._steps += 1
        self._tokens += plan.num_tokens
        new = self.scheduler.update(plan, sampled)
        for request_id, token in new.items():
            state = self._sampling[request_id]
            if state.params.repetition_penalty != 1.0:
                state.seen.append(token)
            if not self.scheduler.has_request(request_id):  # finished
                del self._sampling[request_id]
        return new

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
