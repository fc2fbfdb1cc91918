"""The job driver: one popped job's life, from the pop's answer to its terminal action.

Seed "The pop loop": every popped job ends in one terminal action. The pop loop
(``service/loop.py``) calls the driver's steps in order and acts on what each
returns (a :class:`Served`); the driver calls nothing above it. With the submit
pipeline, the driver is the only code that moves a job through its phases
(``state/life.py``)::

    take_in_hand  owner made, held, journaled           -> journaled
    open          payload read, or a fault / held back
    prepare       the run's steps before the generation -> preparing (chat)
    generate      its generation                        -> generating -> outcome_ready
    reply, fault  its terminal action                   -> settling
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import HordeError, JobEnded, JobFault
from ..horde.api import FindsUser
from ..horde.declaration import BackendCapabilities
from ..horde.pop import ChatJob, Lease, PopAnswer, TextJob
from ..state.job import JobContext, Outcome, Steps
from ..state.lease_figures import job_max_length, reply_tokens
from ..state.life import Move, Phase
from ..state.meter import JobMeter
from ..state.ports import Ports
from ..state.refaults import request_digest
from ..state.shared import WorkerState
from ..state.status import SUSPICION_TOKENS_PER_S, first_chat_job_line, suspicion_line
from .chat import ChatRun
from .submit import SubmitPipeline
from .text import TextRun

#: The pop loop's logger: a job's lines from the pop's answer on keep its name.
log = logging.getLogger("koboldcpp_horde_chat.worker")

#: The read timeout of the one ``find_user`` call, seconds.
FIND_USER_TIMEOUT_S = 10.0


@dataclass
class Served:
    """Where a job's serving got to, returned to the loop by each step: ended by
    ``outcome`` (the reply to submit), ``fault`` or ``done`` (nothing to send),
    else ready for the next step (``text_max_length``: a text generation started)."""

    job: ChatJob | TextJob | None = None
    outcome: Outcome | None = None
    fault: JobFault | None = None
    done: bool = False
    #: koboldcpp failed the job: check it is up before the next pop.
    backend_failed: bool = False
    #: The job's own request to koboldcpp ended (the gate may pop again).
    generation_ended: bool = False
    run: ChatRun | TextRun | None = None
    genkey: str = ""
    text_max_length: int | None = None

    @property
    def ended(self) -> bool:
        return self.done or self.outcome is not None or self.fault is not None


@dataclass(eq=False)
class JobDriver:
    """Takes each job a pop loop pops in hand, serves it and settles it."""

    ports: Ports
    caps: BackendCapabilities
    state: WorkerState
    pipeline: SubmitPipeline
    meter: JobMeter
    worker_id: int = 1
    steps: Steps = field(default_factory=Steps, init=False)

    def take_in_hand(
        self, body: dict[str, Any], popped: PopAnswer, popped_at: float, *,
        pop_wait_s: float = 0.0,
    ) -> JobContext | None:
        """Make the job's owner from the pop's ``body`` and answer, hold it for the
        stop and journal it before anything else happens to it (a SIGKILL then
        leaves it for the next start to fault); None without a usable job id."""
        if popped.id is None:
            return None
        settings = self.ports.settings
        declared = body.get("chat_features")
        ctx = JobContext(
            id=popped.id, kind="chat" if popped.chat else "text",
            lease=Lease(popped_at, popped_at + min(popped.ttl_s, settings.lease_cap_s)),
            started=popped_at, model_id=str(body.get("model_id") or settings.model_id),
            declared_features=tuple(map(str, declared)) if isinstance(declared, list) else (),
            worker_id=self.worker_id, popped_in_stop=self.state.stop_deadline is not None,
            pop_wait_s=pop_wait_s, stop_generation=self.ports.koboldcpp.stop_generation,
            journal=self.ports.journal, clock=self.ports.clock, steps=self.steps,
            request=request_digest(popped.raw),
        )
        self.state.hold(ctx)
        ctx.record()
        ctx.move(Move.JOURNAL)
        return ctx

    def open(self, ctx: JobContext, popped: PopAnswer) -> Served:
        """Read the job's payload: a fault when it is malformed, popped after the
        stop's signal or given up; ``done`` when held back; else its ``job``."""
        held = self._held_back(ctx)
        if held is not None:
            return held
        job = popped.job
        if job is None:  # an id, yet no job its payload describes
            if popped.error is not None:
                log.warning("job=%s malformed payload at %s: %s",
                            ctx.id, popped.error.path, popped.error.problem)
            return Served(fault=JobFault("malformed payload"))
        ctx.begin()
        if isinstance(job, ChatJob) and self.state.first_chat_job():
            log.info("worker %d: %s", self.worker_id, first_chat_job_line(self.ports.settings))
        try:
            ctx.check_abandoned()  # given up already: popped after the stop's deadline
        except JobFault as abandoned:
            return Served(job=job, fault=abandoned)
        if ctx.popped_in_stop:
            # The stop has a deadline the job's generation cannot be known to
            # meet. Faulted now, the request goes to another worker at once;
            # left to expire, it would wait out the lease first, and the Horde
            # counts either as an aborted job (abort(), then wp.n += 1).
            return Served(job=job, fault=JobFault("popped after the stop's signal: not generated"))
        return Served(job=job)

    def prepare(self, ctx: JobContext, served: Served, changed: str | None) -> Served:
        """The run's steps before its generation (a text job's starts here); a fault
        when koboldcpp ``changed`` since the pop's declaration."""
        job = served.job
        try:
            if changed is not None:
                raise JobFault(f"{changed}: the job was popped under the old declaration")
            if isinstance(job, ChatJob):
                chat = ChatRun(self.ports, self.caps, self.state, job, ctx)
                chat.received()
                ctx.move(Move.PREPARE)
                chat.prepare()
                return Served(job=job, run=chat)
            assert job is not None
            text = TextRun(self.ports, job, ctx)
            text.received()
            return Served(job=job, run=text, genkey=ctx.start_generation(),
                          text_max_length=job_max_length(job.payload))
        except (JobFault, JobEnded) as exc:
            return self._stopped(ctx, job, exc)

    def generate(self, ctx: JobContext, served: Served) -> Served:
        """The job's generation: its ``outcome``, its ``fault`` or ``done``."""
        run, job = served.run, served.job
        assert job is not None
        try:
            assert run is not None
            # A text job's generation started in prepare, a chat job's starts now.
            outcome = run.generate(served.genkey or ctx.start_generation())
        except (JobFault, JobEnded) as exc:
            return self._stopped(ctx, job, exc)
        ctx.move(Move.OUTCOME)
        if ctx.request:  # it does not always fail
            with self.state.lock:
                self.state.refaults.served(ctx.request)
        return Served(job=job, outcome=outcome, generation_ended=True)

    def _stopped(
        self, ctx: JobContext, job: ChatJob | TextJob | None, exc: JobFault | JobEnded
    ) -> Served:
        if isinstance(exc, JobFault):
            return Served(
                job=job, fault=exc, backend_failed=exc.backend_failed,
                generation_ended=ctx.phase is Phase.GENERATING,
            )
        # Cancelled or ended by the Horde: nothing to send.
        if exc.counted and job is not None:  # its lease ran out: an aborted job on the Horde
            self.meter.ended_by_horde(ctx, job)
        ctx.end(Move.NO_SUBMIT)
        self.state.release(ctx)
        return Served(job=job, done=True, generation_ended=True)

    def reply(self, ctx: JobContext, outcome: Outcome) -> None:
        self.pipeline.reply(ctx, outcome.body, detail=outcome.detail, on_refused=outcome.on_refused)

    def check_speed(self, outcome: Outcome, seconds: float) -> None:
        """After the reply went (here or beside the next job), ``seconds`` after the
        pop. Once, for the first job faster than the Horde allows an untrusted
        owner's worker: warn when the owner is not trusted (the start's key check
        said, or one ``find_user``)."""
        tokens_per_s = reply_tokens(outcome.body) / seconds if seconds > 0 else 0.0
        if tokens_per_s <= SUSPICION_TOKENS_PER_S:
            return
        with self.state.lock:
            if self.state.owner_checked:
                return
            self.state.owner_checked = True
            trusted = self.state.owner_trusted
        if trusted is None:  # the start's key check did not say it
            horde = self.ports.horde
            if not isinstance(horde, FindsUser):
                return
            try:
                user = horde.find_user(timeout_s=FIND_USER_TIMEOUT_S)
            except HordeError as exc:
                log.debug("whether the key's owner is trusted is not known: %s", exc)
                return
            trusted = user.get("trusted") is not False
        if not trusted:
            log.warning("%s", suspicion_line(tokens_per_s))

    def _held_back(self, ctx: JobContext) -> Served | None:
        """Release a job of a request faulted here twice lately without a submit: its
        lease runs out and the Horde marks the request faulted (one aborted job)
        instead of a third fault handing it straight back. None: not held back."""
        now = self.ports.clock.monotonic()
        with self.state.lock:
            held = bool(ctx.request) and self.state.refaults.hold(ctx.request, now)
            backend_failed = held and self.state.refaults.backend_failed(ctx.request)
        if not held:
            return None
        if backend_failed:  # as koboldcpp failed it: toward the streak that probes it
            self.meter.failed_again(ctx)
        log.warning(
            "job=%s kind=%s not served: its request was faulted here twice lately and "
            "came back; left to expire (one aborted job), so the Horde marks it faulted "
            "instead of handing it back again", ctx.id, ctx.kind,
        )
        self.state.record_expired(now, ctx.kind)
        self.state.record_dropped()
        ctx.end(Move.NO_SUBMIT)
        self.state.release(ctx)
        return Served(done=True, backend_failed=backend_failed)

    @contextmanager
    def serving(self, ctx: JobContext) -> Iterator[None]:
        """Around the job's steps: one terminal action (or none, on purpose) whatever
        goes wrong. A forced exit (a second SIGINT) goes on after the loop's jobs
        were faulted with one quick submit each."""
        try:
            yield
        except Exception:
            if ctx.settled:
                raise
            # Whatever went wrong, a popped job is answered: never left to expire.
            log.exception("job=%s unexpected error while serving it; faulting it", ctx.id)
            self.pipeline.fault(ctx, JobFault("internal error"), after_error=True)
        except BaseException:
            # A forced exit: stop koboldcpp's generation, one quick fault, then go.
            self.fault_jobs_now()
            raise

    def fault_jobs_now(self) -> None:
        """Fault the jobs this loop holds with one quick submit each (the process
        exits now), each given up first so that its loop sends nothing more."""
        for ctx in self.state.jobs_in_hand(self.worker_id):
            if ctx.phase is Phase.SETTLING:
                continue  # its submit is on the wire: the journal keeps it if that fails
            ctx.give_up("the worker is exiting")
            self.pipeline.fault_now(ctx)
