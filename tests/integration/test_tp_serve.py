"""Tensor parallelism and replicas served end to end: ``serve()`` of saved tiny checkpoints
(``save_pretrained``) with every component as one TP group of two worker processes (gloo),
as two replicas of one rank each, and both (two replicas of a TP=2 group: four ranks).

Llama: 16 concurrent greedy requests at TP=2 (and on two TP=2 groups), 32 on two replicas,
equal ``generate(do_sample=False)`` for each request alone (logits sharpened, facts.md). TP=2:
the follower rank is in no node's ranks (work goes to the leader); replicas: each replica took
over a quarter of the items (the batcher's per-rank counters) and every request's decode
stayed on the replica holding its KV cache (a wrong replica cannot resolve the cache: the
request would fail). Two replicas of TP=2: a SIGKILLed follower fails only its group's
requests; the other group serves on. Qwen3 and Qwen3-MoE at TP=2: 16 concurrent requests
with logprobs, tokens equal ``generate`` and log-probabilities within ``LOGPROB_TOL`` of the
unsharded model's."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading path needs it

from test_served_lm import (  # noqa: E402
    Reference,
    assert_replies,
    generated,
    reference,
    save_tiny,
    serve_all,
)

from walkserve.adapters.hf_causal_lm import sample_request  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.capture.model import CapturedModel  # noqa: E402
from walkserve.lowering.placement import tensor_parallel_placement  # noqa: E402
from walkserve.runtime.server import RequestFailed, Server, serve  # noqa: E402

REQUESTS = 16  # concurrent requests per TP case
REPLICA_REQUESTS = 32  # concurrent requests on two replicas
LOGPROBS = 5  # the sampled token's log-probability and the 4 most likely
LOGPROB_TOL = 1e-5  # max |log-probability difference| / max(1, |log-probability|), fp32
Checkpoint = tuple[CapturedModel, list[dict[str, Any]], list[Reference], torch.nn.Module]


def short_requests(count: int, seed: int) -> list[dict[str, Any]]:
    """Greedy requests with prompts of 2..29 tokens and 2..11 new ones."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(count):
        prompt = int(torch.randint(2, 30, (1,), generator=g))
        new = int(torch.randint(2, 12, (1,), generator=g))
        reqs.append(sample_request(torch.randint(3, 256, (prompt,), generator=g).tolist(), new))
    return reqs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The checkpoint of ``test_served_lm`` (sharpened tiny Llama, 4 heads, 2 KV heads), 32
    requests and their ``generate`` references."""
    path = tmp_path_factory.mktemp("tiny-llama")
    lm = save_tiny("llama", path)
    reqs = short_requests(REPLICA_REQUESTS, seed=3)
    return capture_model(str(path)), reqs, [reference(lm, r) for r in reqs], lm


@pytest.mark.parametrize(
    ("tp", "replicas"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "replicas2", "tp2x2"]
)
def test_greedy_tokens_equal_generate(checkpoint: Checkpoint, tp: int, replicas: int) -> None:
    captured, reqs, want, lm = checkpoint
    count = REPLICA_REQUESTS if tp == 1 else REQUESTS
    reqs, want = reqs[:count], want[:count]
    placement = tensor_parallel_placement(captured, tp, replicas)
    with serve(captured, placement, threads=1) as server:
        assert [g.ranks for g in server.plan.tp_groups] == (
            [list(range(k * tp, (k + 1) * tp)) for k in range(replicas)] if tp > 1 else []
        )
        leaders = list(range(0, tp * replicas, tp))
        dispatched = {r for w in server.plan.walks for n in server.plan.nodes(w) for r in n.ranks}
        assert dispatched == set(leaders)  # followers run what their leader sends them
        assert server.pool._working == set(leaders)  # nor are they woken for work (``wake``)
        assert_replies(serve_all(server, reqs), want)
        assert_replies(serve_all(server, reqs[:2]), want[:2])  # the group goes on after a crowd
        if replicas > 1:  # the work split: every replica took over a quarter of the items
            items = server.batcher.items_per_rank
            assert all(items.get(r, 0) > sum(items.values()) / (2 * replicas) for r in leaders), (
                items
            )
        assert all(h.status == "ready" for h in server.health().values())
        if tp > 1 and replicas > 1:
            killing_a_follower_fails_only_its_groups_requests(server, reqs[:8], want[:8], lm)


def killing_a_follower_fails_only_its_groups_requests(
    server: Server, reqs: list[dict[str, Any]], want: list[Reference], lm: torch.nn.Module
) -> None:
    """SIGKILL of rank 3 (group 2-3's follower) mid-run: the requests on that group fail
    (its leader's next step finds the peer gone and the leader ends too), those on group 0-1
    finish exactly; new requests all go to group 0-1."""
    long = [{**r, "max_new_tokens": 40} for r in reqs]
    handles = [server.submit(r) for r in long]
    for h in handles:  # every request is past its prefill, on its group
        next(h.stream(timeout=120), None)
    os.kill(server.pool.pid(3) or 0, signal.SIGKILL)
    done, failed = 0, []
    for h, r in zip(handles, long):
        try:
            out = h.result(timeout=120)
        except RequestFailed as e:
            failed.append(str(e))
            continue
        assert reference(lm, r).matches([int(out["token"]), *out["tokens"][0].tolist()])
        done += 1
    assert done and failed, (done, failed)
    assert all("rank 2" in e or "rank 3" in e for e in failed), failed
    assert not server.pool.serving(2)
    assert_replies(serve_all(server, reqs[:4]), want[:4])
    health = server.health()
    assert health[0].status == health[1].status == "ready" and health[3].status == "dead"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp2_tokens_and_logprobs_equal_one_rank(arch: str, tmp_path: Path) -> None:
    """16 concurrent greedy requests with logprobs (the ``prefill_ext`` walks) on a TP=2 group:
    Qwen3 (q/k norms over split heads), Qwen3-MoE (router replicated; every expert's intermediate
    split by transformers' ``moe_tp_experts`` plan, or from 5.25, whose EP plan alone names the
    experts, whole experts split). Tokens equal ``generate`` on the
    unsharded model; every reported log-probability is within ``LOGPROB_TOL`` of the
    unsharded model's log-softmax for that id (up to a request's first tie, after which the
    two may follow different tokens)."""
    lm = save_tiny(arch, tmp_path)
    reqs = [{**r, "logprobs": LOGPROBS} for r in short_requests(REQUESTS, seed=4)]
    want = [reference(lm, r) for r in reqs]
    captured = capture_model(str(tmp_path))
    with serve(captured, tensor_parallel_placement(captured, 2), threads=1) as server:
        assert [g.ranks for g in server.plan.tp_groups] == [[0, 1]]
        handles = [server.submit(r, walk="prefill_ext") for r in reqs]
        outs = [h.result(timeout=600) for h in handles]
    assert_replies([generated(o) for o in outs], want)
    worst = 0.0
    for out, w in zip(outs, want):
        values = torch.cat([out["logprob"], *[out[k] for k in ("logprobs",) if k in out]], 1)
        ids = torch.cat([out["logprob_id"], *[out[k] for k in ("logprob_ids",) if k in out]], 1)
        assert values.shape == ids.shape == (1, len(w.tokens), LOGPROBS)
        for k in range(len(w.tokens) if w.tie is None else w.tie + 1):
            assert int(ids[0, k, 0]) == w.tokens[k]
            ref = w.logprobs[k]
            top = ref.topk(LOGPROBS - 1).values  # the most likely, by value: ties in any order
            for got, expected in ((values[0, k], ref[ids[0, k]]), (values[0, k, 1:], top)):
                err = (got - expected).abs() / expected.abs().clamp(min=1.0)
                worst = max(worst, float(err.max()))
    assert worst <= LOGPROB_TOL, worst
