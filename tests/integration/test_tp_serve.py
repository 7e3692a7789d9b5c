"""Tensor parallelism and replicas served end to end: ``serve()`` of a saved tiny Llama checkpoint
(``save_pretrained``) with every component as one TP group of two worker processes (gloo),
then as two replicas of one rank each, then both (two replicas of a TP=2 group: four ranks).

Each time, 8 concurrent greedy requests equal ``generate(do_sample=False)`` for that request
alone (logits sharpened, facts.md). TP=2: the follower rank is in no node's ranks (work goes to
the leader), each rank holds half the KV heads; replicas: both replicas ran batches (the
batcher's per-rank counters) and every request's decode stayed on the replica holding its
KV cache (a wrong replica cannot resolve the cache: the request would fail). Two replicas of
TP=2: a SIGKILLed follower fails only its group's requests; the other group serves on."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading path needs it

from test_served_lm import Reference, assert_replies, reference, save_tiny, serve_all  # noqa: E402

from walkserve.adapters.hf_causal_lm import sample_request  # noqa: E402
from walkserve.adapters.registry import capture_model  # noqa: E402
from walkserve.capture.model import CapturedModel  # noqa: E402
from walkserve.lowering.placement import tensor_parallel_placement  # noqa: E402
from walkserve.runtime.server import RequestFailed, Server, serve  # noqa: E402

REQUESTS = 8
Checkpoint = tuple[CapturedModel, list[dict[str, Any]], list[list[int]], torch.nn.Module]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The checkpoint of ``test_served_lm`` (sharpened tiny Llama, 4 heads, 2 KV heads), 8
    requests (prompts 2..29 tokens, 2..11 new) and their ``generate`` tokens."""
    path = tmp_path_factory.mktemp("tiny-llama")
    lm = save_tiny("llama", path)
    g = torch.Generator().manual_seed(3)
    reqs = []
    for _ in range(REQUESTS):
        prompt = int(torch.randint(2, 30, (1,), generator=g))
        new = int(torch.randint(2, 12, (1,), generator=g))
        reqs.append(sample_request(torch.randint(3, 256, (prompt,), generator=g).tolist(), new))
    return capture_model(str(path)), reqs, [reference(lm, r) for r in reqs], lm


@pytest.mark.parametrize(
    ("tp", "replicas"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "replicas2", "tp2x2"]
)
def test_greedy_tokens_equal_generate(checkpoint: Checkpoint, tp: int, replicas: int) -> None:
    captured, reqs, want, lm = checkpoint
    placement = tensor_parallel_placement(captured, tp, replicas)
    with serve(captured, placement, threads=1) as server:
        assert [g.ranks for g in server.plan.tp_groups] == (
            [list(range(k * tp, (k + 1) * tp)) for k in range(replicas)] if tp > 1 else []
        )
        leaders = list(range(0, tp * replicas, tp))
        dispatched = {r for w in server.plan.walks for n in server.plan.nodes(w) for r in n.ranks}
        assert dispatched == set(leaders)  # followers run what their leader sends them
        assert_replies(serve_all(server, reqs), want)
        assert_replies(serve_all(server, reqs[:2]), want[:2])  # the group goes on after a crowd
        if replicas > 1:
            per_rank = server.batcher.per_rank
            assert all(per_rank.get(r, 0) > 0 for r in leaders), per_rank
        assert all(h.status == "ready" for h in server.health().values())
        if tp > 1 and replicas > 1:
            killing_a_follower_fails_only_its_groups_requests(server, reqs, want, lm)


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
