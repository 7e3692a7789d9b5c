"""Bounded work with a real worker (issue 17, item 6): ``serve(limits=...)`` refuses a request
over its limits before admission, naming the input; and chunked prefill keeps one long prompt
from starving the others: with 8 tokens a forward, a 480-token prompt sent first finishes
after three short requests sent behind it (the order in which the conductor finishes them,
not a timing), every token the reference's."""

from __future__ import annotations

from typing import Any

import pytest
from waiting import settled, wait_for

from walkserve.capture import InputError
from walkserve.runtime.config import PoolConfig
from walkserve.runtime.handle import RequestHandle
from walkserve.runtime.limits import WalkLimits
from walkserve.runtime.server import serve
from walkserve.testing import assert_outputs_match

pytest.importorskip("transformers")


def test_limits_refuse_and_a_long_prompt_does_not_starve_short_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from walkserve.adapters.hf_causal_lm import sample_request
    from walkserve.adapters.registry import capture_model

    finished: list[str] = []  # request ids in the order the conductor thread ends them
    end = RequestHandle._finish

    def record(self: RequestHandle, *args: Any) -> None:
        finished.append(self.request_id)
        end(self, *args)

    monkeypatch.setattr(RequestHandle, "_finish", record)
    captured = capture_model("tiny-llama")
    pool = PoolConfig(kv_page_size=8, kv_step_tokens=8)
    limits = WalkLimits(max_input_length=500, max_loop_bound=64)
    with serve(captured, pool_config=pool, limits=limits) as server:
        for request, name in (
            (sample_request([7] * 501, 2), "input_ids"),
            (sample_request([7, 8], 65), "max_new_tokens"),
        ):
            with pytest.raises(InputError) as e:
                server.submit(request, "prefill")
            assert e.value.input == name and e.value.rule == "limit"
        long = sample_request([3 + (5 * k) % 90 for k in range(480)], 2)
        shorts = [sample_request([5 + k, 9, 12], 6) for k in range(3)]
        handles: dict[str, tuple[RequestHandle, dict[str, Any]]] = {}
        for rid, request in [("long", long), *((f"short{k}", r) for k, r in enumerate(shorts))]:
            handles[rid] = (server.submit(request, "prefill", request_id=rid), request)
        for handle, request in handles.values():
            assert_outputs_match(handle.result(timeout=120), captured.run(request, "prefill"))
        assert finished[-1] == "long", finished

        # each chunk of the prompt went on from the pages of the ones before (prefix hits)
        def hits() -> int:
            pools = server.kv_stats().get(0) or []  # as of the rank's last heartbeat
            return pools[0].prefix_hits if pools else 0

        assert wait_for(lambda: hits() >= 480 // 8 - 1), hits()
        assert wait_for(lambda: settled(server)), server.stats()
