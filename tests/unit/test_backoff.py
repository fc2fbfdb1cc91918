"""Backoff (equal jitter, Retry-After) and EmptyPopBackoff (koboldcpp's 1/2/3 s steps)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from koboldcpp_horde_chat.service.backoff import Backoff, EmptyPopBackoff


class FixedRandom(random.Random):
    """uniform(a, b) returns a + fraction * (b - a)."""

    def __init__(self, fraction: float) -> None:
        super().__init__(0)
        self.fraction = fraction

    def uniform(self, a: float, b: float) -> float:
        return a + self.fraction * (b - a)


def test_delays_double_from_the_base_up_to_the_cap_at_the_top_of_the_jitter() -> None:
    b = Backoff(1.0, 60.0, rng=FixedRandom(1.0))
    assert [b.next_delay() for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_equal_jitter_never_goes_below_half_the_exponential_delay() -> None:
    b = Backoff(1.0, 60.0, rng=FixedRandom(0.0))
    assert [b.next_delay() for _ in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


@given(seed=st.integers(0, 2**32), base=st.floats(0.01, 10), n=st.integers(1, 40))
def test_every_delay_lies_within_half_and_whole_of_the_capped_exponential(
    seed: int, base: float, n: int
) -> None:
    cap = base * 20
    b = Backoff(base, cap, rng=random.Random(seed))
    bound = base
    for _ in range(n):
        d = b.next_delay()
        assert bound / 2 - 1e-9 <= d <= bound + 1e-9
        bound = min(cap, bound * 2)


def test_the_same_seed_gives_the_same_delays() -> None:
    a = Backoff(1.0, 30.0, rng=random.Random(7))
    b = Backoff(1.0, 30.0, rng=random.Random(7))
    assert [a.next_delay() for _ in range(6)] == [b.next_delay() for _ in range(6)]


def test_reset_starts_the_schedule_again() -> None:
    b = Backoff(2.0, 60.0, rng=FixedRandom(1.0))
    b.next_delay()
    b.next_delay()
    b.next_delay()
    assert b.attempts == 3
    b.reset()
    assert b.attempts == 0
    assert b.next_delay() == 2.0


def test_retry_after_is_a_floor_for_the_delay() -> None:
    b = Backoff(1.0, 60.0, rng=FixedRandom(1.0))
    assert b.next_delay(retry_after_s=30.0) == 30.0
    assert b.next_delay(retry_after_s=0.5) == 2.0  # the schedule's delay is larger
    assert b.next_delay(retry_after_s=None) == 4.0


def test_retry_after_above_the_cap_is_honoured_up_to_the_generous_max() -> None:
    b = Backoff(1.0, 60.0, rng=FixedRandom(1.0))
    assert b.next_delay(retry_after_s=120.0) == 120.0
    assert b.next_delay(retry_after_s=86400.0) == 600.0


@pytest.mark.parametrize("bad", [-5.0, float("nan"), float("inf"), 0.0])
def test_a_nonsense_retry_after_is_ignored(bad: float) -> None:
    b = Backoff(1.0, 60.0, rng=FixedRandom(1.0))
    assert b.next_delay(retry_after_s=bad) == 1.0


def test_a_huge_number_of_attempts_does_not_overflow() -> None:
    b = Backoff(1.0, 60.0, rng=FixedRandom(1.0))
    for _ in range(2000):
        d = b.next_delay()
    assert d == 60.0


def test_empty_pops_wait_1s_then_2s_after_10_then_3s_after_25() -> None:
    e = EmptyPopBackoff()
    delays = [e.next_delay() for _ in range(30)]
    assert delays == [1.0] * 10 + [2.0] * 15 + [3.0] * 5


def test_a_job_resets_the_empty_pop_wait_to_one_second() -> None:
    e = EmptyPopBackoff()
    for _ in range(26):
        e.next_delay()
    assert e.next_delay() == 3.0
    e.reset()
    assert e.empty_pops == 0
    assert e.next_delay() == 1.0
