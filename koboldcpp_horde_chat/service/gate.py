"""The pop gate: whether the pop loop may pop now, and how long to wait when not.

Seed "The pop loop": pop only when the job can be served. The gate yields to a
local user and to a busy koboldcpp, waits while koboldcpp does not answer, while
a submit is retried, near the Horde's hourly limit of aborted jobs, and while
chat is withdrawn; it probes a koboldcpp (or a kind of job) that fails every
generation with one the size of its failed job (``state.probes``).
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import threading
from typing import TYPE_CHECKING, Any

from ..errors import BackendError, ReplyError
from ..inflight import STOP_KIND
from ..koboldcpp.answers import parse_chat_completion, text_generation
from ..koboldcpp.manners import OWN_TAIL_S
from ..state.journal import GENKEY_PREFIX
from ..state.lease_figures import MIN_PROCESS_SAMPLE, PerfFigures, budget_s, tokens_of_text
from ..state.meter import record_generated
from ..state.ports import abort_quietly
from ..state.probes import ALL
from ..state.shared import HORDE_FAULT_LIMIT_PER_HOUR
from ..state.status import abort_limit_line

if TYPE_CHECKING:
    from .loop import Worker

log = logging.getLogger("koboldcpp_horde_chat.worker")

#: Seconds between pops while the Horde keeps the worker in maintenance (also
#: while a chat-only worker's chat is withdrawn).
MAINTENANCE_POLL_S = 60.0
#: Seconds between checks of whether a submit retried on its own thread is settled.
SUBMIT_RETRY_POLL_S = 0.5
#: Seconds between checks of a busy koboldcpp within ``manners.OWN_TAIL_S`` of the
#: worker's own generation (it releases its model lock just after answering),
#: instead of every ``BUSY_POLL_S``.
OWN_TAIL_POLL_S = 0.01
#: Seconds between two checks of a koboldcpp busy with someone else's request.
BUSY_POLL_S = 0.2
#: The genkey koboldcpp's own Horde worker gives its generations (1.116.1
#: ``koboldcpp.py`` L10176: ``HORDEREQ_`` and a number from 100 to 999); this
#: worker's are longer (``state.job.new_genkey``).
KCPP_WORKER_GENKEY = re.compile(GENKEY_PREFIX + r"[1-9][0-9]{2}")
#: Seconds between two checks while a local user is generating.
LOCAL_USER_POLL_S = 1.0
#: A probe's shortest read timeout, seconds (else the budget of a job's lease,
#: ``lease_fit.budget_s``: a probe that does not end within it failed as a job
#: would); at the stop's deadline it is hung up whatever is left of it.
PROBE_TIMEOUT_S = 10.0
#: The read timeout of the abort of a probe hung up at the stop, seconds.
PROBE_ABORT_TIMEOUT_S = 1.0
#: The probe of a subject whose failed job's size is not known: a short text
#: generation, as a Horde job's (its genkey is the worker's own, so koboldcpp
#: does not take it for a local user's).
PROBE_MAX_LENGTH = 16
PROBE_PROMPT = "Once upon a time"
#: The words a probe's prompt repeats to reach a failed job's size (each about
#: one token in the usual vocabularies).
PROBE_WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then")
#: Tokens a chat template and the fit check's allowances add to a probe's
#: message (``translate.fit``: 32, and 16 for the one message).
CHAT_PROBE_OVERHEAD = 48
#: A re-measure (``lease_fit``) that answers fewer tokens than this (an early
#: stop) measures no generation speed.
REMEASURE_MIN_TOKENS = 8


def probe_prompt(tokens: int) -> str:
    """A prompt of about ``tokens`` tokens (:data:`PROBE_PROMPT`, then :data:`PROBE_WORDS`)."""
    words = [PROBE_WORDS[i % len(PROBE_WORDS)] for i in range(tokens - 4)]
    return " ".join([PROBE_PROMPT, *words])


class PopGate:
    """Whether the pop loop may pop now, and how long to wait when not."""

    def __init__(self, worker: Worker) -> None:
        self.manners, self.backend, self.state = worker.manners, worker.backend, worker.state
        self.settings, self.clock = worker.settings, worker.clock
        self.backend_suspect = False
        self._own_done_at: float | None = None
        #: koboldcpp's figures of each probe: the job meter's reader, so each is read once.
        self.figures = worker.meter.figures
        #: The worker's own generation runs: a busy koboldcpp with nothing queued is busy with it.
        self.own_running = False
        #: The words of the last pause when not its reason's own, else None.
        self.line: str | None = None
        self._abort_line: tuple[tuple[int, int], str] | None = None

    def pause(self) -> tuple[str, float] | None:
        """Why the loop must not pop now (a ``status.PAUSE_REASONS`` key) and how
        many seconds to wait; None to pop (after any re-measure that is due).
        Probes a failing koboldcpp or kind of job when due; :attr:`line` says
        until when the aborted-job limit waits."""
        self.line = None
        last_local = self.manners.last_local_request_time()
        # Not answering even an idle read: do not pop a job it cannot serve.
        self.backend_suspect = self.backend_suspect or self.manners.unreachable
        if last_local is not None and self.clock.time() - last_local < self.settings.local_idle_s:
            return self._who_else("local_user"), LOCAL_USER_POLL_S
        # koboldcpp holds its lock 50 ms after answering the worker's own request:
        # when nobody waits for it, pop now (the next request only queues behind
        # that tail).
        if self.manners.model_busy() and (not self.own_tail() or self.manners.requests_queued()):
            wait_s = OWN_TAIL_POLL_S if self.own_tail() else BUSY_POLL_S
            return self._who_else("busy", genkey=self.manners.running_genkey()), wait_s
        if self.backend_suspect:
            # koboldcpp failed a job without answering: wait while it does not answer
            # its readiness GET (a crashed koboldcpp would fault every job popped
            # meanwhile), or came back serving another model or context.
            self.backend_suspect = not self.backend.ready()
            if self.backend_suspect or self.manners.recheck() is not None:
                return "backend_down", self.settings.backend_probe_s
        if self.state.retrying_submits:
            # A job popped now could not be delivered either: it would expire.
            return "submit_retry", SUBMIT_RETRY_POLL_S
        if self.state.failure_streak.failing and not self._probe_until_generates(ALL, "text"):
            # koboldcpp fails generations of every kind together: probed back first.
            return "backend_failing", self._next_probe_in([ALL])
        if (limit := self.state.abort_limit(self.clock.monotonic())) is not None:
            count, in_hand, resume_at = limit
            wait_s = max(0.0, resume_at - self.clock.monotonic())
            if self._abort_line is None or self._abort_line[0] != (count, in_hand):
                # Worded once per count: said again only when it changes.
                self._abort_line = ((count, in_hand), abort_limit_line(
                    count=count, in_hand=in_hand, limit=HORDE_FAULT_LIMIT_PER_HOUR,
                    resume_wall=math.ceil(self.clock.time() + wait_s), wait_s=wait_s))
            self.line = self._abort_line[1]
            return "abort_limit", min(max(wait_s, 0.1), MAINTENANCE_POLL_S)
        if not self.state.update_chat_withdrawal(self.clock.monotonic()):
            return "chat_withdrawn", MAINTENANCE_POLL_S
        for kind in self.failing_kinds():  # withdrawn until its probe generates
            self._probe_until_generates(kind, kind)
        if not self.state.kinds_to_pop():
            return "kind_failing", self._next_probe_in(self.failing_kinds())
        self.remeasure()
        return None

    def failing_kinds(self) -> list[str]:
        """The kinds koboldcpp fails alone, each withdrawn until its probe generates."""
        return [kind for kind in ("text", "chat") if self.state.failure_streak.kind_failing(kind)]

    def _who_else(self, reason: str, *, genkey: str | None = None) -> str:
        """``reason`` named by who keeps koboldcpp busy, when the worker can tell:
        ``"kcpp_worker"`` (koboldcpp's own Horde worker, by its flag or its
        three-digit genkey) or ``"same_worker"`` (a genkey of this package's
        shape that no job of this process holds: another process)."""
        if genkey is not None and genkey.startswith(GENKEY_PREFIX):
            if KCPP_WORKER_GENKEY.fullmatch(genkey):
                return "kcpp_worker"
            if not any(ctx.genkey == genkey for ctx in self.state.jobs_in_hand()):
                return "same_worker"
        if self.manners.own_worker_running():
            return "kcpp_worker"
        return reason

    def own_tail(self) -> bool:
        """True while the worker's own generation runs and within ``OWN_TAIL_S`` of its end."""
        own = self._own_done_at
        return self.own_running or (own is not None and self.clock.monotonic() - own < OWN_TAIL_S)

    def own_generation_ended(self) -> None:
        self.own_running = False
        self._own_done_at = self.clock.monotonic()

    def _probe_until_generates(self, subject: str, kind: str) -> bool:
        """Probe a failing subject (:data:`ALL` or one kind) when its wait is
        over (60 s, then twice the last) with a generation of its failed job's
        size (``(prompt tokens, max_length)``, else the default probe), measured
        like a job's; True when it generated (the subject is declared again, on
        probation)."""
        plan = self.state.probe_plan
        with self.state.lock:
            if not plan.due(subject, self.clock.monotonic()):
                return False
            prompt_tokens, max_length = plan.size(subject) or (0, PROBE_MAX_LENGTH)
        max_length = max_length or PROBE_MAX_LENGTH
        measured = self._generate(kind, prompt_tokens, max_length)
        if measured is None:
            with self.state.lock:
                plan.wait_next(subject, self.clock.monotonic())
            return False
        tokens, seconds, figures = measured
        record_generated(
            self.state, kind, tokens, seconds, max_length=max_length,
            ttl_s=self.state.lease_fit.lease_s, now=self.clock.monotonic(), figures=figures,
        )
        with self.state.lock:
            plan.probe_succeeded(subject)
            self.state.failure_streak.probation(None if subject == ALL else kind)
        return True

    def _next_probe_in(self, subjects: list[str]) -> float:
        plan = self.state.probe_plan
        times = [at for subject in subjects if (at := plan.next_at(subject)) is not None]
        return max(0.1, min(times, default=self.clock.monotonic() + 0.1) - self.clock.monotonic())

    def remeasure(self) -> None:
        """Re-measure koboldcpp for each kind whose lowered limits are due it, with a
        generation the size of the job that ran out, and refit them from its
        figures (one line per change): a koboldcpp fast again gets its limits
        back. A failed probe refits nothing and doubles the cool-off."""
        with self.state.lock:
            due = self.state.lease_fit.recheck_due(self.clock.monotonic())
            sizes = [(kind, self.state.lease_fit.probe_size(kind)) for kind in due]
        for kind, (prompt_tokens, max_length) in sizes:
            measured = self._generate(kind, prompt_tokens, max_length)
            speed = process_s = None
            if measured is not None:
                tokens, seconds, figures = measured
                if figures is not None and figures.eval_s > 0 and figures.tokens > 0:
                    speed = figures.tokens / figures.eval_s
                elif tokens >= REMEASURE_MIN_TOKENS and seconds > 0:
                    speed = tokens / seconds
                process_s = figures.prompt_s_per_token() if figures is not None else None
                if process_s is None and prompt_tokens >= MIN_PROCESS_SAMPLE and seconds > 0:
                    # No figures: all its time on the prompt (an upper bound).
                    process_s = seconds / prompt_tokens
            now = self.clock.monotonic()
            with self.state.lock:
                changes = self.state.lease_fit.remeasured(kind, speed, now, process_s=process_s)
            for change in changes:
                log.warning("%s", change.line())

    def _generate(
        self, kind: str, prompt_tokens: int, max_length: int
    ) -> tuple[int, float, PerfFigures | None] | None:
        """A generation of ``kind`` sent as the worker's own (a ``HORDEREQ_`` genkey,
        so koboldcpp does not take it for a local user's), within a job's budget:
        ``(tokens, seconds, koboldcpp's figures or None)``, or None when it failed."""
        genkey = f"{GENKEY_PREFIX}probe{secrets.token_hex(8)}"
        cancel = threading.Event()

        def hang_up() -> None:  # the stop's deadline came: end it as a job's
            cancel.set()
            self.backend.hang_up()

        fit = self.state.lease_fit
        timeout_s = max(PROBE_TIMEOUT_S, budget_s(fit.lease_s, fit.margin_s))
        started = self.clock.monotonic()
        self.manners.note_own_request()
        try:
            with self.state.call_deadlines.until(STOP_KIND, hang_up):
                if kind == "chat":
                    content = probe_prompt(max(1, prompt_tokens - CHAT_PROBE_OVERHEAD))
                    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}],
                                            "max_tokens": max_length, "genkey": genkey}
                    answer = parse_chat_completion(
                        self.backend.chat_completion(body, timeout_s=timeout_s, cancel=cancel))
                    text = (answer.content or "") + (answer.reasoning_content or "")
                    counted = answer.completion_tokens
                    tokens = counted if counted is not None else tokens_of_text(text)
                else:
                    body = {"prompt": probe_prompt(prompt_tokens), "max_length": max_length,
                            "max_context_length": max(512, prompt_tokens + max_length + 16),
                            "genkey": genkey}
                    tokens = tokens_of_text(text_generation(
                        self.backend.generate(body, timeout_s=timeout_s, cancel=cancel)))
        except (BackendError, ReplyError) as exc:
            if not cancel.is_set():  # else aborted below, as hung up at the stop
                if isinstance(exc, BackendError) and exc.status == 0:
                    abort_quietly(self.backend, genkey)  # timed out: it runs on in koboldcpp
                return None
        finally:
            self.manners.note_own_request_done()
            self.own_generation_ended()
        if cancel.is_set():
            try:  # a generation hung up runs on inside koboldcpp
                self.backend.abort(genkey, timeout_s=PROBE_ABORT_TIMEOUT_S)
            except BackendError:
                log.debug("the probe's abort at the stop failed", exc_info=True)
            return None
        return tokens, self.clock.monotonic() - started, self.figures.read()
