"""A job's one owner (:class:`JobContext`), the loop's step thread (:class:`Steps`)
and what a run returns (:class:`Outcome`; or it raises ``JobFault`` or ``JobEnded``).
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
from ..horde.codes import CHAT_SUBMIT_NONCONFORMANT
from ..horde.pop import Lease
from .guard import refused_reply_features
from .journal import GENKEY_PREFIX, Journal, JournalEntry
from .life import ENDED, MOVES, Move, Phase, next_phase
from .submit_answers import refused_reply_fault

if TYPE_CHECKING:
    from .shared import WorkerState

log = logging.getLogger("koboldcpp_horde_chat.chat_run")

T = TypeVar("T")

#: Seconds kept free at the end of a lease for the submit.
SUBMIT_MARGIN_S = 5.0


@dataclass
class JobContext:
    """One popped job, from the pop's answer to its terminal action: its one owner.

    Its phase changes only through :meth:`move`, :meth:`settle` and :meth:`end`,
    checked by ``state.life.next_phase`` (one terminal action per job), under its
    lock; other threads (the stop, the pop sent ahead) only read it.

    Attributes:
        started: monotonic seconds when serving began (the pop's answer until :meth:`begin`).
        model_id: the ``model_id`` declared at the job's pop (seed step 6: the
            job's assigned model); declared_features: its ``chat_features``.
        genkey: the ``HORDEREQ_`` key of the job's local generation, journaled with it.
        popped_in_stop: popped after a stop with a deadline began: faulted, not generated.
        stop_generation: ends the job's generation on koboldcpp, given its genkey.
        request: the digest of the job's request (``state.refaults``), or empty.
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
        with self._lock:
            self._to_phase(next_phase(self.phase, move))

    def _to_phase(self, phase: Phase) -> None:
        if phase is Phase.GENERATING and self.phase is not Phase.GENERATING:
            self._gen_from = (self.clock.monotonic(), self._horde_s)
        elif self.phase is Phase.GENERATING and phase is not Phase.GENERATING:
            self._gen_s = self._gen_so_far()
            self._gen_from = None
        self.phase = phase

    def _gen_so_far(self) -> float:
        """Generation seconds, the Horde's waits during it left out (under the lock)."""
        if self._gen_from is None:
            return self._gen_s
        since, horde_then = self._gen_from
        return self._gen_s + max(0.0, self.clock.monotonic() - since - (self._horde_s - horde_then))

    def note_horde_wait(self, seconds: float) -> None:
        """The job waited ``seconds`` for the Horde; thread-safe."""
        with self._lock:
            self._horde_s += max(0.0, seconds)

    def times(self) -> tuple[float, float]:
        """``(generation, horde)`` seconds so far (progress posts are Horde time)."""
        with self._lock:
            return self._gen_so_far(), self._horde_s

    def settle(self) -> bool:
        """Move to ``settling``: True for the first caller only, so a job never
        gets two terminal actions."""
        return self.end(Move.SETTLE)

    def end(self, move: Move) -> bool:
        """End the job with ``move`` when allowed now; False when not (already ended)."""
        with self._lock:
            if self.phase not in MOVES[move][1]:
                return False
            self._to_phase(next_phase(self.phase, move))
            return True

    @property
    def settled(self) -> bool:
        """True once the job's life ended: nothing more is sent."""
        return self.phase in ENDED

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    def begin(self) -> None:
        """Serving begins (its payload was read): ``started`` is now."""
        with self._lock:
            self.started = self.clock.monotonic()

    def record(self) -> None:
        """Journal the job, so that a restart after a crash ends it (a plain write:
        the kernel keeps a killed process's writes)."""
        if self.journal is not None:
            self.journal.add(JournalEntry(
                job_id=self.id, kind=self.kind, model_id=self.model_id if self.chat else None,
                genkey=self.genkey, lease_end=self._lease_end(),
            ))

    def record_lease(self) -> None:
        """Journal the lease end again after a progress post moved it later."""
        if self.journal is not None:
            self.journal.set_lease_end(self.id, self._lease_end())

    def _lease_end(self) -> float:
        return self.clock.time() + self.lease.deadline - self.clock.monotonic()

    def start_generation(self) -> str:
        """Move to ``generating`` and return the genkey; JobFault when given up."""
        self.check_abandoned()
        self.move(Move.GENERATE)
        return self.genkey

    def until_given_up(self, call: Callable[[], T]) -> T:
        """``call()``'s result on the step thread, or JobFault as soon as the job
        is given up (a blocking step before the generation: a fetch, the token
        count; its own timeout keeps it within the lease)."""
        self.check_abandoned()
        runner = self.steps.idle_runner()
        done = threading.Event()
        with self._lock:
            self._wakers.append(done)
            if self.abandoned.is_set():
                done.set()
        box: list[Any] = []
        try:
            runner.busy = True
            runner.calls.put((call, box, done))
            done.wait()
        finally:
            with self._lock:
                self._wakers.remove(done)
        if not box:  # woken by the give-up, the call still under way
            raise JobFault(self.abandon_why or "the job was given up")
        ok, value = box[0]
        if not ok:
            raise value
        return cast(T, value)

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
        self.prompt_tokens = max(0, tokens)

    def check_abandoned(self) -> None:
        if self.abandoned.is_set():
            raise JobFault(self.abandon_why or "the job was given up")


@dataclass(frozen=True)
class Outcome:
    """What a job run returns: the submit body, a short ``detail`` for the accepted
    submit's log line and, for a chat reply, its job, payload and the worker's
    state, which a refusal is checked against (None for a text reply)."""

    body: dict[str, Any]
    detail: str
    chat: tuple[JobContext, dict[str, Any], WorkerState] | None = None

    def on_refused(self, exc: HordeRefusal) -> JobFault:
        """Seed "Submit refusals": the fault after the Horde refused this reply. A
        chat refusal pointing at a declared feature is counted against it and the
        fault names it, so it does not count toward withdrawing chat as a whole."""
        if self.chat is None:
            return JobFault(f"reply refused ({exc.rc or exc.status}): {exc.message}")
        ctx, payload, state = self.chat
        names = refused_reply_features(exc.rc, payload, self.body, ctx.declared_features)
        if exc.rc == CHAT_SUBMIT_NONCONFORMANT and not names:
            log.warning(
                "job=%s nonconformant reply not attributable to a declared guarantee "
                "or feature (payload keys %s)", ctx.id, payload_keys(payload),
            )
        if names:
            state.record_feature_failure(names, ctx.clock.monotonic())
        fault = refused_reply_fault(exc)
        fault.feature = names[0] if names else None
        return fault


class Steps:
    """The loop's step thread, where a job's blocking steps run one at a time so
    that the job's thread can give them up at the stop's deadline. A step given
    up finishes there by its own timeout, unused; later steps get a new thread."""

    def __init__(self) -> None:
        self._runner: _StepRunner | None = None

    def idle_runner(self) -> _StepRunner:
        """The step thread, a new one when a step given up still runs there."""
        if self._runner is None or self._runner.busy:
            self._runner = _StepRunner()
        return self._runner


class _StepRunner:
    """A daemon thread (so a step given up never holds the process's exit) that
    runs the steps queued: ``(call, box, done)``, ``done`` set once ``box`` holds
    ``(True, value)`` or ``(False, exception)``."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[
            tuple[Callable[[], Any], list[Any], threading.Event]
        ] = queue.SimpleQueue()
        self.busy = False
        threading.Thread(target=self._serve, name="job-step", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, box, done = self.calls.get()
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
