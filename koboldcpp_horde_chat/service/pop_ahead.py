"""The next pop, sent on a thread of its own beside a job's submit, or during
a long text generation.

koboldcpp's own worker overlaps its submit with the next pop; so does this
worker's loop (``service.loop``), and a job the early pop brings is taken in
hand (``run.driver.JobDriver.take_in_hand``) on this thread as soon as the
answer arrives (journaled before the loop is free to serve it). During a
text generation that koboldcpp's past ones say is long, the next pop goes out
before it ends, timed by :class:`EarlyPopTiming`, so that koboldcpp waits for
no round trip to the Horde between two jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import HordeError, HordeUnavailable
from ..horde.api import HordeAPI
from ..state.job import JobContext

log = logging.getLogger("koboldcpp_horde_chat.submit")

#: A text generation expected to last this many seconds or more gets the next pop
#: during it; a shorter one, beside its submit.
EARLY_POP_MIN_GEN_S = 1.0
#: Seconds, on top of the pops' round trip, by which the pop sent during a
#: generation is to be answered before the generation may end.
EARLY_POP_MARGIN_S = 0.25
#: The text generations the timing goes by (the fastest of them, per token).
EARLY_POP_SAMPLES = 8
#: Weight of the newest pop in the running round trip.
ROUND_TRIP_WEIGHT = 0.5


class EarlyPopTiming:
    """When the next pop goes out during a text generation (pure; monotonic seconds).

    It keeps koboldcpp's last :data:`EARLY_POP_SAMPLES` text generations, as
    seconds per token of the job's ``max_length``, and a running round trip of
    the pops. A generation of ``max_length`` tokens is taken to last at least
    the fastest of them times ``max_length``; the pop goes out that long after
    its start less the round trip and :data:`EARLY_POP_MARGIN_S`, so that its
    answer is in before the generation ends (a slower one leaves the job in
    hand a moment; a faster one, the loop wakes the pop at its end).
    """

    def __init__(self) -> None:
        self._per_token: deque[float] = deque(maxlen=EARLY_POP_SAMPLES)
        self.round_trip_s: float | None = None

    def generated(self, seconds: float, max_length: int) -> None:
        """A text generation of a job of ``max_length`` tokens lasted ``seconds``."""
        if seconds >= 0 and max_length > 0:
            self._per_token.append(seconds / max_length)

    def popped(self, round_trip_s: float | None) -> None:
        """A pop was answered ``round_trip_s`` after it was sent (None: not measured)."""
        if round_trip_s is None or round_trip_s < 0:
            return
        old = self.round_trip_s
        self.round_trip_s = (
            round_trip_s if old is None else old + ROUND_TRIP_WEIGHT * (round_trip_s - old)
        )

    def delay_s(self, max_length: int) -> float | None:
        """Seconds after the start of a text generation of ``max_length`` tokens at
        which the next pop goes out; None: not during it (nothing measured yet,
        or the generation is expected shorter than :data:`EARLY_POP_MIN_GEN_S`)."""
        if not self._per_token or self.round_trip_s is None or max_length <= 0:
            return None
        expected = min(self._per_token) * max_length
        if expected < EARLY_POP_MIN_GEN_S:
            return None
        return max(0.0, expected - self.round_trip_s - EARLY_POP_MARGIN_S)


class TakeInHand(Protocol):
    """The driver's ``take_in_hand`` (``run.driver.JobDriver.take_in_hand``)."""

    def __call__(
        self,
        body: dict[str, Any],
        pop: dict[str, Any],
        popped_at: float,
        *,
        pop_wait_s: float = 0.0,
    ) -> JobContext | None: ...


class PopAhead:
    """The next pop, sent on a thread of its own while the loop submits a job.

    koboldcpp's own worker submits on a thread of its own so that its next pop
    overlaps the submit; this is the same overlap the other way round: the
    terminal action goes out on the loop's thread and the pop beside it. The
    thread first asks ``prepare`` for the pop body (the loop's checks of
    whether to pop now, which may read koboldcpp: the submit does not wait for
    them); None means no pop (``skipped``). When the pop answers, ``take_in_hand``
    takes the job it carries in hand on this thread at once (journaled before
    the loop is free to serve it). ``join()`` waits for the thread: then
    ``answer`` (the pop's JSON) or ``error`` (a ``HordeError``) is set,
    ``popped_at`` (monotonic seconds) is when it arrived and ``ctx`` the job
    in hand (None when the answer carried no job id); ``round_trip_s`` the
    pop's round trip in seconds (None: no pop, or it failed).

    Args:
        horde: a Horde client used by no other thread meanwhile.
        prepare: returns the pop body, or None not to pop now.
        take_in_hand: takes ``(body, answer, popped_at, pop_wait_s=...)`` and
            returns the job in hand, or None (the loop's driver's).
        timeout_s: the pop's read timeout, seconds.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        horde: HordeAPI,
        prepare: Callable[[], dict[str, Any] | None],
        take_in_hand: TakeInHand,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.body: dict[str, Any] = {}
        self.skipped = False
        self.answer: dict[str, Any] | None = None
        self.error: HordeError | None = None
        self.popped_at = 0.0
        self.ctx: JobContext | None = None
        self.round_trip_s: float | None = None
        self._horde = horde
        self._prepare = prepare
        self._take_in_hand = take_in_hand
        self._timeout_s = timeout_s
        self._clock = clock
        self._thread = threading.Thread(target=self._run, name="horde-pop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Let the loop's thread have the interpreter first: its submit goes on
        # the wire before this thread's Python work, which then runs while the
        # submit waits for its answer.
        time.sleep(0)
        try:
            body = self._prepare()
        except Exception:  # the loop pops the usual way instead, and logs what breaks there
            log.debug("the pop beside the submit was not prepared", exc_info=True)
            body = None
        if body is None:
            self.skipped = True
            return
        self.body = body
        sent_at = self._clock()
        try:
            answer = self._horde.pop(body, timeout_s=self._timeout_s)
        except HordeError as exc:
            self.error = exc
        except Exception as exc:  # handed to the loop, which logs it
            self.error = HordeUnavailable(f"pop failed: {type(exc).__name__}")
        else:
            self.popped_at = self._clock()
            self.round_trip_s = self.popped_at - sent_at
            try:
                self.ctx = self._take_in_hand(
                    body, answer, self.popped_at, pop_wait_s=self.popped_at - sent_at
                )
            except Exception:  # the loop takes the job in hand itself
                log.debug("the job popped beside the submit was not received", exc_info=True)
            self.answer = answer
            return
        self.popped_at = self._clock()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the pop (at most ``timeout_s``); True when it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
