"""Unmodified Hugging Face causal LMs served from a checkpoint directory by real worker
processes, continuously batched over the paged KV pool: every request's tokens equal
``generate(do_sample=False)`` for that request alone, with a pool big enough for all and with
one deliberately too small (eviction and recompute asserted); shared prefixes reuse pages; all
pages return to the pool when the requests are over or cancelled."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from walkserve.adapters.hf_causal_lm import sample_request  # noqa: E402
from walkserve.runtime.config import PoolConfig  # noqa: E402
from walkserve.runtime.messages import KVStats  # noqa: E402
from walkserve.runtime.server import Server, serve  # noqa: E402

EOS = 2
#: The tiny Qwen3-MoE's experts: every layer sparse, 4 experts, 2 per token.
QWEN3_MOE: dict[str, Any] = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)


def save_tiny(arch: str, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=1024,
        initializer_range=0.15,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
    )
    if arch == "llama":
        lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen2":
        lm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "qwen3":
        lm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    else:
        config = transformers.Qwen3MoeConfig(head_dim=8, **QWEN3_MOE, **common)
        lm = transformers.Qwen3MoeForCausalLM(config)
    lm.eval().save_pretrained(path)
    return lm


def requests(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Prompt lengths in 1..300, output lengths in 1..200 (the first and last of each range
    always present)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(1, 1), (300, 200)] + [
        (
            int(torch.randint(1, 301, (1,), generator=g)),
            int(torch.randint(1, 201, (1,), generator=g)),
        )
        for _ in range(count - 2)
    ]
    return [
        sample_request(torch.randint(3, 256, (p,), generator=g).tolist(), n) for p, n in lengths
    ]


def generated(outputs: dict[str, Any]) -> list[int]:
    tokens = [int(outputs["token"])]
    return tokens + (outputs["tokens"][0].tolist() if "tokens" in outputs else [])


TIE = 1e-3  # logits this close are a float tie: another summation order may pick either


@dataclass(frozen=True)
class Reference:
    """``generate``'s greedy tokens for one request, and ``tie``: the first step whose best two
    logits are within ``TIE`` (random weights make a few; a batch's different summation order
    may choose either token there, and the rest of the reply follows that choice), or None;
    ``logprobs``: each step's log-softmax of ``generate``'s logits, ``[vocab]`` float32."""

    tokens: list[int]
    top2: list[tuple[int, int]]
    tie: int | None
    logprobs: tuple[torch.Tensor, ...] = ()

    def matches(self, got: list[int]) -> bool:
        if self.tie is None:
            return got == self.tokens
        k = self.tie
        return got[:k] == self.tokens[:k] and len(got) > k and got[k] in self.top2[k]


def reference(lm: torch.nn.Module, r: dict[str, Any]) -> Reference:
    ids = r["input_ids"]
    with torch.no_grad():
        out = lm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=r["max_new_tokens"],
            eos_token_id=EOS,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = []
    tie = None
    for step, logits in enumerate(out.logits):
        values, indices = logits[0].topk(2)
        top2.append((int(indices[0]), int(indices[1])))
        if tie is None and float(values[0] - values[1]) < TIE:
            tie = step
    logprobs = tuple(torch.log_softmax(x[0].float(), -1) for x in out.logits)
    return Reference(out.sequences[0, ids.shape[1] :].tolist(), top2, tie, logprobs)


def assert_replies(got: list[list[int]], want: list[Reference]) -> None:
    assert sum(w.tie is not None for w in want) <= len(want) // 4  # still a test of the tokens
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not w.matches(g)]
    assert not bad, [(i, got[i], want[i].tokens, want[i].tie) for i in bad]


def pool_stats(server: Server, settle: bool = True) -> KVStats:
    """The worker's pool as of a heartbeat; with ``settle``, once no page is in use (the
    caches of finished requests are freed when the worker drops them)."""
    deadline = time.monotonic() + 30
    while True:
        kv = server.kv_stats()[0]
        if kv and (not settle or kv[0].pages_in_use == 0 or time.monotonic() > deadline):
            return kv[0]
        time.sleep(0.2)


def serve_all(server: Server, reqs: list[dict[str, Any]]) -> list[list[int]]:
    handles = [server.submit(r) for r in reqs]  # all in flight at once
    return [generated(h.result(timeout=600)) for h in handles]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sixteen_concurrent_requests_match_generate(arch: str, tmp_path: Path) -> None:
    lm = save_tiny(arch, tmp_path)
    reqs = requests(16)
    want = [reference(lm, r) for r in reqs]
    with serve(str(tmp_path)) as server:
        assert_replies(serve_all(server, reqs), want)
        assert max(server.batch_sizes) > 1  # steps of different requests shared forwards
        stats = pool_stats(server)
        assert stats.pages_in_use == 0 and stats.live_sequences == 0
        assert server.stats().live_requests == 0


def test_a_pool_too_small_for_all_requests_evicts_and_stays_exact(tmp_path: Path) -> None:
    lm = save_tiny("llama", tmp_path)
    reqs = requests(16, seed=1)
    want = [reference(lm, r) for r in reqs]
    # 40 pages of 16 tokens: the longest request alone needs 32 of them.
    config = PoolConfig(kv_pool_tokens=640, kv_page_size=16)
    with serve(str(tmp_path), pool_config=config) as server:
        assert_replies(serve_all(server, reqs), want)
        stats = pool_stats(server)
        assert stats.num_pages == 40
        assert stats.evictions > 0  # preemption happened
        assert stats.pages_in_use == 0


def test_shared_prefixes_reuse_pages_and_cancelled_requests_free_theirs(tmp_path: Path) -> None:
    lm = save_tiny("qwen2", tmp_path)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 256, (160,), generator=g).tolist()
    reqs = [sample_request([*prefix, 10 + i, 20 + i], 8) for i in range(4)]
    want = [reference(lm, r) for r in reqs]
    with serve(str(tmp_path), pool_config=PoolConfig(kv_page_size=16)) as server:
        first = serve_all(server, reqs[:1])
        rest = serve_all(server, reqs[1:])
        assert_replies(first + rest, want)
        assert pool_stats(server).prefix_hits >= 3 * (160 // 16)
        long = [server.submit(sample_request([*prefix, i], 200)) for i in range(3)]
        time.sleep(0.5)
        for handle in long:
            handle.cancel()
        stats = pool_stats(server)
        assert stats.pages_in_use == 0 and stats.live_sequences == 0
