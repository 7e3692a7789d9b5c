"""Helpers shared by tests and benchmarks: mixed request sets for the example models, the one
rule by which an executor's outputs are compared with the reference interpreter's, and greedy
text generation two ways (upstream ``generate()``, and a text engine driven as the text walks
drive it).

The rule: integer outputs (tokens, codes) are identical; float outputs satisfy
``max|got - want| <= 1e-5 * max|want|``. Not bitwise, because a batched matmul sums in another
order than a batch-1 matmul (a single denoiser call on four stacked requests already differs
from four separate calls by ~7e-7) and guided Euler steps carry that along. Executors that run
each request alone are compared bitwise. 8-bit images made of such floats
(``assert_pixels_match``) may differ by one level where a value lies on a rounding boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

RELATIVE_TOLERANCE = 1e-5


def mixed_requests(
    name: str, sample: Mapping[str, Any], n: int, seed: int | None = None
) -> list[dict[str, Any]]:
    """``n`` requests for example model ``name`` with different shapes and lengths (prompt
    lengths, token budgets, horizons, noise), derived from its sample request."""
    g = torch.Generator().manual_seed(n if seed is None else seed)
    out = []
    for i in range(n):
        r = dict(sample)
        if name == "example-text":
            r.update(
                prompt_ids=torch.randint(2, 64, (1, 2 + i % 4), generator=g),
                max_new_tokens=1 + (3 * i) % 9,
            )
        elif name == "example-speech":
            r.update(
                prompt_ids=torch.randint(2, 60, (1, 2 + i % 3), generator=g),
                max_new_tokens=2 + i % 7,
            )
        elif name == "example-cfg-image":
            r.update(
                noise=torch.randn(sample["noise"].shape, generator=g),
                prompt_ids=torch.randint(1, 64, (1, 4 + i % 2), generator=g),
                image=torch.randn(sample["image"].shape, generator=g),
            )
        elif name == "example-world":
            r.update(
                horizon=1 + i % 6,
                frames=torch.randn((1, 1 + i % 3, *sample["frames"].shape[2:]), generator=g),
            )
        else:
            raise ValueError(f"no mixed requests for model {name!r}")
        out.append(r)
    return out


def assert_outputs_match(
    got: Mapping[str, Any], want: Mapping[str, Any], *, bitwise: bool = False
) -> None:
    """``got`` equals ``want`` by the module's rule (or bitwise)."""
    assert got.keys() == want.keys(), f"{sorted(got)} != {sorted(want)}"
    for key, expected in want.items():
        value = got[key]
        assert value.shape == expected.shape and value.dtype == expected.dtype, key
        if bitwise or not expected.is_floating_point():
            assert torch.equal(value, expected), f"{key} differs"
        else:
            scale = max(expected.abs().max().item(), 1e-30)
            error = (value - expected).abs().max().item()
            assert error <= RELATIVE_TOLERANCE * scale, (
                f"{key}: max error {error:.3g} > {RELATIVE_TOLERANCE} x {scale:.3g}"
            )


def assert_pixels_match(got: Any, want: Any, share: float = 1e-3) -> None:
    """8-bit images made from float pixels in two processes: equal but for at most ``share``
    of their values, each off by one level. The same float image computed with other torch
    threads (a worker's against a test's) differs in the last bits, and a value that lies on a
    rounding or truncation boundary lands on the next level."""
    g = torch.as_tensor(got).to(torch.int16)
    w = torch.as_tensor(want).to(torch.int16)
    assert g.shape == w.shape, f"shape {list(g.shape)} != {list(w.shape)}"
    off = (g - w).abs()
    worst, n = int(off.max()) if off.numel() else 0, int((off > 0).sum())
    assert worst <= 1 and n <= share * off.numel(), (
        f"{n} of {off.numel()} values differ, by up to {worst} levels"
    )


def greedy_generate(lm: Any, prompt: Sequence[int], n: int, eos: int | None) -> list[int]:
    """Upstream ``generate(do_sample=False)``: the new tokens of one unpadded prompt."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = lm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, ids.shape[1] :]]


def serve_text_greedy(
    engine: Any, work: Sequence[tuple[Sequence[int], int]], eos: int | None
) -> tuple[list[list[int]], list[int]]:
    """Every request of ``work`` (prompt, token budget) to ``eos`` or its budget, on a text
    engine (``PagedLM``, ``HFCacheLM``) called as the text walks call it: each step, every live
    request's call in one ``forward_batch`` when the engine has one (deferred calls come again),
    else one call each. Returns the tokens and the number of calls each batch ran."""
    from walkserve.lowering.batched import Deferred

    caches: list[Any] = [None] * len(work)
    last: list[Any] = [None] * len(work)
    outs: list[list[int]] = [[] for _ in work]
    live, sizes = list(range(len(work))), list[int]()
    while live:
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
            (
                (
                    torch.tensor([list(work[i][0])]) if caches[i] is None else last[i],
                    caches[i],
                    len(outs[i]),
                ),
                {},
            )
            for i in live
        ]
        batch = getattr(engine, "forward_batch", None)
        results = batch(calls) if batch is not None else [engine(*a) for a, _ in calls]
        sizes.append(sum(not isinstance(r, Deferred) for r in results))
        still = []
        for i, result in zip(live, results):
            if isinstance(result, Deferred):
                still.append(i)
                continue
            last[i], caches[i] = result
            outs[i].append(int(last[i]))
            if len(outs[i]) < work[i][1] and outs[i][-1] != eos:
                still.append(i)
        live = still
    return outs, sizes


def lane_steps(scheduler: Any, runner: Any, limit: int) -> int:
    """Up to ``limit`` steps of the engine's fast lane (``RankScheduler.lane``) of
    ``scheduler`` with ``runner``, as the engine takes them while no command waits; how many
    it took."""
    lane = scheduler.lane()
    taken = 0
    if lane is None or limit < 1:
        return taken

    def stop() -> bool:  # after each quick step
        nonlocal taken
        taken += 1
        return taken >= limit

    with runner.lane(lane.walk, lane.node, lane.item) as run:
        try:
            while taken < limit:
                result = lane.steps(run, stop)
                if result is None:
                    break
                taken += 1
                if not lane.commit(result):
                    break
        finally:
            lane.end()
    return taken


def accumulation_layouts() -> Any:
    """A hypothesis strategy of ``(mode, ndim, dim)``: a loop channel accumulated with ``cat``
    or ``stack``, its pieces' number of dims (1-3), and any dim valid for it, negative ones
    too (hypothesis is imported here: a test dependency)."""
    from hypothesis import strategies as st

    def layout(mode: str, ndim: int, pick: int) -> tuple[str, int, int]:
        span = ndim if mode == "cat" else ndim + 1
        return mode, ndim, pick % (2 * span) - span

    return st.builds(
        layout, st.sampled_from(["cat", "stack"]), st.integers(1, 3), st.integers(0, 7)
    )
