"""Retry delays (pure; computes seconds, never sleeps).

Two policies:

* :class:`Backoff`: exponential backoff with *equal jitter* for retrying a call
  that failed (a Horde 5xx or 429, a lost connection, a busy koboldcpp). The
  n-th delay (n = 0, 1, ...) is drawn uniformly from ``[d/2, d]`` with
  ``d = min(cap_s, base_s * factor**n)``. Equal jitter rather than full jitter
  (``[0, d]``): it still spreads workers apart, but never retries at once
  against a server that just said it is overloaded. A server's ``Retry-After``
  is a floor for the delay.
* :class:`EmptyPopBackoff`: the wait after a pop that returned no job, the same
  steps as koboldcpp's embedded worker (1.116.1 ``koboldcpp.py`` L10158-10160):
  1 s, then 2 s after 10 empty pops in a row, then 3 s after 25.

Seed section: "The pop loop" (a pop without a job is followed by another pop).
"""

from __future__ import annotations

import math
import random

RETRY_AFTER_CAP_S = 600.0
"""The longest ``Retry-After`` honoured (seconds), unless ``cap_s`` is larger."""


class Backoff:
    """Exponential backoff with equal jitter.

    Args:
        base_s: the first delay's upper bound, seconds (> 0).
        cap_s: the largest delay drawn from the exponential schedule, seconds
            (>= base_s).
        factor: growth per attempt (>= 1).
        rng: the random source (a seeded ``random.Random`` in tests).
        retry_after_cap_s: the largest delay a server's ``Retry-After`` can ask
            for, seconds; the effective ceiling is ``max(cap_s, retry_after_cap_s)``.

    Raises:
        ValueError: on a non-positive base, a cap below the base or a factor below 1.
    """

    def __init__(
        self,
        base_s: float,
        cap_s: float,
        *,
        factor: float = 2.0,
        rng: random.Random | None = None,
        retry_after_cap_s: float = RETRY_AFTER_CAP_S,
    ) -> None:
        if not base_s > 0 or not math.isfinite(base_s):
            raise ValueError(f"base_s must be a positive number of seconds, not {base_s!r}")
        if not cap_s >= base_s or not math.isfinite(cap_s):
            raise ValueError(f"cap_s must be at least base_s ({base_s}), not {cap_s!r}")
        if not factor >= 1 or not math.isfinite(factor):
            raise ValueError(f"factor must be at least 1, not {factor!r}")
        self.base_s = base_s
        self.cap_s = cap_s
        self.factor = factor
        self.retry_after_cap_s = max(cap_s, retry_after_cap_s)
        self._rng = rng if rng is not None else random.Random()
        self._bound = base_s
        self.attempts = 0

    def next_delay(self, retry_after_s: float | None = None) -> float:
        """The delay before the next retry, seconds; advances the schedule.

        Args:
            retry_after_s: the server's ``Retry-After`` in seconds, when it sent
                one. The delay is then at least this value, but never more than
                ``max(cap_s, retry_after_cap_s)``. Negative or non-finite values
                are ignored.

        Returns:
            A delay in ``[d/2, d]`` (``d = min(cap_s, base_s * factor**attempts)``),
            raised to ``retry_after_s`` when that is larger.
        """
        bound = self._bound
        delay = bound / 2 + self._rng.uniform(0.0, bound / 2)
        self.attempts += 1
        self._bound = min(self.cap_s, bound * self.factor)
        if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s > 0:
            delay = max(delay, min(retry_after_s, self.retry_after_cap_s))
        return delay

    def reset(self) -> None:
        """Start the schedule again (after a success)."""
        self._bound = self.base_s
        self.attempts = 0


class EmptyPopBackoff:
    """The wait after an empty pop: 1 s, 2 s after 10 empty pops in a row, 3 s after 25.

    Call ``next_delay()`` after each pop that returned no job and ``reset()``
    after a pop that returned one.

    Attributes:
        empty_pops: empty pops in a row so far.
    """

    STEPS: tuple[tuple[int, float], ...] = ((25, 3.0), (10, 2.0))
    """(more than this many empty pops, delay in seconds), largest first."""
    FIRST_DELAY_S = 1.0
    LOW_POWER_AFTER = 20
    """koboldcpp logs "entering low power mode" at this many empty pops."""

    def __init__(self) -> None:
        self.empty_pops = 0

    def next_delay(self) -> float:
        """Count one more empty pop and return the wait before the next pop, seconds.

        Returns:
            1.0 for empty pops 1 to 10, 2.0 for 11 to 25, 3.0 from the 26th on.
        """
        self.empty_pops += 1
        for after, delay in self.STEPS:
            if self.empty_pops > after:
                return delay
        return self.FIRST_DELAY_S

    @property
    def low_power(self) -> bool:
        """True once the worker has seen ``LOW_POWER_AFTER`` empty pops in a row."""
        return self.empty_pops >= self.LOW_POWER_AFTER

    def reset(self) -> None:
        """A pop returned a job: start again at 1 s."""
        self.empty_pops = 0
