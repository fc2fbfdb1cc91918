"""A job's outcome fed to the lease fit and the failure streak, under the
state's lock, with the lines they say (seed "Streaming progress": a slow
worker loses the job when the lease expires; step 7: an aborted job counts
toward the Horde's maintenance)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..horde.pop import ChatJob, TextJob
from ..koboldcpp.api import KcppAPI
from .job import SUBMIT_MARGIN_S, JobContext
from .lease_figures import (
    LengthChange,
    PerfFigures,
    job_max_length,
    perf_figures,
    perf_speed,
    reply_tokens,
)
from .shared import WorkerState

log = logging.getLogger("koboldcpp_horde_chat.worker")

#: A failed generation that ended this close to its lease's end, seconds, ran out of it.
RAN_OUT_SLACK_S = SUBMIT_MARGIN_S + 1.5
#: Read timeout of the ``/api/extra/perf`` look after a generation, seconds.
PERF_TIMEOUT_S = 2.0


class FiguresReader:
    """koboldcpp's figures of the generation that just ended, best effort: None
    when it does not answer, has none or has counted no new generation; after a
    generation aborted at its deadline, also when they are the last read's
    (koboldcpp counts a generation when it starts but writes its figures when
    it ends). Only with one loop: with several, the last generation may be
    another loop's."""

    def __init__(self, backend: KcppAPI, *, threads: int = 1) -> None:
        self.backend = backend
        self.threads = threads
        self._seen: int | None = None
        self._last: tuple[int, float, int, float] | None = None

    def saw(self, figures: PerfFigures) -> None:
        """``figures`` are known: reading them again is not a new generation."""
        self._seen = figures.generations
        self._last = (figures.prompt_tokens, figures.process_s, figures.tokens, figures.eval_s)

    def read(self, *, aborted: bool = False) -> PerfFigures | None:
        """The newest generation's figures (``aborted``: it was aborted at its deadline)."""
        if self.threads > 1:
            return None
        try:
            figures = perf_figures(self.backend.perf(timeout_s=PERF_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - only a measure; the job's own timing stands
            return None
        if figures is None or figures.generations == self._seen:
            return None
        last = self._last
        self.saw(figures)
        return None if aborted and self._last == last else figures


class JobMeter:
    """Feeds each job's outcome to ``state``'s rules; ``clock`` is monotonic
    seconds (the clock of ``ctx.started`` and the leases)."""

    def __init__(self, state: WorkerState, backend: KcppAPI, clock: Callable[[], float]) -> None:
        self.state = state
        self.clock = clock
        self.figures = FiguresReader(backend, threads=state.settings.threads)

    def read_speed(self) -> None:
        """koboldcpp's own figures before any job is measured (best effort)."""
        try:
            perf = self.figures.backend.perf()
        except Exception:  # noqa: BLE001 - only a hint; the jobs measure it anyway
            log.debug("koboldcpp's perf figures could not be read")
            return
        figures = perf_figures(perf)
        process_s = figures.prompt_s_per_token() if figures is not None else None
        with self.state.lock:
            changes = self.state.lease_fit.seed(perf_speed(perf), self.clock(), process_s=process_s)
        for change in changes:
            log.warning("%s (koboldcpp's own figure)", change.line())
        if figures is not None:
            self.figures.saw(figures)

    def generated(self, ctx: JobContext, job: TextJob | ChatJob, body: dict[str, Any]) -> None:
        """koboldcpp answered the job with the submit ``body``."""
        now = self.clock()
        record_generated(
            self.state, ctx.kind, reply_tokens(body), now - ctx.started,
            max_length=job_max_length(job.payload), ttl_s=job.ttl_s, now=now,
            figures=self.figures.read(), probe=False,
        )

    def failed(self, ctx: JobContext, job: TextJob | ChatJob) -> None:
        """koboldcpp failed the job's generation."""
        now = self.clock()
        ran_out = ctx.lease.remaining(now) <= RAN_OUT_SLACK_S
        # The aborted generation's figures: did it produce anything by its deadline?
        figures = self.figures.read(aborted=True) if ran_out else None
        produced = figures.tokens if figures is not None else None
        self._failed(ctx, job, ran_out=ran_out, now=now, produced=produced)

    def failed_again(self, ctx: JobContext) -> None:
        """A job of a request koboldcpp failed twice lately, left to expire
        (``state/refaults.py``): one more failed generation for the streak."""
        self._say(ctx.kind, [], self._streak_failed(ctx.kind))

    def ended_by_horde(self, ctx: JobContext, job: TextJob | ChatJob) -> None:
        """The Horde ended the job during its generation (``ChatJobAborted``)."""
        now = self.clock()
        self.state.record_expired(now, ctx.kind)
        self._failed(ctx, job, ran_out=True, now=now, produced=None)

    def _failed(
        self, ctx: JobContext, job: TextJob | ChatJob, *, ran_out: bool, now: float,
        produced: int | None,
    ) -> None:
        """A run-out teaches the lease fit (``LeaseFit.ran_out``); every failure
        counts toward the streak and sizes the probe that follows it."""
        state, kind, max_length = self.state, ctx.kind, job_max_length(job.payload)
        with state.lock:
            state.lease_fit.note_lease(job.ttl_s)
            changes = state.lease_fit.ran_out(
                kind, max_length=max_length, seconds=now - ctx.started, now=now,
                prompt_tokens=ctx.prompt_tokens, produced=produced,
            ) if ran_out else []
            state.probe_plan.note_failed(kind, ctx.prompt_tokens, max_length)
            others = self._streak_failed(kind)
        self._say(kind, changes, others)

    def _streak_failed(self, kind: str) -> list[str] | None:
        """Counts a failed generation; when it withdraws ``kind``, the kinds still popped."""
        with self.state.lock:
            if not self.state.failure_streak.failed(kind):
                return None
            return [k for k in self.state.kinds_to_pop() if k != kind]

    def _say(self, kind: str, changes: list[LengthChange], others: list[str] | None) -> None:
        """The fit's ``changes``; ``others``: the kinds still popped, ``kind`` withdrawn."""
        for change in changes:
            log.warning("%s", change.line())
        if others is None:
            return
        if not others:
            action = "not popping (no other kind to serve)"
        elif kind == "chat":
            action = "popping without the chat declaration (text jobs continue)"
        else:
            action = "popping for chat jobs only (prompt_jobs false)"
        log.warning(
            "%s generations failed %d times in a row: %s; probing koboldcpp with %s the size "
            "of the failed job until one succeeds", kind, self.state.failure_streak.limit, action,
            "a chat completion" if kind == "chat" else "a text generation",
        )


def record_generated(
    state: WorkerState, kind: str, tokens: int, seconds: float, *, max_length: int,
    ttl_s: float, now: float | None = None, figures: PerfFigures | None = None, probe: bool = True,
) -> None:
    """koboldcpp answered a ``kind`` job or ``probe`` with ``tokens`` in
    ``seconds``: refit the declared limits and end a failure streak (a line
    each). A real job also counts toward the probes' reset (``state.probes``)."""
    with state.lock:
        state.lease_fit.note_lease(ttl_s)
        changes = state.lease_fit.record(
            kind, tokens, seconds, max_length=max_length, now=now, figures=figures
        )
        restored = state.failure_streak.succeeded(kind)
        if not probe:
            state.probe_plan.job_succeeded(kind)
    for change in changes:
        log.warning("%s", change.line())
    if restored and kind == "chat":
        log.info("koboldcpp generates chat completions again: declaring chat again")
    elif restored:
        log.info("koboldcpp generates text again: popping for text jobs again")
