"""A job's one owner (:class:`JobContext`), from the pop's answer to its terminal
action; the loop's step thread (:class:`Steps`); and what a run returns (:class:`Outcome`).

A run (``run/chat.py``, ``run/text.py``) returns an :class:`Outcome` or raises
``JobFault`` (fault it) or ``JobEnded`` (nothing to send); only the driver and the
submit pipeline move the job through its phases (``state/life.py``).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import HordeRefusal, JobFault
from ..horde.codes import REFUSAL_RCS
from ..horde.pop import Lease
from ..translate.submits import FAULT_REPLY_REFUSED
from .guard import refused_reply_features
from .journal import GENKEY_PREFIX, Journal, JournalEntry
from .life import ENDED, Move, Phase, may, next_phase

if TYPE_CHECKING:
    from .shared import WorkerState

log = logging.getLogger("koboldcpp_horde_chat.chat_run")

T = TypeVar("T")

#: Seconds kept free at the end of a lease for the submit.
SUBMIT_MARGIN_S = 5.0

__all__ = ["SUBMIT_MARGIN_S", "JobContext", "Lease", "Outcome", "Steps", "new_genkey",
           "payload_keys", "refused_reply_fault"]


@dataclass
class JobContext:
    """One popped job, from the pop's answer to its terminal action: its one owner.

    Every change of where the job is goes through :meth:`move` (or
    :meth:`settle`, :meth:`end`), checked by ``state.life.next_phase`` (seed
    "The pop loop": one terminal action per job); the job driver
    (``run/driver.py``) and the submit pipeline (``run/submit.py``) make them.
    No code outside this class assigns its fields: what the job is given at
    the pop's answer comes in at construction, and what changes later
    changes through its methods, under its lock (:meth:`begin`, the phase;
    :meth:`give_up`, which the stop calls from any thread) or its lease's
    (``horde.pop.Lease.extend_to``, which only the job's progress posts call,
    on the job's thread). The
    shared state (``state.shared.WorkerState.hold``/``release``), the stop and
    the pop sent beside a submit read it from any thread.

    Attributes:
        id: the Horde's job id.
        kind: ``"chat"`` or ``"text"`` (the pop's ``chat: true`` or not).
        lease: the job's one lease (``horde.pop.Lease``), extended by its
            progress posts (``horde.progress.ProgressPoster``).
        started: monotonic seconds when serving began (the pop's answer until
            :meth:`begin`; for the submit's log line).
        model_id: the ``model_id`` declared at the pop that returned the job:
            the job's assigned model (seed step 6: "model_id is the job's
            assigned model, taken from the worker's declaration at pop").
        declared_features: the ``chat_features`` declared at that pop (empty
            when none).
        worker_id: the pop loop that holds the job.
        genkey: the ``HORDEREQ_`` key of the job's local generation, made with
            the job and journaled with it (an abort targets it).
        popped_in_stop: the pop's answer came after a stop with a deadline
            began: the job is faulted at once, not generated.
        pop_wait_s: seconds the pop that brought the job waited for the
            Horde's answer (counted in the job's Horde waits).
        stop_generation: ends the job's generation on koboldcpp, given its
            genkey (connection closed, abort by genkey); called by
            :meth:`give_up` from any thread while the job is generating.
        journal: the worker's job journal (None: no journal).
        clock: the clock of the lease and of ``started`` (its wall time is the
            journal's).
        steps: the loop's step thread (:meth:`until_given_up`).
        request: the digest naming the job's request (``state.refaults.request_digest``
            of the pop's answer; empty when not known).
        phase: where the job is (``state/life.py``).
        prompt_tokens: the tokens of the job's prompt as its run counted or
            estimated them (:meth:`note_prompt_tokens`), or None: not known.
        abandoned: set when the worker gives the job up (the stop's deadline
            came); ``abandon_why`` says why. Every blocking step of the job
            ends at it (:meth:`until_given_up`, the generation's abort).

    Where the job's time went, for its submit line (:meth:`times`): the
    seconds spent waiting on the Horde (the pop's answer, progress posts,
    submit answers: :meth:`note_horde_wait`) apart from koboldcpp's
    generation (from :meth:`start_generation` until the job leaves
    ``generating``, less the progress posts waited for meanwhile).
    """

    id: str
    kind: str
    lease: Lease
    started: float
    model_id: str = ""
    declared_features: tuple[str, ...] = ()
    worker_id: int = 1
    genkey: str = field(default_factory=lambda: new_genkey())
    popped_in_stop: bool = False
    pop_wait_s: float = 0.0
    stop_generation: Callable[[str], None] | None = field(default=None, repr=False)
    journal: Journal | None = field(default=None, repr=False)
    clock: Clock = field(default=SYSTEM_CLOCK, repr=False)
    steps: Steps = field(default_factory=lambda: Steps(), repr=False)
    request: str = field(default="", repr=False)
    phase: Phase = Phase.POPPED
    abandoned: threading.Event = field(default_factory=threading.Event)
    abandon_why: str = ""
    prompt_tokens: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _wakers: list[threading.Event] = field(default_factory=list, repr=False)
    _horde_s: float = field(default=0.0, repr=False)
    _gen_from: tuple[float, float] | None = field(default=None, repr=False)
    _gen_s: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._horde_s = max(0.0, self.pop_wait_s)

    def move(self, move: Move) -> None:
        """Move the job on (``state.life.MOVES``); thread-safe.

        Raises:
            IllegalMove: the move may not follow the job's phase.
        """
        with self._lock:
            self._to_phase(next_phase(self.phase, move))

    def _to_phase(self, phase: Phase) -> None:
        """Set the phase (under the lock), timing the generation from the move
        into ``generating`` to the move out of it."""
        now = self.clock.monotonic()
        if phase is Phase.GENERATING and self.phase is not Phase.GENERATING:
            self._gen_from = (now, self._horde_s)
        elif self.phase is Phase.GENERATING and phase is not Phase.GENERATING:
            if self._gen_from is not None:
                since, horde_then = self._gen_from
                self._gen_s += max(0.0, now - since - (self._horde_s - horde_then))
                self._gen_from = None
        self.phase = phase

    def note_horde_wait(self, seconds: float) -> None:
        """The job waited ``seconds`` for the Horde (a pop's answer, a progress
        post, a submit's answer); thread-safe."""
        with self._lock:
            self._horde_s += max(0.0, seconds)

    def times(self) -> tuple[float, float]:
        """``(generation, horde)`` seconds so far: koboldcpp's generation (less the
        progress posts waited for during it) and the waits on the Horde."""
        with self._lock:
            gen = self._gen_s
            if self._gen_from is not None:
                since, horde_then = self._gen_from
                gen += max(0.0, self.clock.monotonic() - since - (self._horde_s - horde_then))
            return gen, self._horde_s

    def settle(self) -> bool:
        """Take the right to send the job's terminal action (the move to
        ``settling``): True for the first caller only, False once it was
        taken or the job ended, so a job never gets two."""
        with self._lock:
            if not may(self.phase, Move.SETTLE):
                return False
            self._to_phase(Phase.SETTLING)
            return True

    def end(self, move: Move) -> bool:
        """End the job with ``move`` (``SETTLED``, ``NO_SUBMIT`` or ``ABANDON``)
        when the table allows it now; False when it does not (already ended)."""
        with self._lock:
            if not may(self.phase, move):
                return False
            self._to_phase(next_phase(self.phase, move))
            return True

    @property
    def settled(self) -> bool:
        """True once the job's life ended (settled or abandoned): nothing more is sent."""
        return self.phase in ENDED

    @property
    def in_hand(self) -> bool:
        """True until the job's life ended."""
        return self.phase not in ENDED

    @property
    def chat(self) -> bool:
        """True for a chat job."""
        return self.kind == "chat"

    # ------------------------------------------------------------- its life

    def begin(self) -> None:
        """Serving begins (its payload was read): ``started`` is now, monotonic seconds."""
        with self._lock:
            self.started = self.clock.monotonic()

    def record(self) -> None:
        """Write the job to the journal as it is now (a plain write: a killed
        process's writes are kept by the kernel), so that a restart after a
        crash ends it (``service.recovery.recover``). Its lease end is the one the
        Horde runs: the pop's ``ttl`` from the pop's answer."""
        if self.journal is None:
            return
        self.journal.add(
            JournalEntry(
                job_id=self.id,
                kind=self.kind,
                model_id=self.model_id if self.chat else None,
                genkey=self.genkey,
                lease_end=self._lease_end(),
            )
        )

    def record_lease(self) -> None:
        """Write the job's lease end again after an accepted progress post moved
        it later (seed "Streaming progress"), so a restart does not take a
        lease that runs for one that ended."""
        if self.journal is not None:
            self.journal.set_lease_end(self.id, self._lease_end())

    def _lease_end(self) -> float:
        """The job's lease end in epoch seconds (its monotonic deadline on the wall clock)."""
        return self.clock.time() + self.lease.deadline - self.clock.monotonic()

    def start_generation(self) -> str:
        """The job's generation starts (the move to ``generating``): returns its
        genkey (made with the job at the pop's answer and journaled with it, so
        a restart aborts it on koboldcpp).

        Raises:
            JobFault: the job was given up meanwhile.
        """
        self.check_abandoned()
        self.move(Move.GENERATE)
        return self.genkey

    def until_given_up(self, call: Callable[[], T]) -> T:
        """``call()``'s result, or JobFault as soon as the job is given up.

        For a blocking step before the generation (a fetch, the token count):
        its own timeout keeps it within the lease, and this keeps it within the
        stop's deadline. The call runs on the loop's step thread (:class:`Steps`).

        Raises:
            JobFault: the job was given up (before or during the call).
            Exception: whatever ``call`` raises.
        """
        return self.steps.run(self, call)

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
            stop(self.genkey)

    def note_prompt_tokens(self, tokens: int) -> None:
        """The job's prompt is ``tokens`` long (its run's count or estimate), for
        the lease fit when its generation runs out (``state.lease_fit``)."""
        self.prompt_tokens = max(0, tokens)

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


def refused_reply_fault(exc: HordeRefusal) -> JobFault:
    """The fault after a refused reply: ``reply_refused`` for the chat refusals
    (``ChatSubmitInvalid``, ``ChatSubmitNonconformant``, ``ChatModelMismatch``,
    worked example), none for any other (such as 400 for a token count out of
    range). A fault after ``ChatSubmitNonconformant`` does not count toward
    maintenance: the Horde counts it as a nonconformant reply."""
    return JobFault(
        f"reply refused ({exc.rc or exc.status}): {exc.message}",
        fault_reason=FAULT_REPLY_REFUSED if exc.rc in REFUSAL_RCS else None,
        counts=exc.rc != "ChatSubmitNonconformant",
    )


@dataclass(frozen=True)
class Outcome:
    """What a job run returns: the submit body, a short ``detail`` for the accepted
    submit's log line and, for a chat reply, its job, payload and the worker's
    state, which a refusal is checked against (None for a text reply)."""

    body: dict[str, Any]
    detail: str
    chat: tuple[JobContext, dict[str, Any], WorkerState] | None = None

    def on_refused(self, exc: HordeRefusal) -> JobFault:
        """Seed "Submit refusals": the fault after the Horde refused this reply.

        A text reply's carries no reason. A chat refusal that points at a
        declared feature (``guard.refused_reply_features``) is counted against
        it (``WorkerState.record_feature_failure``: enough in an hour withdraw
        that feature alone) and the fault names it, so it does not count toward
        withdrawing chat as a whole.
        """
        if self.chat is None:
            return JobFault(f"reply refused ({exc.rc or exc.status}): {exc.message}")
        ctx, payload, state = self.chat
        names = refused_reply_features(exc.rc, payload, self.body, ctx.declared_features)
        if exc.rc == "ChatSubmitNonconformant" and not names:
            log.warning(
                "job=%s nonconformant reply not attributable to a declared guarantee "
                "or feature (payload keys %s)",
                ctx.id,
                payload_keys(payload),
            )
        if names:
            state.record_feature_failure(names, ctx.clock.monotonic())
        fault = refused_reply_fault(exc)
        fault.feature = names[0] if names else None
        return fault


class Steps:
    """The loop's step thread: a job's blocking steps before its generation run
    there one at a time, so that the job's own thread can give them up at the
    stop's deadline (:meth:`JobContext.until_given_up`). A step given up
    finishes there by its own timeout, its result unused, and later steps get
    a new thread."""

    def __init__(self) -> None:
        self._runner: _StepRunner | None = None

    def run(self, ctx: JobContext, call: Callable[[], T]) -> T:
        """``call()``'s result, or JobFault as soon as ``ctx`` is given up.

        Raises:
            JobFault: the job was given up (before or during the call).
            Exception: whatever ``call`` raises.
        """
        ctx.check_abandoned()
        runner = self._runner
        if runner is None or runner.busy:  # busy: a step given up still runs there
            runner = self._runner = _StepRunner()
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



def new_genkey() -> str:
    """A ``HORDEREQ_`` genkey: koboldcpp does not pause the worker for these requests."""
    return GENKEY_PREFIX + secrets.token_hex(6)


def payload_keys(obj: dict[str, Any], limit: int = 32) -> str:
    """``"a,b,c"``: an object's keys for a log line, at most ``limit`` and 40 characters each."""
    keys = sorted(str(k)[:40] for k in obj)
    more = f",... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ",".join(keys[:limit]) + more
