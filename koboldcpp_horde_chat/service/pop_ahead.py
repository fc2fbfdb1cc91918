"""The next pop, sent on a thread of its own beside a job's submit.

koboldcpp's own worker overlaps its submit with the next pop; so does this
worker's loop (``service.loop``), and a job the early pop brings is taken in
hand (``run.driver.JobDriver.take_in_hand``) on this thread as soon as the
answer arrives (journaled before the loop is free to serve it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import HordeError, HordeUnavailable
from ..horde.api import HordeAPI
from ..state.job import JobContext

log = logging.getLogger("koboldcpp_horde_chat.submit")


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
    in hand (None when the answer carried no job id).

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
