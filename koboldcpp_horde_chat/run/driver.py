"""The job driver: one popped job's life, from the pop's answer to its terminal action.

Seed "The pop loop": every popped job ends in one terminal action. The pop
loop (``service/loop.py``) pops; this module takes each job it pops in hand,
serves it and settles it, and is, with the submit pipeline's terminal action
(``run/submit.py``), the only code that moves a job through its phases
(``state/life.py``)::

    take_in_hand   the job's owner is made (lease, genkey, the stop's state),
                   held by the shared state and journaled    -> journaled
    serve          its payload parsed; faulted at once when it is malformed,
                   popped after the stop's signal, or popped under a koboldcpp
                   that changed since; else its run's steps  -> preparing (chat)
                   and its generation                        -> generating
                                                             -> outcome_ready
    settle         its reply or its fault to the submit pipeline -> settling,
                   or nothing, on purpose (a cancel)         -> settled

The runs (``run/chat.py``, ``run/text.py``) do the steps between the moves
and never move the job. What the loop must hear around a job (the
generation's end, a koboldcpp that may have failed, the pop sent beside the
terminal action) comes through :class:`LoopHooks`, in the order the loop
needs it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..errors import HordeError, JobEnded, JobFault, PayloadError
from ..horde.api import FindsUser
from ..horde.declaration import BackendCapabilities
from ..horde.pop import ChatJob, Lease, TextJob, parse_pop
from ..state.job import JobContext, Outcome, Steps
from ..state.lease_fit import job_max_length, reply_tokens
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


class LoopHooks(Protocol):
    """What the pop loop hears around a job's life (``service.loop.Worker``)."""

    def payload_read(self) -> None:
        """A popped job's payload was read (valid or malformed): a job came, so the
        empty-pop backoff starts over."""
        ...

    def backend_changed(self, ctx: JobContext) -> str | None:
        """What koboldcpp serves now that differs from the job's pop's declaration
        (a restart with another model or context), or None."""
        ...

    def generation_ended(self) -> None:
        """The job's own request to koboldcpp ended (the pop gate may pop again)."""
        ...

    def backend_failed(self) -> None:
        """koboldcpp failed the job (no answer, a reset, a stream cut short):
        check it is up before the next pop."""
        ...

    def terminal_action_next(self, ctx: JobContext, *, is_fault: bool) -> None:
        """The job's terminal action goes out next: the next pop may go beside it."""
        ...

    def text_generation_starts(self, ctx: JobContext, max_length: int) -> None:
        """A text job's generation of at most ``max_length`` tokens starts now: the
        next pop may go out during it."""
        ...

    def reply_beside(self, ctx: JobContext, outcome: Outcome) -> bool:
        """Send the job's reply on a thread of its own (True: sent there, the job's
        life ends there) so the next job, already in hand, is served meanwhile;
        False: the driver sends it."""
        ...


class JobDriver:
    """Takes each job a pop loop pops in hand, serves it and settles it.

    Args:
        ports: the loop's ports (``state.ports.Ports``).
        caps: what the backend implements (``vision``).
        state: the worker's shared state (the jobs in hand, the first chat job).
        pipeline: the submit pipeline (the terminal actions).
        meter: the job meter (speed and failure lines).
        hooks: the loop's hooks (:class:`LoopHooks`).
        worker_id: the loop's number.
    """

    def __init__(
        self,
        ports: Ports,
        caps: BackendCapabilities,
        state: WorkerState,
        pipeline: SubmitPipeline,
        meter: JobMeter,
        hooks: LoopHooks,
        worker_id: int = 1,
    ) -> None:
        self.ports = ports
        self.settings = ports.settings
        self.caps = caps
        self.state = state
        self.pipeline = pipeline
        self.meter = meter
        self.hooks = hooks
        self.worker_id = worker_id
        self.steps = Steps()

    # ------------------------------------------------------ take it in hand

    def take_in_hand(
        self,
        body: dict[str, Any],
        pop: dict[str, Any],
        popped_at: float,
        *,
        pop_wait_s: float = 0.0,
    ) -> JobContext | None:
        """Take the job a pop's answer carries in hand, before anything else happens
        to it: its owner (``state.job.JobContext``) is made, counted in hand for the
        stop (given up at once past the stop's deadline) and journaled, so a
        SIGKILL from here on leaves it for the next start to fault. None when
        the answer carries no usable job id. Runs on the thread the answer
        arrived on (the loop's, or the pop's beside a submit).

        Args:
            body: the pop's own body (its ``model_id`` and ``chat_features``).
            pop: the pop's answer.
            popped_at: when it arrived, monotonic seconds on the ports' clock.
            pop_wait_s: seconds the pop waited for that answer (the job's
                first wait on the Horde, said on its submit line).
        """
        raw_id = pop.get("id")
        if not (isinstance(raw_id, str) and raw_id):
            return None
        settings = self.settings
        declared = body.get("chat_features")
        ctx = JobContext(
            id=raw_id,
            kind="chat" if pop.get("chat") is True else "text",
            lease=Lease.from_pop(
                pop, popped_at, settings.lease_s, settings.lease_cap_s
            ),
            started=popped_at,
            model_id=str(body.get("model_id") or settings.model_id),
            declared_features=tuple(map(str, declared)) if isinstance(declared, list) else (),
            worker_id=self.worker_id,
            popped_in_stop=self.state.stop_deadline is not None,
            pop_wait_s=pop_wait_s,
            stop_generation=self.ports.koboldcpp.stop_generation,
            journal=self.ports.journal,
            clock=self.ports.clock,
            steps=self.steps,
            request=request_digest(pop),
        )
        self.state.hold(ctx)
        ctx.record()
        ctx.move(Move.JOURNAL)
        return ctx

    # ------------------------------------------------------ serve and settle

    def drive(self, ctx: JobContext, pop: dict[str, Any]) -> None:
        """Serve the job in hand from its pop's answer ``pop`` and settle it: it
        ends in one terminal action (or none, on purpose), whatever goes wrong.

        Raises:
            BaseException: a forced exit (a second SIGINT or SIGTERM), after the
                loop's jobs were faulted with one quick submit each.
            Exception: an unexpected error after the job's life ended.
        """
        try:
            self._drive(ctx, pop)
        except Exception:
            if ctx.settled:
                raise
            # Whatever went wrong, a popped job is answered: never left to expire.
            log.exception("job=%s unexpected error while serving it; faulting it", ctx.id)
            self.pipeline.fault_after_error(ctx, JobFault("internal error"))
        except BaseException:
            # A forced exit: stop koboldcpp's generation, one quick fault, then go.
            self.fault_jobs_now()
            raise

    def _drive(self, ctx: JobContext, pop: dict[str, Any]) -> None:
        if self._held_back(ctx):
            return
        try:
            job = parse_pop(pop, default_ttl_s=self.settings.lease_s)
        except PayloadError as exc:
            self.hooks.payload_read()
            log.warning("job=%s malformed payload at %s: %s", ctx.id, exc.path, exc.problem)
            self._settle_fault(ctx, JobFault("malformed payload"))
            return
        if job is None:  # an id, yet no job the payload describes
            self._settle_fault(ctx, JobFault("malformed payload"))
            return
        self.hooks.payload_read()
        ctx.begin()
        if isinstance(job, ChatJob) and self.state.first_chat_job():
            log.info("worker %d: %s", self.worker_id, first_chat_job_line(self.settings))
        try:
            outcome = self._serve(ctx, job)
        except JobFault as fault:
            if fault.backend_failed:
                # A killed koboldcpp shows as no answer, a reset or a stream cut
                # short; check it is up before the next pop.
                self.hooks.backend_failed()
                self.meter.failed(ctx, job)
            self._settle_fault(ctx, fault)
            return
        except JobEnded as ended:
            # Cancelled or ended by the Horde: nothing to send.
            if ended.counted:  # its lease ran out: an aborted job on the Horde
                self.meter.ended_by_horde(ctx, job)
            ctx.end(Move.NO_SUBMIT)
            self.state.release(ctx)
            self.hooks.generation_ended()
            return
        ctx.move(Move.OUTCOME)
        if ctx.request:  # it does not always fail
            with self.state.lock:
                self.state.refaults.served(ctx.request)
        self.hooks.generation_ended()
        self.meter.generated(ctx, job, outcome.body)
        seconds = self.ports.clock.monotonic() - ctx.started
        self.hooks.terminal_action_next(ctx, is_fault=False)
        if self.hooks.reply_beside(ctx, outcome):
            return
        self.pipeline.reply(ctx, outcome.body, detail=outcome.detail, on_refused=outcome.on_refused)
        if seconds > 0:
            self._check_suspicion(reply_tokens(outcome.body) / seconds)

    def _held_back(self, ctx: JobContext) -> bool:
        """A job of a request this worker faulted twice lately (``state/refaults.py``):
        neither generated nor faulted, released without a submit so that its lease
        runs out. The Horde's sweep then aborts it (one aborted job, counted here
        now) and marks the request faulted, instead of a third fault handing the
        request straight back. True when so released."""
        now = self.ports.clock.monotonic()
        with self.state.lock:
            held = bool(ctx.request) and self.state.refaults.hold(ctx.request, now)
            backend_failed = held and self.state.refaults.backend_failed(ctx.request)
        if not held:
            return False
        self.hooks.payload_read()
        if backend_failed:  # as koboldcpp failed it: toward the streak that probes it
            self.hooks.backend_failed()
            self.meter.failed_again(ctx)
        log.warning(
            "job=%s kind=%s not served: its request was faulted here twice lately and "
            "came back; left to expire (one aborted job), so the Horde marks it faulted "
            "instead of handing it back again",
            ctx.id,
            ctx.kind,
        )
        self.state.record_expired(now, ctx.kind)
        self.state.record_dropped()
        ctx.end(Move.NO_SUBMIT)
        self.state.release(ctx)
        return True

    def _check_suspicion(self, tokens_per_s: float) -> None:
        """The first job served faster than the Horde allows an untrusted owner's
        worker (``status.SUSPICION_TOKENS_PER_S``): ask the Horde once whether the
        key's owner is trusted (``find_user``) and, when not, say so in one line.
        Best effort: a Horde that does not answer is asked no more."""
        if tokens_per_s <= SUSPICION_TOKENS_PER_S:
            return
        with self.state.lock:
            if self.state.owner_checked:
                return
            self.state.owner_checked = True
            trusted = self.state.owner_trusted
        if trusted is not None:  # the start's key check said it
            if not trusted:
                log.warning("%s", suspicion_line(tokens_per_s))
            return
        horde = self.ports.horde
        if not isinstance(horde, FindsUser):
            return
        try:
            user = horde.find_user(timeout_s=FIND_USER_TIMEOUT_S)
        except HordeError as exc:
            log.debug("whether the key's owner is trusted is not known: %s", exc)
            return
        if user.get("trusted") is False:
            log.warning("%s", suspicion_line(tokens_per_s))

    def _serve(self, ctx: JobContext, job: ChatJob | TextJob) -> Outcome:
        """The job's run, its steps between the driver's moves. Returns the reply.

        Raises:
            JobFault: the job is not served (given up, popped after the stop's
                signal, koboldcpp changed, or a step failed).
            JobEnded: the client cancelled it or the Horde ended it.
        """
        ctx.check_abandoned()  # given up already: popped after the stop's deadline
        if ctx.popped_in_stop:
            # The stop has a deadline the job's generation cannot be known to
            # meet. Faulted now, the request goes to another worker at once;
            # left to expire, it would wait out the lease first, and the Horde
            # counts either as an aborted job (abort(), then wp.n += 1).
            raise JobFault("popped after the stop's signal: not generated")
        changed = self.hooks.backend_changed(ctx)
        if changed is not None:
            raise JobFault(f"{changed}: the job was popped under the old declaration")
        if isinstance(job, ChatJob):
            chat = ChatRun(self.ports, self.caps, self.state, job, ctx)
            chat.received()
            ctx.move(Move.PREPARE)
            messages = chat.prepare()
            return chat.generate(messages, ctx.start_generation())
        text = TextRun(self.ports, job, ctx)
        text.received()
        genkey = ctx.start_generation()
        self.hooks.text_generation_starts(ctx, job_max_length(job.payload))
        return text.generate(genkey)

    def _settle_fault(self, ctx: JobContext, fault: JobFault) -> None:
        """Settle the job with its fault (seed "7. Fault a job"), the pop beside it."""
        if ctx.phase is Phase.GENERATING:
            self.hooks.generation_ended()
        self.hooks.terminal_action_next(ctx, is_fault=True)
        self.pipeline.fault(ctx, fault)

    # ------------------------------------------------------------ the exit

    def fault_jobs_now(self) -> None:
        """Fault the jobs this loop holds with one quick submit each (the process
        exits now). Each job is given up first, so that the loop, whose
        generation the abort ends, sends nothing more for it."""
        for ctx in self.state.jobs_in_hand(self.worker_id):
            if ctx.phase is Phase.SETTLING:
                continue  # its submit is on the wire: the journal keeps it if that fails
            ctx.give_up("the worker is exiting")
            self.pipeline.fault_now(ctx)
