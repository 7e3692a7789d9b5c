"""HTTP admission (``api.admission``): a completion counts its ``n`` choices, ``n`` over the
limit is a 400 naming it, and the gate (``Server.unavailable``) answers 503 with Retry-After
while a rank restarts or the server drains."""

from __future__ import annotations

import pytest

from walkserve.api.admission import Admission
from walkserve.api.errors import ApiError


def test_admission_counts_choices_and_its_gate_answers_503_with_retry_after() -> None:
    reason: list[str | None] = [None]
    admission = Admission(4, gate=lambda: reason[0], retry_after_s=2)
    three = admission.admit(3)
    with pytest.raises(ApiError) as busy:
        admission.admit(2)
    assert busy.value.status == 503 and busy.value.kind == "server_busy"
    one = admission.admit(1)
    three.release()
    three.release()  # idempotent
    assert admission.active == 1
    with pytest.raises(ApiError) as too_many:
        admission.admit(5)
    assert too_many.value.status == 400 and too_many.value.param == "n"
    reason[0] = "worker rank 0 is restarting (restart 1)"
    with pytest.raises(ApiError) as gated:
        admission.admit()
    assert gated.value.status == 503 and gated.value.headers == {"Retry-After": "2"}
    assert "restarting" in gated.value.message
    one.release()
    assert admission.active == 0


def test_a_walk_over_the_limit_names_its_batched_input() -> None:
    admission = Admission(4)
    with pytest.raises(ApiError) as rows:
        admission.admit(5, "inputs.prompt_ids")
    assert rows.value.status == 400 and rows.value.param == "inputs.prompt_ids"
    assert "inputs.prompt_ids: 5 rows are more than this server runs at once" in rows.value.message
    admission.admit(4, "inputs.prompt_ids").release()
    assert admission.active == 0
