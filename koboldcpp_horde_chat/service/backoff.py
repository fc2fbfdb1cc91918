"""Retry delays (pure; computes seconds, never sleeps).

:class:`Backoff` retries a failed call with exponential backoff and *equal
jitter*: the n-th delay is drawn from ``[d/2, d]``, ``d = min(cap_s, base_s *
2**n)``, so it spreads workers apart yet never retries at once against a
server that said it is overloaded; a ``Retry-After`` is a floor.
:class:`EmptyPopBackoff` waits after a pop without a job as koboldcpp's own
worker does (1.116.1 ``koboldcpp.py`` L10158-10160).
"""

from __future__ import annotations

import math
import random

RETRY_AFTER_CAP_S = 600.0
"""The longest ``Retry-After`` honoured (seconds)."""


class Backoff:
    """Exponential backoff with equal jitter, seconds, each bound twice the last;
    a ``Retry-After`` may ask for up to :data:`RETRY_AFTER_CAP_S`."""

    def __init__(self, base_s: float, cap_s: float, *, rng: random.Random | None = None) -> None:
        self.base_s, self.cap_s = base_s, cap_s
        self._rng = rng if rng is not None else random.Random()
        self.reset()

    def reset(self) -> None:
        """Start the schedule again (after a success)."""
        self._bound = self.base_s
        self.attempts = 0

    def next_delay(self, retry_after_s: float | None = None) -> float:
        """The delay before the next retry, seconds, at least a positive finite
        ``retry_after_s``; advances the schedule."""
        bound = self._bound
        delay = bound / 2 + self._rng.uniform(0.0, bound / 2)
        self.attempts += 1
        self._bound = min(self.cap_s, bound * 2)
        if retry_after_s is not None and 0 < retry_after_s < math.inf:
            delay = max(delay, min(retry_after_s, RETRY_AFTER_CAP_S))
        return delay


class EmptyPopBackoff:
    """The wait after an empty pop: 1 s, 2 s after 10 empty pops in a row, 3 s after 25."""

    STEPS: tuple[tuple[int, float], ...] = ((25, 3.0), (10, 2.0))
    """(more than this many empty pops, delay in seconds), largest first."""
    FIRST_DELAY_S = 1.0

    def __init__(self) -> None:
        self.empty_pops = 0

    def next_delay(self) -> float:
        """Count one more empty pop: the wait before the next pop, seconds."""
        self.empty_pops += 1
        for after, delay in self.STEPS:
            if self.empty_pops > after:
                return delay
        return self.FIRST_DELAY_S

    def reset(self) -> None:
        """A pop returned a job: start again at 1 s."""
        self.empty_pops = 0
