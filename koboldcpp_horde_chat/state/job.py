"""What every job run shares: the job's one owner, its lease, and the I/O edges.

A job run (``run/chat.py``, ``run/text.py``) takes one popped job through the
seed's steps and either returns the outcome to submit or raises
:class:`~errors.JobFault` (fault it) or :class:`~errors.JobEnded` (nothing to
send). The loop hands the outcome to the submit pipeline (``run/submit.py``), the
one place that sends terminal actions.

- :class:`Lease`: a job's lease on the monotonic clock (seed "Streaming
  progress": the pop's ``ttl``, extended by accepted progress posts).
- :class:`JobContext`: the job's one owner from the pop's answer to its
  terminal action: id, kind, ``model_id``, lease, genkey, phase (``state/life.py``).
- :class:`Edges`: the I/O edges and clocks a run uses, with the backend
  helpers every run needs (busy retries, a best-effort abort, pauses).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..errors import BackendBusy, BackendError, BackendUnauthorized, HordeRefusal, JobFault
from ..horde.api import HordeAPI
from ..horde.pop import ttl_seconds
from ..koboldcpp.api import KcppAPI
from ..settings import WorkerSettings
from .journal import Journal, JournalEntry
from .life import ENDED, Move, Phase, may, next_phase

log = logging.getLogger("koboldcpp_horde_chat.runs")

T = TypeVar("T")

#: Seconds kept free at the end of a lease for the submit.
SUBMIT_MARGIN_S = 5.0
#: Read timeout of an abort, seconds: best effort, and the fault must still fit the lease.
ABORT_TIMEOUT_S = 2.0


@dataclass
class Lease:
    """A job's lease on the monotonic clock (seed: "Streaming progress", lease).

    Attributes:
        popped_at: when the pop answered, monotonic seconds.
        deadline: when the Horde stops taking the job's submit, monotonic
            seconds; accepted progress posts move it later.
    """

    popped_at: float
    deadline: float

    def remaining(self, now: float) -> float:
        """Seconds left at monotonic time ``now`` (negative once it ended)."""
        return self.deadline - now

    @classmethod
    def from_pop(
        cls, pop: dict[str, Any], popped_at: float, default_s: float, cap_s: float
    ) -> Lease:
        """The lease of a popped job before its payload is parsed: the pop's ``ttl``
        (``horde.pop.ttl_seconds``), never past
        ``cap_s`` (how far progress posts could extend it) from ``popped_at``."""
        seconds = ttl_seconds(pop, default_s)
        return cls(popped_at, popped_at + min(seconds, cap_s))


@dataclass
class JobContext:
    """One popped job, from the pop's answer to its terminal action: its one owner.

    Every change of where the job is goes through :meth:`move`, checked by
    ``state.life.next_phase`` (seed "The pop loop": one terminal action per
    job). The loop, the pop sent beside a submit, the submit pipeline, the
    stop and the journal (``state.shared.WorkerState.hold``/``release``) all
    read and move the job here, from any thread.

    Attributes:
        id: the Horde's job id.
        kind: ``"chat"`` or ``"text"`` (the pop's ``chat: true`` or not).
        lease: the job's lease.
        started: monotonic seconds when serving began (for the submit's log line).
        model_id: the ``model_id`` declared at the pop that returned the job:
            the job's assigned model (seed step 6: "model_id is the job's
            assigned model, taken from the worker's declaration at pop").
        declared_features: the ``chat_features`` declared at that pop (empty
            when none).
        worker_id: the pop loop that holds the job.
        genkey: the ``HORDEREQ_`` key of the job's local generation, made with
            the job and journaled with it (an abort targets it).
        phase: where the job is (``state/life.py``).
        abandoned: set when the worker gives the job up (the stop's deadline
            came); ``abandon_why`` says why. Every blocking step of the job
            ends at it (:meth:`Edges.until_given_up`, the generation's abort).
        popped_in_stop: the pop's answer came after a stop with a deadline
            began: the job is faulted at once, not generated.
        stop_generation: set by the loop while the job's generation runs:
            ends it on koboldcpp (abort by genkey, connection closed); called
            by :meth:`give_up` from any thread.
    """

    id: str
    kind: str
    lease: Lease
    started: float
    model_id: str = ""
    declared_features: tuple[str, ...] = ()
    worker_id: int = 1
    genkey: str = field(default_factory=lambda: new_genkey())
    phase: Phase = Phase.POPPED
    abandoned: threading.Event = field(default_factory=threading.Event)
    abandon_why: str = ""
    stop_generation: Callable[[], None] | None = field(default=None, repr=False)
    popped_in_stop: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _wakers: list[threading.Event] = field(default_factory=list, repr=False)

    def move(self, move: Move) -> None:
        """Move the job on (``state.life.MOVES``); thread-safe.

        Raises:
            IllegalMove: the move may not follow the job's phase.
        """
        with self._lock:
            self.phase = next_phase(self.phase, move)

    def settle(self) -> bool:
        """Take the right to send the job's terminal action (the move to
        ``settling``): True for the first caller only, False once it was
        taken or the job ended, so a job never gets two."""
        with self._lock:
            if not may(self.phase, Move.SETTLE):
                return False
            self.phase = Phase.SETTLING
            return True

    def end(self, move: Move) -> bool:
        """End the job with ``move`` (``SETTLED``, ``NO_SUBMIT`` or ``ABANDON``)
        when the table allows it now; False when it does not (already ended)."""
        with self._lock:
            if not may(self.phase, move):
                return False
            self.phase = next_phase(self.phase, move)
            return True

    @property
    def settled(self) -> bool:
        """True once the job's life ended (settled or abandoned): nothing more is sent."""
        return self.phase in ENDED

    @property
    def in_hand(self) -> bool:
        """True until the job's life ended."""
        return self.phase not in ENDED

    def give_up(self, why: str) -> None:
        """Give the job up (the stop's deadline came), from any thread: its blocking
        step ends, its generation is stopped, and its run faults it."""
        with self._lock:
            if self.abandoned.is_set() or self.phase in ENDED:
                return
            self.abandon_why = why
            self.abandoned.set()
            wakers = list(self._wakers)
            # Only a generation still under way is stopped: the client's next
            # request may already be another job's.
            stop = self.stop_generation if self.phase is Phase.GENERATING else None
        for waker in wakers:
            waker.set()
        if stop is not None and self.genkey:
            stop()

    def check_abandoned(self) -> None:
        """Raise JobFault when the job was given up (see :meth:`give_up`)."""
        if self.abandoned.is_set():
            raise JobFault(self.abandon_why or "the job was given up")

    def add_waker(self, waker: threading.Event) -> None:
        """Set ``waker`` when the job is given up (now, if it already was)."""
        with self._lock:
            self._wakers.append(waker)
            if not self.abandoned.is_set():
                return
        waker.set()

    def remove_waker(self, waker: threading.Event) -> None:
        """Stop setting ``waker`` (see :meth:`add_waker`)."""
        with self._lock:
            if waker in self._wakers:
                self._wakers.remove(waker)

    @property
    def chat(self) -> bool:
        """True for a chat job."""
        return self.kind == "chat"


@dataclass(frozen=True)
class Outcome:
    """What a job run returns: the submit body and how to answer its refusal.

    Attributes:
        body: the submit body (structured for a chat job, ``generation`` for text).
        detail: a short description for the accepted submit's log line.
        on_refused: turns the Horde's refusal of this reply into the fault
            that follows it (seed "Submit refusals").
    """

    body: dict[str, Any]
    detail: str
    on_refused: Callable[[HordeRefusal], JobFault]


@dataclass
class Edges:
    """The I/O edges, clocks and stop signal a job run uses.

    Attributes:
        settings: the worker's configuration.
        horde: the Horde client (progress posts; the only holder of the API key).
        backend: the koboldcpp client.
        clock: monotonic seconds.
        stop_event: set when the worker is asked to stop.
        note_own_request, note_own_request_done: called before and after each
            generation request the worker sends (:meth:`own_request`), so a
            standalone worker does not take it for a local user's.
        wall: epoch seconds.
        journal: the worker's job journal (None: no journal).
        stop_deadline: the stop's deadline (``time.monotonic()`` seconds), or
            None while the worker is not stopping under one.
    """

    settings: WorkerSettings
    horde: HordeAPI
    backend: KcppAPI
    clock: Callable[[], float]
    stop_event: threading.Event
    note_own_request: Callable[[], None]
    wall: Callable[[], float] = time.time
    journal: Journal | None = None
    note_own_request_done: Callable[[], None] = lambda: None
    stop_deadline: Callable[[], float | None] = lambda: None
    _step_runner: _StepRunner | None = field(default=None, init=False, repr=False)

    @contextmanager
    def own_request(self) -> Iterator[None]:
        """Around one generation request of the worker's to koboldcpp, so that a
        standalone worker does not take it for a local user's."""
        self.note_own_request()
        try:
            yield
        finally:
            self.note_own_request_done()

    def record(self, ctx: JobContext) -> None:
        """Write the job to the journal as it is now (a plain write: a killed
        process's writes are kept by the kernel), so that a restart after a
        crash ends it (``recovery.recover``). Its lease end is the one the
        Horde runs: the pop's ``ttl`` from the pop's answer."""
        if self.journal is None:
            return
        self.journal.add(
            JournalEntry(
                job_id=ctx.id,
                kind=ctx.kind,
                model_id=ctx.model_id if ctx.chat else None,
                genkey=ctx.genkey,
                lease_end=self._lease_end(ctx),
            )
        )

    def _lease_end(self, ctx: JobContext) -> float:
        """The job's lease end in epoch seconds (its monotonic deadline on the wall clock)."""
        return self.wall() + ctx.lease.deadline - self.clock()

    def record_lease(self, ctx: JobContext) -> None:
        """Write the job's lease end again after an accepted progress post moved
        it later (seed "Streaming progress"), so a restart does not take a
        lease that runs for one that ended."""
        if self.journal is not None:
            self.journal.set_lease_end(ctx.id, self._lease_end(ctx))

    def generating(self, ctx: JobContext) -> str:
        """The job's generation starts: returns its genkey (made with the job at the
        pop's answer and journaled with it, so a restart aborts it on koboldcpp).

        Raises:
            JobFault: the job was given up meanwhile.
        """
        ctx.check_abandoned()
        ctx.move(Move.GENERATE)
        return ctx.genkey

    def until_given_up(self, ctx: JobContext, call: Callable[[], T]) -> T:
        """``call()``'s result, or JobFault as soon as the job is given up.

        For a blocking step before the generation (a fetch, the token count):
        its own timeout keeps it within the lease, and this keeps it within the
        stop's deadline. The call runs on a step thread (one kept for the
        loop's steps); one given up finishes there by its own timeout, its
        result unused, and later steps get a new thread.

        Raises:
            JobFault: the job was given up (before or during the call).
            Exception: whatever ``call`` raises.
        """
        ctx.check_abandoned()
        runner = self._step_runner
        if runner is None or runner.busy:  # busy: a step given up still runs there
            runner = self._step_runner = _StepRunner()
        done = threading.Event()
        ctx.add_waker(done)
        try:
            box = runner.run(call, done)
            done.wait()
        finally:
            ctx.remove_waker(done)
        if not box:  # woken by the give-up, the call still under way
            raise JobFault(ctx.abandon_why or "the job was given up")
        ok, value = box[0]
        if not ok:
            raise value
        return cast(T, value)

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` (a job's own retry pause), never longer: a stop does not
        shorten it, but its deadline (``stop_deadline``) does, so that the retry
        after it makes its last attempt by the deadline."""
        if self.stop_deadline() is None and not self.stop_event.is_set():
            start = time.monotonic()
            if not self.stop_event.wait(seconds):
                return
            seconds -= time.monotonic() - start  # the stop came: the rest of the wait
        deadline = self.stop_deadline()
        if deadline is not None:
            seconds = min(seconds, deadline - time.monotonic())
        if seconds > 0:
            threading.Event().wait(seconds)

    def abort_quietly(self, genkey: str) -> None:
        """Best-effort abort of the local generation (see :func:`abort_quietly`)."""
        abort_quietly(self.backend, genkey)

    def with_busy_retry(
        self, call: Callable[[float], dict[str, Any]], ctx: JobContext
    ) -> dict[str, Any]:
        """Call the backend for the job in hand, waiting out 503 busy answers
        while the lease allows.

        ``call`` gets the read timeout in seconds (what is left of the lease
        before the submit margin). A timeout aborts the local generation (by
        ``ctx.genkey``) before raising.

        Raises:
            BackendError: the lease ran out or the backend failed.
            JobFault: the job was abandoned meanwhile (its generation aborted).
        """
        while True:
            ctx.check_abandoned()
            remaining = ctx.lease.remaining(self.clock()) - SUBMIT_MARGIN_S
            if remaining <= 1.0:
                raise BackendError("the lease ran out before koboldcpp answered")
            try:
                with self.own_request():  # the worker's own, not a local user's
                    answer = call(remaining)
            except BackendUnauthorized:
                raise
            except BackendBusy:
                # Waited out until the lease or the stop's grace period ends.
                self.pause(min(2.0, max(0.0, remaining - 1.0)))
                continue
            except BackendError as exc:
                ctx.check_abandoned()
                if exc.status == 0:
                    self.abort_quietly(ctx.genkey)
                raise
            ctx.check_abandoned()
            return answer


class _StepRunner:
    """One daemon thread that runs a loop's blocking steps one at a time (a
    thread kept, not one started per step; a daemon, so a step given up at
    the stop never holds the process's exit)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], list[Any], threading.Event]
        ] = queue.SimpleQueue()
        self.busy = False
        threading.Thread(target=self._serve, name="job-step", daemon=True).start()

    def run(self, call: Callable[[], Any], done: threading.Event) -> list[Any]:
        """Run ``call`` on the thread; ``done`` is set after it ended, when the
        returned list holds ``(True, value)`` or ``(False, exception)``."""
        box: list[Any] = []
        self.busy = True
        self._calls.put((call, box, done))
        return box

    def _serve(self) -> None:
        while True:
            call, box, done = self._calls.get()
            try:
                box.append((True, call()))
            except BaseException as exc:  # handed to the job's thread
                box.append((False, exc))
            finally:
                self.busy = False
                done.set()


def abort_quietly(backend: KcppAPI, genkey: str) -> None:
    """Best-effort abort of the local generation ``genkey``, quick enough to leave
    the lease's margin to the fault that usually follows (koboldcpp answers in
    about 0.1 s); a failure is logged at debug level only."""
    try:
        backend.abort(genkey, timeout_s=ABORT_TIMEOUT_S)
    except BackendError as exc:
        log.debug("abort of %s failed: %s", genkey, exc)


def new_genkey() -> str:
    """A ``HORDEREQ_`` genkey: koboldcpp does not pause the worker for these requests."""
    return "HORDEREQ_" + secrets.token_hex(6)


def payload_keys(obj: dict[str, Any], limit: int = 32) -> str:
    """``"a,b,c"``: an object's keys for a log line, at most ``limit`` and 40 characters each."""
    keys = sorted(str(k)[:40] for k in obj)
    more = f",... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ",".join(keys[:limit]) + more
