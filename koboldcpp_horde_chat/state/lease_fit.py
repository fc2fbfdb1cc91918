"""A declared ``max_length`` and ``max_context_length`` that koboldcpp processes
and generates within the job's lease (pure; no I/O).

Seed "Streaming progress": "The job's lease is the pop's ttl, 150 seconds"
and "A job without progress keeps the base lease"; "The pop prefers workers
with enough measured capacity to generate max_length within 120 seconds" and
"a slower worker without progress can lose the job when the lease expires".
A lost job is an aborted job on the Horde (its ``log_aborted_job``), and more
than 20 in its hour put the worker into maintenance.

The model of the host, per kind (``"text"``, ``"chat"``), from the worker's own
jobs and probes (koboldcpp's ``/api/extra/perf`` after each: ``last_input_count``
prompt tokens processed in ``last_process_time`` seconds, ``last_token_count``
tokens generated in ``last_eval_time``; without those figures, the reply's
tokens over the job's seconds, prompt processing included):

* ``p``: seconds to process one prompt token (:meth:`LeaseFit.process_s`);
* ``g``: tokens generated per second (:meth:`LeaseFit.speed`).

A job of ``C`` tokens of context and ``L`` of ``max_length`` takes at most
``(C - l) * p + l / g`` for the ``l <= L`` tokens it generates (koboldcpp keeps
``C - l`` of the prompt), so at most ``C * p + L * max(0, 1/g - p)``. The seed's
capacity rule is the budget ``B`` (:func:`budget_s`: :data:`FIT_SHARE` of the
base lease, 120 s of 150, and the submit's margin short of its end). The fit
(:func:`fitted_limits`):

1. ``L = g * B`` (what generates within the budget; the seed's rule), at most
   the operator's ``--hordegenlen`` (``cap``);
2. ``C = (B - L * max(0, 1/g - p)) / p``, at most the declared context
   (``context_cap``);
3. when that leaves less than :data:`MIN_PROMPT_TOKENS` of prompt
   (``C < L + MIN_PROMPT_TOKENS``), ``L`` is lowered until it does.

So a slow prompt narrows the context, and the length of every reply stays
what generation allows. The Horde matches a request on the context it asks
for, not on its prompt's length: while the context is narrowed, a request
asking for more is skipped however short its prompt (the price of not
losing the long ones); requests asking for a context that fits keep being
served.

A job that runs out of its lease (:meth:`LeaseFit.ran_out`, with its prompt's
tokens ``P``, its ``max_length`` ``L`` and the ``T`` seconds it had) teaches
what it shows:

* when the measured figures predict it within :data:`HANG_SHARE` of ``T``
  (``P * p + L / g <= T / 2``), it was not slow: koboldcpp hung. A failure
  (the streak counts it), no lesson: nothing is lowered;
* when the prompt's share is the larger (``P * p >= L / g``; with no ``p``
  measured, generation alone cannot explain it and a prompt token processed
  as slowly as two generated ones can), the prompt was slow: ``p`` is
  at least ``(T - L / g) / P``, and the context is refitted from it (the
  failed job no longer fits; ``max_length`` stays);
* else (also whenever koboldcpp's figures of the aborted generation show
  tokens generated) generation was slow: ``max_length`` is narrowed to half the job's own
  and to what fewer than ``L / T`` tokens/s fit (as it always was);
* with no figure at all, a prompt of :data:`LONG_PROMPT_TOKENS` or more
  (and longer than the job's ``max_length``) was slow; a shorter one teaches
  nothing (it may as well have hung): the measured figures of the next jobs
  and probes will tell.

Limits come back up only after the kind's *cool-off* (:data:`RECHECK_AFTER_S`,
60 s at first): a run-out holds every raise of its kind until then, whatever
is measured meanwhile (a probe never ends a cool-off early). A kind declared
below its caps that has had no measured job for its cool-off is due a
re-measure (:meth:`LeaseFit.recheck_due`): the worker times a generation of
its own the size of the job that ran out, or of the measured job that
lowered the context (:meth:`LeaseFit.probe_size`: koboldcpp processes a short
prompt faster per token than a long one, so a short probe would raise what the
long job lowered, and the next long job lower it again),
``service.gate``), and :meth:`LeaseFit.remeasured` refits the kind from its
figures alone. The cool-off doubles, up to :data:`RECHECK_MAX_S` (30 min),
after each re-measure that raises nothing and after each run-out that comes
within :data:`HOUR_S` of a raise, so a koboldcpp that stays slow is neither
probed every minute nor lets a raise cost an aborted job every few minutes.
It is back to 60 s once the kind is declared at its caps.

Every change of a declared limit is returned as one :class:`LengthChange`,
which the caller logs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

KINDS: Final = ("text", "chat")
FIT_SHARE: Final = 0.8
"""The share of a job's base lease its generation may take (120 s of the 150 s ttl)."""
MIN_MAX_LENGTH: Final = 16
"""The smallest ``max_length`` declared, tokens (below it a reply says too little)."""
STEP: Final = 16
"""A fitted ``max_length`` is a multiple of this many tokens (steady declarations)."""
CONTEXT_STEP: Final = 64
"""A fitted ``max_context_length`` is a multiple of this many tokens."""
MIN_PROMPT_TOKENS: Final = 256
"""The fitted context leaves at least this many tokens to the prompt beside ``max_length``."""
MIN_PROCESS_SAMPLE: Final = 16
"""A prompt shorter than this, tokens, says too little about processing to be measured."""
LONG_PROMPT_TOKENS: Final = 1024
"""With nothing measured, a run-out's prompt this long (and longer than its
``max_length``) is taken for a slow prompt; a shorter one teaches nothing."""
HANG_SHARE: Final = 0.5
"""A run-out that the measured figures predict within this share of its time was a hang."""
RAISE_FACTOR: Final = 1.25
"""A lowered limit is raised only once the fit is this much larger (or reaches the cap)."""
MIN_SAMPLE_TOKENS: Final = 16
"""A reply shorter than this, tokens, says too little about the speed to be measured."""
SAMPLES_KEPT: Final = 8
"""The most recent measured jobs the speed is averaged over, per kind."""
RECHECK_AFTER_S: Final = 60.0
"""A kind declared below the cap is re-measured after this many seconds without
a measured job, at first (its cool-off; see the module docstring)."""
RECHECK_MAX_S: Final = 1800.0
"""The longest cool-off, seconds."""
HOUR_S: Final = 3600.0
"""A run-out this soon after a raise doubles the kind's cool-off, seconds."""
PROBE_PROMPT_TOKENS: Final = 256
"""The prompt of a re-measure when no job of the kind ran out (tokens)."""
PROBE_MAX_LENGTH: Final = 64
"""The ``max_length`` of a re-measure when no job of the kind ran out (tokens)."""


@dataclass(frozen=True)
class LengthChange:
    """A changed declaration: ``kind``'s ``max_length`` (or, with ``what``, its
    ``max_context_length``) went from ``old`` to ``new``.

    Attributes:
        kind: ``"text"`` or ``"chat"``.
        old, new: the declared value before and after, tokens.
        tokens_per_s: the measured speed behind it, or None (a job ran out of its lease).
        budget_s: the seconds a job's generation may take (:func:`budget_s`).
        remeasured: the figures are a re-measure of an idle kind (:meth:`LeaseFit.remeasured`).
        what: ``"max_length"`` or ``"max_context_length"``.
        process_tokens_per_s: the measured prompt processing speed behind a
            context change, or None.
        prompt_tokens: the prompt of the job that ran out, for a context
            change it caused (None otherwise).
    """

    kind: str
    old: int
    new: int
    tokens_per_s: float | None
    budget_s: float
    remeasured: bool = False
    what: str = "max_length"
    process_tokens_per_s: float | None = None
    prompt_tokens: int | None = None

    def line(self) -> str:
        """The one log line for the change, e.g. ``"max_length for text jobs lowered
        from 512 to 112: koboldcpp generates 1.0 tokens/s here, and a job's generation
        must end within 120 s of its lease"``; a re-measure says ``"koboldcpp
        generates 40.0 tokens/s here again (measured with a generation of the
        worker's own), ..."``; a context ``"max_context_length for chat jobs
        lowered from 4096 to 2368: a job's prompt of 3500 tokens ran out of its
        lease"``."""
        verb = "lowered" if self.new < self.old else "raised"
        if self.what == "max_context_length":
            if self.prompt_tokens is not None:
                why = f"a job's prompt of {self.prompt_tokens} tokens ran out of its lease"
            else:
                speeds = (
                    f"koboldcpp processes {self.process_tokens_per_s:.1f} prompt tokens/s"
                    if self.process_tokens_per_s
                    else "koboldcpp's prompt processing"
                )
                if self.tokens_per_s:
                    speeds += f" and generates {self.tokens_per_s:.1f} tokens/s"
                again = " again (measured with a generation of the worker's own)"
                why = (
                    f"{speeds} here{again if self.remeasured else ''}, and a job must "
                    f"end within {self.budget_s:.0f} s of its lease"
                )
        elif self.tokens_per_s is not None and self.remeasured:
            why = (
                f"koboldcpp generates {self.tokens_per_s:.1f} tokens/s here again (measured "
                f"with a generation of the worker's own), and a job's generation "
                f"must end within {self.budget_s:.0f} s of its lease"
            )
        elif self.tokens_per_s is None:
            why = "a job's generation ran out of its lease"
        else:
            why = (
                f"koboldcpp generates {self.tokens_per_s:.1f} tokens/s here, and a job's "
                f"generation must end within {self.budget_s:.0f} s of its lease"
            )
        return f"{self.what} for {self.kind} jobs {verb} from {self.old} to {self.new}: {why}"


@dataclass(frozen=True)
class PerfFigures:
    """koboldcpp's figures of its last generation (``/api/extra/perf``).

    Attributes:
        prompt_tokens: ``last_input_count``, tokens.
        process_s: ``last_process_time``, seconds.
        tokens: ``last_token_count``, tokens generated.
        eval_s: ``last_eval_time``, seconds.
        generations: ``total_gens``, koboldcpp's count of generations (tells
            whether the figures are of a new one).
    """

    prompt_tokens: int
    process_s: float
    tokens: int
    eval_s: float
    generations: int


def tokens_of_text(text: str) -> int:
    """Tokens of a text reply as the Horde estimates them: ``ceil(chars / 4)``
    (its ``get_things_count``), at least 0."""
    return math.ceil(len(text) / 4)


def job_max_length(payload: Mapping[str, Any]) -> int:
    """A job payload's ``max_length``, tokens (0 when it has none that is valid)."""
    value = payload.get("max_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def reply_tokens(body: Mapping[str, Any]) -> int:
    """Tokens of a reply's submit body: ``completion_tokens`` when koboldcpp
    counted them (a chat reply), else the Horde's estimate of the reply's text
    (:func:`tokens_of_text` of the message's content and reasoning, or of the
    text job's ``generation``)."""
    counted = body.get("completion_tokens")
    if isinstance(counted, int) and not isinstance(counted, bool) and counted >= 0:
        return counted
    message = body.get("message")
    if isinstance(message, Mapping):
        text = "".join(str(message.get(key) or "") for key in ("content", "reasoning_content"))
        return tokens_of_text(text)
    return tokens_of_text(str(body.get("generation") or ""))


def budget_s(lease_s: float, margin_s: float = 0.0) -> float:
    """The seconds a generation may take in a ``lease_s`` lease: :data:`FIT_SHARE`
    of it, and no more than ``margin_s`` short of its end (the submit's margin):
    ``(150, 5) -> 120``, ``(20, 5) -> 15``."""
    return max(0.0, min(lease_s * FIT_SHARE, lease_s - margin_s))


def fitted_length(tokens_per_s: float, lease_s: float, cap: int, margin_s: float = 0.0) -> int:
    """The ``max_length`` generated within :func:`budget_s` of ``lease_s`` at ``tokens_per_s``.

    A multiple of :data:`STEP`, at least :data:`MIN_MAX_LENGTH` and at most
    ``cap`` (which wins when smaller): ``(1.0, 150, 512) -> 112``,
    ``(100.0, 150, 512) -> 512``.

    Raises:
        ValueError: a non-positive speed or lease.
    """
    if not (tokens_per_s > 0 and lease_s > 0):
        raise ValueError("tokens_per_s and lease_s must be positive")
    fit = int(tokens_per_s * budget_s(lease_s, margin_s)) // STEP * STEP
    return min(cap, max(MIN_MAX_LENGTH, fit))


def fitted_limits(
    *,
    tokens_per_s: float | None,
    process_s: float | None,
    lease_s: float,
    cap: int,
    context_cap: int,
    margin_s: float = 0.0,
) -> tuple[int, int]:
    """``(max_length, max_context_length)`` that process and generate within
    :func:`budget_s` of ``lease_s`` (the module docstring's steps 1 to 3).

    ``tokens_per_s`` is ``g`` (None: not measured, ``cap`` kept), ``process_s``
    is ``p``, seconds per prompt token (None: not measured, ``context_cap``
    kept). E.g. ``g`` 27 tokens/s and ``p`` 46 s per 2,400 prompt tokens in a
    150 s lease (5 s margin), caps 512 and 4096: ``(512, 4096)`` (the worst
    case, 3,584 prompt tokens and 512 generated, takes 88 s of 120); in a
    60 s lease: ``(512, 1984)``.

    Raises:
        ValueError: a non-positive lease or cap.
    """
    if not (lease_s > 0 and cap >= 1 and context_cap >= 1):
        raise ValueError("lease_s, cap and context_cap must be positive")
    length = cap if tokens_per_s is None else fitted_length(tokens_per_s, lease_s, cap, margin_s)
    if process_s is None or not process_s > 0:
        return length, context_cap
    budget = budget_s(lease_s, margin_s)
    per_generated = 1.0 / tokens_per_s if tokens_per_s else 0.0
    extra = max(0.0, per_generated - process_s)  # a generated token's cost beyond a prompt's
    context = (budget - length * extra) / process_s
    if context < length + MIN_PROMPT_TOKENS:
        # Too little room for a prompt: a shorter reply leaves it MIN_PROMPT_TOKENS.
        room = (budget - MIN_PROMPT_TOKENS * process_s) / max(per_generated, process_s)
        length = min(length, max(MIN_MAX_LENGTH, int(max(0.0, room)) // STEP * STEP))
        context = max(context, float(length + MIN_PROMPT_TOKENS))
    context_fit = int(context) // CONTEXT_STEP * CONTEXT_STEP
    floor = min(context_cap, length + MIN_PROMPT_TOKENS)
    return min(cap, length), min(context_cap, max(floor, context_fit))


def perf_speed(perf: Mapping[str, Any]) -> float | None:
    """koboldcpp's own measured generation speed from ``/api/extra/perf``, tokens/s.

    ``last_eval_speed`` once koboldcpp generated something (``total_gens`` > 0);
    None when it has no figure (a fresh koboldcpp answers 0) or the answer is
    not one.
    """
    gens = perf.get("total_gens")
    speed = perf.get("last_eval_speed")
    if isinstance(gens, bool) or not isinstance(gens, int) or gens <= 0:
        return None
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        return None
    return float(speed) if math.isfinite(speed) and speed > 0 else None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def perf_figures(perf: Mapping[str, Any]) -> PerfFigures | None:
    """The figures of koboldcpp's last generation from ``/api/extra/perf``
    (:class:`PerfFigures`), or None when it has none (``total_gens`` 0, a
    missing or non-numeric figure, no time measured)."""
    gens = perf.get("total_gens")
    if isinstance(gens, bool) or not isinstance(gens, int) or gens <= 0:
        return None
    values = [
        _number(perf.get(key))
        for key in ("last_input_count", "last_process_time", "last_token_count", "last_eval_time")
    ]
    prompt, process, tokens, evaluated = values
    if prompt is None or process is None or tokens is None or evaluated is None:
        return None
    if process <= 0 and evaluated <= 0:
        return None
    return PerfFigures(int(prompt), process, int(tokens), evaluated, gens)


class LeaseFit:
    """The per-kind declared ``max_length`` and ``max_context_length`` that fit the
    lease (see the module docstring).

    Args:
        cap: the operator's ``max_length`` (``--hordegenlen`` as declared), tokens.
        lease_s: the base lease, seconds (the pop's ``ttl``; 150).
        margin_s: seconds before the lease's end the generation must be over
            (the submit's margin).
        context_cap: the declared context (``--hordemaxctx`` or koboldcpp's),
            tokens; 0: the context is not fitted (declared as it is).

    Attributes:
        lease_s: the base lease the fit uses; :meth:`note_lease` updates it
            from each job's ``ttl``.
    """

    def __init__(
        self, cap: int, lease_s: float = 150.0, margin_s: float = 0.0, context_cap: int = 0
    ) -> None:
        if cap < 1 or not lease_s > 0 or context_cap < 0:
            raise ValueError("cap must be at least 1, lease_s positive, context_cap >= 0")
        self.cap = cap
        self.context_cap = context_cap
        self.margin_s = margin_s
        self.lease_s = float(lease_s)
        self._declared = {kind: cap for kind in KINDS}
        self._context = {kind: context_cap for kind in KINDS}
        self._samples: dict[str, deque[tuple[int, float]]] = {
            kind: deque(maxlen=SAMPLES_KEPT) for kind in KINDS
        }
        #: Per kind: prompts processed, ``(tokens, seconds)``.
        self._process: dict[str, deque[tuple[int, float]]] = {
            kind: deque(maxlen=SAMPLES_KEPT) for kind in KINDS
        }
        self._seed_speed: float | None = None
        self._seed_process: float | None = None
        #: Per kind: when it is due a re-measure (None: declared at the caps, or
        #: no clock given yet), its cool-off, when it was last raised, and until
        #: when no raise is allowed (a run-out's cool-off).
        self._recheck_at: dict[str, float | None] = {kind: None for kind in KINDS}
        self._cooloff = {kind: RECHECK_AFTER_S for kind in KINDS}
        self._raised_at: dict[str, float | None] = {kind: None for kind in KINDS}
        self._hold_until: dict[str, float | None] = {kind: None for kind in KINDS}
        #: Why each kind is declared below the cap: ``"ran_out"``, ``"slow"`` or None.
        self._why: dict[str, str | None] = {kind: None for kind in KINDS}
        #: The size of the last job of each kind that ran out: ``(prompt tokens, max_length)``.
        self._failed_size: dict[str, tuple[int, int] | None] = {kind: None for kind in KINDS}
        #: The size of the last measured job of each kind whose prompt figures
        #: lowered its context: ``(prompt tokens, max_length)``.
        self._lowering_size: dict[str, tuple[int, int] | None] = {kind: None for kind in KINDS}

    # ------------------------------------------------------------------ reading

    def declared(self, kind: str) -> int:
        """The ``max_length`` the next pop declares for ``kind``, tokens."""
        return self._declared[kind]

    def declared_context(self, kind: str) -> int | None:
        """The ``max_context_length`` the next pop declares for ``kind``, tokens
        (None: not fitted, the declaration's own)."""
        return self._context[kind] if self.context_cap else None

    def _below_caps(self, kind: str) -> bool:
        return self._declared[kind] < self.cap or (
            bool(self.context_cap) and self._context[kind] < self.context_cap
        )

    def lowered_because(self, kind: str) -> str | None:
        """Why ``kind``'s limits are below the caps, in an operator's words
        (``"koboldcpp ran out of a lease"``, ``"koboldcpp's measured speed"``),
        or None while it is declared at the caps."""
        if not self._below_caps(kind):
            return None
        if self._why[kind] == "ran_out":
            return "koboldcpp ran out of a lease"
        return "koboldcpp's measured speed"

    def cooloff_s(self, kind: str) -> float:
        """``kind``'s cool-off: seconds without a measured job before a re-measure."""
        return self._cooloff[kind]

    def held(self, kind: str, now: float | None) -> bool:
        """No raise of ``kind`` is allowed at ``now`` (a run-out's cool-off runs)."""
        hold = self._hold_until[kind]
        return now is not None and hold is not None and now < hold

    def speed(self, kind: str) -> float | None:
        """The measured speed of ``kind``'s jobs, tokens/s (their tokens over their
        seconds), else koboldcpp's own figure (:meth:`seed`), else None."""
        samples = self._samples[kind]
        seconds = sum(s for _, s in samples)
        if samples and seconds > 0:
            return sum(t for t, _ in samples) / seconds
        return self._seed_speed

    def process_s(self, kind: str) -> float | None:
        """The measured seconds per prompt token of ``kind``'s jobs (``p``), else
        koboldcpp's own figure (:meth:`seed`), else None."""
        samples = self._process[kind]
        tokens = sum(t for t, _ in samples)
        if samples and tokens > 0:
            return sum(s for _, s in samples) / tokens
        return self._seed_process

    def probe_size(self, kind: str) -> tuple[int, int]:
        """``(prompt tokens, max_length)`` of a re-measure of ``kind``: the last job
        of the kind that ran out, else the last measured job whose prompt lowered
        its context, else :data:`PROBE_PROMPT_TOKENS` and :data:`PROBE_MAX_LENGTH`
        (at most the declared ``max_length``)."""
        size = self._failed_size[kind] or self._lowering_size[kind]
        if size is not None:
            return size
        return PROBE_PROMPT_TOKENS, min(PROBE_MAX_LENGTH, self.cap)

    # ------------------------------------------------------------------ schedule

    def recheck_due(self, now: float) -> list[str]:
        """The kinds declared below their caps that are due a re-measure at ``now``
        (no measured job for their cool-off), in :data:`KINDS` order. A kind
        named here is not named again until :meth:`remeasured` or another
        measurement schedules it anew (at most one probe at a time)."""
        due = []
        for kind in KINDS:
            at = self._recheck_at[kind]
            if self._below_caps(kind) and at is not None and at <= now:
                self._recheck_at[kind] = None
                due.append(kind)
        return due

    def _schedule(self, kind: str, now: float | None) -> None:
        """The next re-measure of ``kind``: its cool-off after ``now`` while it is
        below its caps; none at the caps (and the cool-off back to its first)."""
        if not self._below_caps(kind):
            self._recheck_at[kind] = None
            self._cooloff[kind] = RECHECK_AFTER_S
            self._why[kind] = None
            self._failed_size[kind] = None
        elif now is not None:
            self._recheck_at[kind] = now + self._cooloff[kind]

    def note_lease(self, ttl_s: float) -> None:
        """A job's base lease (its pop's ``ttl``), seconds; a non-positive one is ignored."""
        if ttl_s > 0:
            self.lease_s = float(ttl_s)

    # ------------------------------------------------------------------ learning

    def seed(self, tokens_per_s: float | None, now: float | None = None,
             process_s: float | None = None) -> list[LengthChange]:
        """koboldcpp's own figures (:func:`perf_speed`; ``process_s`` seconds per
        prompt token) for kinds not measured yet (at monotonic ``now``, which
        schedules the re-measure of a kind it lowers)."""
        if process_s is not None and process_s > 0:
            self._seed_process = process_s
        if tokens_per_s is not None and tokens_per_s > 0:
            self._seed_speed = tokens_per_s
        elif self._seed_process is None:
            return []
        changes = [c for kind in KINDS for c in self._refit(kind)]
        for kind in KINDS:
            self._schedule(kind, now)
        return changes

    def record(
        self,
        kind: str,
        tokens: int,
        seconds: float,
        *,
        max_length: int,
        now: float | None = None,
        figures: PerfFigures | None = None,
    ) -> list[LengthChange]:
        """A ``kind`` job's reply came back: ``tokens`` generated in ``seconds``
        (at monotonic ``now``, which schedules the kind's next re-measure; None:
        none scheduled). With koboldcpp's ``figures`` of that generation, its
        prompt processing and its generation are measured apart.

        A reply shorter than :data:`MIN_SAMPLE_TOKENS` that stopped before the
        job's ``max_length`` says little about the speed and is not measured.
        Returns the changes of the declaration it makes.
        """
        if seconds <= 0 or tokens < 0:
            return []
        measured = self._measure_process(kind, figures)
        if figures is not None and figures.eval_s > 0 and figures.tokens > 0:
            tokens, seconds = figures.tokens, figures.eval_s
        if tokens >= MIN_SAMPLE_TOKENS or tokens >= max_length:
            self._samples[kind].append((tokens, seconds))
            measured = True
        if not measured:
            return []
        changes = self._refit(kind, now=now)
        if figures is not None and any(
            c.what == "max_context_length" and c.new < c.old for c in changes
        ):
            self._lowering_size[kind] = (figures.prompt_tokens, max_length)
        self._schedule(kind, now)
        return changes

    def _measure_process(self, kind: str, figures: PerfFigures | None) -> bool:
        if figures is None or figures.prompt_tokens < MIN_PROCESS_SAMPLE:
            return False
        if figures.process_s <= 0:
            return False
        self._process[kind].append((figures.prompt_tokens, figures.process_s))
        return True

    def remeasured(
        self,
        kind: str,
        tokens_per_s: float | None,
        now: float,
        process_s: float | None = None,
    ) -> list[LengthChange]:
        """A re-measure of ``kind`` (:meth:`recheck_due`) found ``tokens_per_s``
        and ``process_s`` seconds per prompt token (None, None: it failed):
        refit from those figures alone. No raise doubles the cool-off (up to
        :data:`RECHECK_MAX_S`). Returns the changes it makes."""
        changes: list[LengthChange] = []
        if (tokens_per_s is not None and tokens_per_s > 0) or (
            process_s is not None and process_s > 0
        ):
            if tokens_per_s is not None and tokens_per_s > 0:
                self._samples[kind].clear()
                # One sample of a minute at that speed, so a job's own measure soon weighs in.
                self._samples[kind].append((max(1, round(tokens_per_s * 60.0)), 60.0))
            if process_s is not None and process_s > 0:
                self._process[kind].clear()
                self._process[kind].append((1000, process_s * 1000))
            self._hold_until[kind] = None
            changes = self._refit(kind, now=now, remeasured=True)
        if not any(c.new > c.old for c in changes):
            self._cooloff[kind] = min(RECHECK_MAX_S, self._cooloff[kind] * 2)
        self._schedule(kind, now)
        return changes

    def ran_out(
        self,
        kind: str,
        *,
        max_length: int,
        seconds: float,
        now: float | None = None,
        prompt_tokens: int | None = None,
        produced: int | None = None,
    ) -> list[LengthChange]:
        """A ``kind`` job of ``max_length`` tokens and a prompt of ``prompt_tokens``
        (None: not known) did not finish in ``seconds`` (its lease), having
        generated ``produced`` tokens by then (koboldcpp's figures of the aborted
        generation; None: not known): the lesson of the module docstring (a
        hang, a slow prompt or a slow generation; one that produced tokens was
        generating: a slow generation).
        Holds the kind's raises for its cool-off; at monotonic ``now`` it
        schedules the kind's re-measure (a run-out within :data:`HOUR_S` of a
        raise doubles the cool-off first). Returns the changes it makes (none
        for a hang)."""
        lesson = (
            "length" if produced else self._lesson(kind, max_length, seconds, prompt_tokens)
        )
        if lesson == "hang":
            return []
        raised = self._raised_at[kind]
        if now is not None and raised is not None and now - raised < HOUR_S:
            self._cooloff[kind] = min(RECHECK_MAX_S, self._cooloff[kind] * 2)
            self._raised_at[kind] = None
        if now is not None:
            self._hold_until[kind] = now + self._cooloff[kind]
        if prompt_tokens is not None:
            self._failed_size[kind] = (max(1, prompt_tokens), max(1, max_length))
        if lesson == "prompt" and prompt_tokens is not None:
            changes = self._prompt_ran_out(kind, max_length, seconds, prompt_tokens)
        else:
            changes = self._length_ran_out(kind, max_length=max_length, seconds=seconds)
        self._why[kind] = "ran_out"
        self._schedule(kind, now)
        return changes

    def _lesson(
        self, kind: str, max_length: int, seconds: float, prompt_tokens: int | None
    ) -> str:
        """``"hang"``, ``"prompt"`` or ``"length"`` (see the module docstring)."""
        if prompt_tokens is None or seconds <= 0:
            return "length"
        p, g = self.process_s(kind), self.speed(kind)
        generating = max_length / g if g else None
        if p is not None and generating is not None:
            if prompt_tokens * p + generating <= HANG_SHARE * seconds:
                return "hang"
            return "prompt" if prompt_tokens * p >= generating else "length"
        if generating is not None:  # generation alone cannot explain it: can the prompt?
            if generating > HANG_SHARE * seconds:
                return "length"
            # A prompt token processed at most as slowly as two generated ones.
            slowest = prompt_tokens * 2 / g if g else 0.0
            return "prompt" if slowest + generating > HANG_SHARE * seconds else "hang"
        if p is not None:
            return "prompt" if prompt_tokens * p > HANG_SHARE * seconds else "length"
        long = prompt_tokens >= LONG_PROMPT_TOKENS and prompt_tokens > max_length
        return "prompt" if long else "hang"

    def _prompt_ran_out(
        self, kind: str, max_length: int, seconds: float, prompt_tokens: int
    ) -> list[LengthChange]:
        g = self.speed(kind)
        generating = min(max_length / g, seconds / 2) if g else 0.0
        # The prompt took at least the rest: p is at least that over its tokens.
        slowest = max(seconds - generating, seconds / 2) / prompt_tokens
        known = self.process_s(kind)
        if known is None or slowest > known:
            self._process[kind].clear()
            self._process[kind].append((prompt_tokens, slowest * prompt_tokens))
        changes = self._refit(kind)
        # Say what taught it: the run-out, not a measured speed.
        return [
            LengthChange(c.kind, c.old, c.new, None, c.budget_s, what=c.what,
                         prompt_tokens=prompt_tokens if c.what == "max_context_length" else None)
            for c in changes
        ]

    def _length_ran_out(self, kind: str, *, max_length: int, seconds: float) -> list[LengthChange]:
        old = self._declared[kind]
        bound = (
            fitted_length(max_length / seconds, self.lease_s, self.cap, self.margin_s)
            if seconds > 0
            else old
        )
        new = max(min(MIN_MAX_LENGTH, self.cap), min(old, max_length // 2, bound))
        self._samples[kind].clear()
        if new >= old:
            return []
        self._declared[kind] = new
        return [LengthChange(kind, old, new, None, budget_s(self.lease_s, self.margin_s))]

    def _refit(
        self, kind: str, *, now: float | None = None, remeasured: bool = False
    ) -> list[LengthChange]:
        g, p = self.speed(kind), self.process_s(kind)
        if g is None and (p is None or not self.context_cap):
            return []
        length, context = fitted_limits(
            tokens_per_s=g,
            process_s=p if self.context_cap else None,
            lease_s=self.lease_s,
            cap=self.cap,
            context_cap=self.context_cap or self.cap + MIN_PROMPT_TOKENS,
            margin_s=self.margin_s,
        )
        budget = budget_s(self.lease_s, self.margin_s)
        held = self.held(kind, now)
        changes = []
        old = self._declared[kind]
        if g is None and length >= old:
            pass  # nothing measured about generation: not a reason to raise it
        elif self._moves(old, length, self.cap, held):
            self._declared[kind] = length
            changes.append(LengthChange(kind, old, length, g, budget, remeasured))
        if self.context_cap:
            old_context = self._context[kind]
            if self._moves(old_context, context, self.context_cap, held):
                self._context[kind] = context
                changes.append(
                    LengthChange(
                        kind, old_context, context, g, budget, remeasured,
                        what="max_context_length",
                        process_tokens_per_s=1.0 / p if p else None,
                    )
                )
        for change in changes:
            if change.new < change.old:
                self._why[kind] = "slow"
            elif now is not None:
                self._raised_at[kind] = now
        return changes

    @staticmethod
    def _moves(old: int, fit: int, cap: int, held: bool) -> bool:
        """A fit lowers at once; it raises, out of a hold, once it is
        :data:`RAISE_FACTOR` larger or reaches ``cap``."""
        if fit < old:
            return True
        return fit > old and not held and (fit >= cap or fit >= old * RAISE_FACTOR)
