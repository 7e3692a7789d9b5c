"""``BurstHold``: a rank with nothing else to run holds a burst's first chunks until its last
arrives or ``hold_s`` has passed; a busy rank never holds. A fake clock, no processes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from walkserve.runtime.burst import BurstHold


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_an_idle_rank_holds_a_burst_until_its_last_chunk() -> None:
    clock = Clock()
    hold = BurstHold(0.005, clock)
    assert hold.left() == 0.0
    hold.starts(more=True, idle=True)
    assert abs(hold.left() - 0.005) < 1e-9
    clock.t += 0.002
    hold.starts(more=True, idle=False)  # the second chunk: the first's runs wait, still held
    assert abs(hold.left() - 0.003) < 1e-9  # the deadline is the first chunk's
    hold.starts(more=False, idle=False)  # the last chunk
    assert hold.left() == 0.0
    assert hold.holds == 1


def test_a_busy_rank_does_not_hold() -> None:
    hold = BurstHold(0.005, Clock())
    hold.starts(more=True, idle=False)  # runs of its own keep stepping: the burst joins them
    assert hold.left() == 0.0
    assert hold.holds == 0


def test_a_hold_ends_at_its_deadline_and_the_rest_of_the_burst_joins() -> None:
    clock = Clock()
    hold = BurstHold(0.005, clock)
    hold.starts(more=True, idle=True)
    clock.t += 0.005
    assert hold.left() == 0.0  # the rest is late: the held runs step
    hold.starts(more=True, idle=False)  # the late chunk finds them running: no new hold
    assert hold.left() == 0.0
    assert hold.holds == 1


def test_a_message_without_more_never_holds() -> None:
    hold = BurstHold(0.005, Clock())
    hold.starts(more=False, idle=True)  # one message for the whole pass, as a lone request
    assert hold.left() == 0.0


@given(
    st.lists(
        st.tuples(st.booleans(), st.booleans(), st.floats(0.0, 0.004)), min_size=1, max_size=30
    )
)
def test_a_hold_is_bounded_and_follows_its_rule(events: list[tuple[bool, bool, float]]) -> None:
    """Against a model of the rule: holding iff some chunk with ``more`` reached the rank idle
    and not holding, less than ``hold_s`` ago, with no chunk without ``more`` since."""
    clock = Clock()
    hold = BurstHold(0.005, clock)
    since: float | None = None  # the model's hold start
    for more, idle, dt in events:
        clock.t += dt
        if since is not None and clock.t - since >= 0.005:
            since = None  # its deadline passed
        hold.starts(more, idle)
        if not more:
            since = None
        elif since is None and idle:
            since = clock.t
        left = hold.left()
        assert 0.0 <= left <= 0.005
        assert (left > 0) == (since is not None)
        if since is not None:
            assert abs(left - (since + 0.005 - clock.t)) < 1e-9


def test_the_ranks_held_bursts_are_a_metric() -> None:
    from types import SimpleNamespace

    from walkserve.api.metrics import _component_counters

    ranks = {1: SimpleNamespace(counters={"burst/holds": 3, "loop_stepper/lane_steps": 7})}
    families = {f.name: f for f in _component_counters(["m"], ranks)}
    (sample,) = families["walkserve:holds"].samples
    assert sample.labels == {"model_name": "m", "rank": "1", "component": "burst"}
    assert sample.value == 3
