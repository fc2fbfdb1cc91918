"""The next pop, sent ahead on a thread of its own: beside a job's submit, as
koboldcpp's own worker does, or during a text generation that koboldcpp's past
ones say is long, so that koboldcpp waits for no round trip between two jobs.
The job it brings is journaled on the pop's thread at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import HordeError, HordeUnavailable
from ..horde.api import HordeAPI
from ..horde.pop import PopAnswer, read_pop
from ..koboldcpp.manners import OWN_TAIL_S
from ..state.job import JobContext, Outcome
from .gate import OWN_TAIL_POLL_S

if TYPE_CHECKING:
    from .loop import Worker

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
    """When the next pop goes out during a text generation (pure; seconds).

    A generation of ``max_length`` tokens is taken to last at least the fastest
    of the last :data:`EARLY_POP_SAMPLES` per token; the pop goes out that long
    after its start less the pops' running round trip and
    :data:`EARLY_POP_MARGIN_S`, so that its answer is in before the generation
    ends (one that ends sooner wakes the pop at once).
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
        self.round_trip_s = round_trip_s if old is None else (
            old + ROUND_TRIP_WEIGHT * (round_trip_s - old))

    def delay_s(self, max_length: int) -> float | None:
        """Seconds after the generation's start at which the next pop goes out;
        None: not during it (nothing measured yet, or expected shorter than
        :data:`EARLY_POP_MIN_GEN_S`)."""
        if not self._per_token or self.round_trip_s is None or max_length <= 0:
            return None
        expected = min(self._per_token) * max_length
        if expected < EARLY_POP_MIN_GEN_S:
            return None
        return max(0.0, expected - self.round_trip_s - EARLY_POP_MARGIN_S)


def pop_now(loop: Worker, horde: HordeAPI, body: dict[str, Any]) -> Popped:
    """Send the pop ``body`` on ``horde``: its answer read, or the HordeError;
    the round trip of an answered one goes into the loop's timing."""
    clock = loop.clock.monotonic
    sent_at = clock()
    try:
        answer = horde.pop(body, timeout_s=loop.settings.pop_timeout_s)
    except HordeError as exc:
        return Popped(body, None, exc, clock())
    popped_at = clock()
    loop.next_pop.timing.popped(popped_at - sent_at)
    popped = read_pop(answer, default_ttl_s=loop.settings.lease_s)
    return Popped(body, popped, None, popped_at, popped_at - sent_at)


@dataclass(frozen=True)
class Popped:
    """A pop's answer (None when it failed: ``error``) as the loop takes it;
    ``ctx`` is the job already taken in hand on the pop's thread, if any."""

    body: dict[str, Any]
    answer: PopAnswer | None
    error: HordeError | None
    popped_at: float
    wait_s: float = 0.0
    ctx: JobContext | None = None


class PopAhead:
    """The next pop, on a thread of its own (``horde-pop``): after :meth:`join`
    ``popped`` holds its answer, None when :meth:`NextPop.prepare` said not now."""

    def __init__(self, next_pop: NextPop, horde: HordeAPI,
                 early: tuple[threading.Event, float] | None = None) -> None:
        self.next_pop, self.early, self._horde = next_pop, early, horde
        self.popped: Popped | None = None
        self._thread = threading.Thread(target=self._run, name="horde-pop", daemon=True)
        self._thread.start()

    @property
    def ctx(self) -> JobContext | None:
        return self.popped.ctx if self.popped is not None else None

    def _run(self) -> None:
        # Let the loop's thread have the interpreter first: its submit goes on
        # the wire before this thread's Python work, which then runs while the
        # submit waits for its answer.
        time.sleep(0)
        loop = self.next_pop.loop
        try:
            body = self.next_pop.prepare(self.early)
        except Exception:  # the loop pops the usual way instead, and logs what breaks there
            log.debug("the pop beside the submit was not prepared", exc_info=True)
            body = None
        if body is None:
            return
        try:
            popped = pop_now(loop, self._horde, body)
        except Exception as exc:  # handed to the loop, which logs it
            error = HordeUnavailable(f"pop failed: {type(exc).__name__}")
            self.popped = Popped(body, None, error, loop.clock.monotonic())
            return
        if popped.answer is not None:
            try:
                popped = replace(popped, ctx=loop.driver.take_in_hand(
                    body, popped.answer, popped.popped_at, pop_wait_s=popped.wait_s))
            except Exception:  # the loop takes the job in hand itself
                log.debug("the job popped beside the submit was not received", exc_info=True)
        self.popped = popped

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the pop (at most ``timeout_s``); True when it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class NextPop:
    """A loop's next pop sent ahead: only when the loop would pop now anyway, never
    while stopping, and never when this job's terminal action could change what
    the next pop declares (``WorkerState.outcome_may_withdraw``)."""

    def __init__(self, loop: Worker) -> None:
        self.loop = loop
        self.ahead: PopAhead | None = None
        self.timing = EarlyPopTiming()
        #: Wakes the pop sent during the generation (set when the generation ends).
        self.early_go: threading.Event | None = None
        #: (monotonic start, max_length) of the text generation under way, and when it ended.
        self._text_generation: tuple[float, int] | None = None
        self._generation_end: float | None = None

    def take(self) -> Popped | None:
        """The answer of the pop sent ahead, once it came; None: no such pop."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        early = self.early_go is not None
        ahead.join()
        self.early_go = None
        if early and ahead.ctx is not None and self.loop.stopping():
            # It waited behind the last generation: its own could not be known
            # to end by the stop's deadline. Faulted now, never generated.
            ahead.ctx.give_up("popped during the last generation, not generated at the stop")
        return ahead.popped

    def generation_ended(self) -> None:
        """The job's own request to koboldcpp ended (``PopGate.own_generation_ended``)."""
        self._generation_end = self.loop.clock.monotonic()
        self.loop.gate.own_generation_ended()
        if self.early_go is not None:
            self.early_go.set()

    def generation_over(self) -> None:
        """The job's serving ended, however: a pop waiting for it goes now."""
        if self.loop.gate.own_running:  # a job broke before its generation's end
            self.loop.gate.own_generation_ended()
        self._text_generation = None
        if self.early_go is not None:
            self.early_go.set()

    def _horde(self, ctx: JobContext, *, is_fault: bool, now: float) -> HordeAPI | None:
        loop = self.loop
        if (self.ahead is not None or loop.gate.backend_suspect or loop.state.failure_streak.failing
                or loop.stopping()
                or loop.state.outcome_may_withdraw(ctx, is_fault=is_fault, now=now)):
            return None
        return loop.pop_horde

    def text_generation_starts(self, ctx: JobContext, max_length: int) -> None:
        """A text generation of at most ``max_length`` tokens starts: when expected to
        last a while, the next pop goes out during it, timed to answer before its end."""
        now = self.loop.clock.monotonic()
        self._text_generation = (now, max_length)
        self.loop.gate.own_running = True
        delay = self.timing.delay_s(max_length)
        horde = None if delay is None else self._horde(ctx, is_fault=True, now=now)
        if delay is None or horde is None:
            return
        self.early_go = threading.Event()
        self.ahead = PopAhead(self, horde, (self.early_go, delay))

    def prepare(self, early: tuple[threading.Event, float] | None) -> dict[str, Any] | None:
        """The next pop's body when the loop may pop now (waiting up to ``OWN_TAIL_S``
        for koboldcpp's lock), else None. A pop during a generation waits ``early``
        first, and never goes while a probe of koboldcpp is due (the gate would
        send it beside the worker's generation)."""
        loop = self.loop
        if early is not None:
            early[0].wait(early[1])
            with loop.state.lock:
                due = loop.state.lease_fit.recheck_due(loop.clock.monotonic(), take=False)
                if due or loop.gate.failing_kinds() or loop.state.failure_streak.failing:
                    return None
        deadline = loop.clock.monotonic() + OWN_TAIL_S
        while True:
            pause = loop.gate.pause()
            if pause is None:
                return None if loop.stopping() else loop.state.pop_body(loop.caps)
            if pause[0] != "busy" or loop.clock.monotonic() >= deadline or loop.stopping():
                return None
            loop.stop_event.wait(OWN_TAIL_POLL_S)

    def reply_beside(self, ctx: JobContext, outcome: Outcome) -> bool:
        """Submit the reply on a thread of its own when the pop sent during the
        generation brought the next job or has yet to answer, so koboldcpp starts
        that job at once. False: not sent."""
        ahead, loop = self.ahead, self.loop
        if (loop.pipeline.retry_horde is None or ahead is None
                or self.early_go is None  # not the pop sent during the generation
                or (ahead.join(0) and ahead.ctx is None)):  # it brought no job
            return False
        loop.pipeline.reply_beside(ctx, outcome)
        return True

    def terminal_action_next(self, ctx: JobContext, *, is_fault: bool) -> None:
        """The job's terminal action goes out next: the next pop goes beside it."""
        started, end = self._text_generation, self._generation_end
        if not is_fault and started is not None and end is not None:
            self.timing.generated(end - started[0], started[1])
        early = self.ahead
        if early is not None and early.join(0) and early.popped is None:
            self.ahead = self.early_go = None  # that pop did not go: one beside
        horde = self._horde(ctx, is_fault=is_fault, now=self.loop.clock.monotonic())
        if horde is not None:
            self.ahead = PopAhead(self, horde)
