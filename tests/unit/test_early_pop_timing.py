"""When the next pop goes out during a text generation (service.pop_ahead.EarlyPopTiming),
and the pop gate's view of koboldcpp busy with the worker's own generation."""

from __future__ import annotations

import pytest

from koboldcpp_horde_chat.service.pop_ahead import (
    EARLY_POP_MARGIN_S,
    EARLY_POP_MIN_GEN_S,
    EarlyPopTiming,
)


def test_no_pop_during_a_generation_before_one_was_measured() -> None:
    timing = EarlyPopTiming()
    assert timing.delay_s(64) is None
    timing.popped(0.15)
    assert timing.delay_s(64) is None  # no generation measured yet
    timing = EarlyPopTiming()
    timing.generated(2.0, 64)
    assert timing.delay_s(64) is None  # no pop's round trip measured yet


def test_the_pop_is_timed_to_answer_before_the_fastest_generation_would_end() -> None:
    timing = EarlyPopTiming()
    timing.popped(0.15)
    timing.generated(3.2, 64)  # 50 ms a token
    timing.generated(1.6, 64)  # 25 ms a token: the fastest
    timing.generated(2.4, 64)
    assert timing.delay_s(128) == pytest.approx(3.2 - 0.15 - EARLY_POP_MARGIN_S)


def test_a_generation_expected_short_gets_its_next_pop_beside_its_submit() -> None:
    timing = EarlyPopTiming()
    timing.popped(0.15)
    timing.generated(0.1, 4)
    assert 0.1 / 4 * 32 < EARLY_POP_MIN_GEN_S
    assert timing.delay_s(32) is None
    assert timing.delay_s(4000) is not None


def test_a_generation_shorter_than_the_round_trip_pops_at_its_start() -> None:
    timing = EarlyPopTiming()
    timing.popped(2.0)
    timing.generated(1.5, 60)
    assert timing.delay_s(60) == 0.0


def test_the_round_trip_follows_the_pops() -> None:
    timing = EarlyPopTiming()
    timing.popped(0.2)
    timing.popped(None)  # a failed pop measures nothing
    timing.popped(0.4)
    assert timing.round_trip_s == pytest.approx(0.3)
