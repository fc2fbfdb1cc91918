"""What the worker says about itself: pauses, the Horde's messages, refusals, summaries.

Pure rules (no I/O, the clock passed in) for the loop's one-line state
events, so an operator running the worker for weeks can tell what it is
doing without reading the code:

- :class:`PauseTracker`: why the loop is not popping (a local user,
  koboldcpp busy, busy with its own Horde worker's jobs or with another
  process's of this worker, or not answering, maintenance, chat withdrawn)
  and when it pops again, each change said once; short flickers are not said;
- :func:`moderator_lines`: the Horde's messages to the worker's owner (the
  pop answer's top-level ``messages``), each said once;
- what an empty pop's ``skipped`` counts show is ``state.skipped``'s;
- :func:`summary_line`: the periodic totals line (jobs, kudos, uptime);
- :func:`earnings_line`: the totals after every job and at the stop, in
  koboldcpp's own bracketed ``[Total:..., EarnRate:...]`` shape, plus the
  faults;
- :func:`aborted_count` and :func:`abort_limit_line`: the guard against the
  Horde's maintenance, as the operator reads it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..settings import WorkerSettings

#: Why the loop is not popping: the line said when the pause starts, and the
#: one said when it pops again.
PAUSE_REASONS: Mapping[str, tuple[str, str]] = {
    "local_user": (
        "koboldcpp had a local request (or just started): not popping until "
        "{local_idle_s:g} s after it, as koboldcpp's own worker does",
        "no local request for {local_idle_s:g} s: popping again",
    ),
    "busy": (
        "koboldcpp is busy with another client's request: not popping until it is free",
        "koboldcpp is free: popping again",
    ),
    # Who else keeps koboldcpp busy, when the worker can tell (``service.gate``).
    "kcpp_worker": (
        "koboldcpp's own Horde worker runs beside this one (koboldcpp was started with "
        "--hordekey) and keeps it busy with its jobs: not popping until it is free; start "
        "koboldcpp without --hordekey so that only this worker serves the Horde",
        "koboldcpp is free: popping again",
    ),
    "same_worker": (
        "koboldcpp is generating a Horde job this process does not hold: another process "
        "of this worker serves the Horde through this koboldcpp (a second start of this "
        "worker name, with another journal directory, say): not popping until it is "
        "free; stop one of them",
        "koboldcpp is free: popping again",
    ),
    "backend_down": (
        "koboldcpp at {kcpp_url} does not answer: not popping until it does",
        "koboldcpp at {kcpp_url} answers again: popping",
    ),
    "maintenance": (
        "the Horde keeps this worker in maintenance: not popping for a minute at a time",
        "the Horde takes pops again: popping",
    ),
    "chat_withdrawn": (
        "chat is withdrawn after too many aborted jobs and this worker serves chat jobs "
        "only: not popping until fewer remain in the Horde's hour",
        "chat is declared again: popping",
    ),
    "refused": (
        "the Horde refuses this worker's pops: not popping for a minute at a time",
        "the Horde takes pops again: popping",
    ),
    "horde_down": (
        "the Horde at {horde_url} does not answer: trying again, up to a minute apart",
        "the Horde answers again: popping",
    ),
    "submit_retry": (
        "a submit to the Horde failed and is being retried: not popping a job that "
        "could not be delivered either until it is settled",
        "the retried submit is settled: popping again",
    ),
    # The lines of the guard against maintenance (``guard_pause_line`` words the pause).
    "abort_limit": (
        "too many aborted jobs in the Horde's hour: not popping",
        "the Horde's hour allows another aborted job: popping again",
    ),
    "backend_failing": (
        "koboldcpp failed {failed_in_a_row} generations in a row: not popping; probing it "
        "with a generation the size of the failed job until one succeeds",
        "koboldcpp generates again: popping",
    ),
    "kind_failing": (
        "koboldcpp failed {failed_in_a_row} generations in a row of every kind this worker "
        "may pop for: not popping; probing each until it generates again",
        "koboldcpp generates again: popping",
    ),
}

#: A pause shorter than this, seconds, is not said (a local user's single
#: request or koboldcpp finishing a request flickers in and out).
PAUSE_REPORT_AFTER_S = 2.0
#: Pauses said at once: they do not flicker, and the operator should know at once.
IMMEDIATE_PAUSES = frozenset(
    {
        "backend_down",
        "maintenance",
        "chat_withdrawn",
        "refused",
        "horde_down",
        "submit_retry",
        "abort_limit",
        "backend_failing",
        "kind_failing",
    }
)
#: Seconds between two summary lines.
SUMMARY_EVERY_S = 600.0
#: Characters of a moderator message kept in its log line.
MESSAGE_MAX_CHARS = 500


class PauseTracker:
    """Turns the loop's pass-by-pass state into one line per change.

    Call :meth:`pausing` on every pass that does not pop (with the reason,
    a key of :data:`PAUSE_REASONS`) and :meth:`popping` on every pass that
    pops. Each returns the line to log now, or None. A pause is said once
    it has lasted :data:`PAUSE_REPORT_AFTER_S` (at once for the reasons in
    :data:`IMMEDIATE_PAUSES`); a change of reason while paused is said
    again; popping again is said only after a pause that was said, in the
    words of the last pause said.
    """

    def __init__(self, **details: object) -> None:
        self._details = details
        self._reason: str | None = None
        self._since = 0.0
        self._said: str | None = None

    @property
    def reason(self) -> str | None:
        """The current pause's reason, or None while popping."""
        return self._reason

    def pausing(self, reason: str, now: float, *, line: str | None = None) -> str | None:
        """The loop does not pop this pass because of ``reason``.

        ``line`` replaces the reason's own words (a refusal says its ``rc``);
        a new ``line`` under the same reason is said again.
        """
        key = f"{reason}:{line}" if line else reason
        if reason != self._reason:
            self._reason = reason
            self._since = now
        if self._said == key:
            return None
        if reason in IMMEDIATE_PAUSES or now - self._since >= PAUSE_REPORT_AFTER_S:
            self._said = key
            return line or PAUSE_REASONS[reason][0].format(**self._details)
        return None

    def popping(self, now: float) -> str | None:
        """The loop pops this pass."""
        said = self._said
        self._reason = None
        self._said = None
        if said is None:
            return None
        return PAUSE_REASONS[said.partition(":")[0]][1].format(**self._details)


def message_key(message: Mapping[str, Any]) -> str:
    """What makes a moderator message distinct: its ``id``, else its text."""
    ident = message.get("id")
    if isinstance(ident, (str, int)) and not isinstance(ident, bool) and str(ident):
        return f"id:{ident}"
    return f"text:{message.get('message')}"


def moderator_lines(messages: object, seen: set[str]) -> list[str]:
    """Lines for the Horde's messages to the worker's owner that ``seen`` lacks.

    Args:
        messages: the pop answer's top-level ``messages``: a list of
            ``{"id", "message", "origin", "expiry", ...}`` (anything else is ignored).
        seen: keys (:func:`message_key`) already said; updated in place.

    Returns:
        One line per new message: ``message from the Horde (origin moderator,
        expires 2026-12-24T00:00:00): <text>``, the text on one line and shortened.
    """
    if not isinstance(messages, list):
        return []
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        text = message.get("message")
        if not isinstance(text, str) or not text.strip():
            continue
        key = message_key(message)
        if key in seen:
            continue
        seen.add(key)
        about = [
            f"{word} {_one_line(str(message[name]), 60)}"
            for name, word in (("origin", "origin"), ("expiry", "expires"))
            if message.get(name) not in (None, "")
        ]
        lines.append(
            "message from the Horde"
            + (f" ({', '.join(about)})" if about else "")
            + ": "
            + _one_line(text, MESSAGE_MAX_CHARS)
        )
    return lines


def summary_line(
    *, jobs: int, kudos: float, faults: int, dropped: int, uptime_s: float
) -> str:
    """``"12 jobs, 340 kudos (850 kudos/h), 0 faults, 0 dropped, uptime 0:24:00"``.

    The rate is shown once the worker has run ten minutes.
    """
    rate = f" ({kudos / (uptime_s / 3600.0):.0f} kudos/h)" if uptime_s >= 600 else ""
    seconds = int(max(0.0, uptime_s))
    uptime = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return (
        f"{jobs} jobs, {kudos:.0f} kudos{rate}, {faults} faults, {dropped} dropped, "
        f"uptime {uptime}"
    )


def earnings_line(*, kudos: float, jobs: int, faults: int, elapsed_s: float) -> str:
    """``"[Total:5570 kudos, Time:000h:15m:00s, Jobs:85, EarnRate:22280.00 kudos/hr,
    JobRate:340.00 jobs/hr, JobCost:65.53 kudos/job] Faults:2"``: the totals in
    the bracketed shape koboldcpp's own worker prints after every submit
    (koboldcpp 1.116.1 ``koboldcpp.py`` L10066-10078: the same fields, order,
    units and number formats), so what reads koboldcpp's line reads this one;
    this worker's fault count follows the bracket.

    Args:
        kudos: kudos earned by accepted submits; jobs: accepted submits;
        faults: faults sent; elapsed_s: seconds since the worker started (the
        rates are over it, from the first job on, as koboldcpp's are).

    ``JobCost`` is 0.00 while no job was submitted (koboldcpp prints the line
    only after a job). Never raises.
    """
    elapsed = max(1.0, elapsed_s)
    hours = elapsed / 3600.0
    cost = kudos / jobs if jobs > 0 else 0.0
    seconds = int(max(0.0, elapsed_s))
    time_text = f"{seconds // 3600:03d}h:{seconds // 60 % 60:02d}m:{seconds % 60:02d}s"
    return (
        f"[Total:{kudos:.0f} kudos, Time:{time_text}, Jobs:{jobs}, "
        f"EarnRate:{kudos / hours:.2f} kudos/hr, JobRate:{jobs / hours:.2f} jobs/hr, "
        f"JobCost:{cost:.2f} kudos/job] Faults:{faults}"
    )


def first_chat_job_line(settings: WorkerSettings) -> str:
    """The line for the worker's first chat job: the start line promised text jobs,
    and chat jobs only once the Horde sends them (``hosting.serving_line``).

    E.g. ``"the Horde sends chat jobs: serving chat jobs and text jobs"``
    (``"... serving chat jobs"`` for a chat-only worker).
    """
    return "the Horde sends chat jobs: serving chat jobs" + (
        " and text jobs" if settings.prompt_jobs else ""
    )


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass(frozen=True)
class RefusalAdvice:
    """How the loop answers a refused pop, and what it tells the owner.

    Attributes:
        action: ``"stop_key"`` (the API key or the worker name is not the
            owner's: stop, exit 3), ``"stop_config"`` (a setting the Horde will
            never take: stop, exit 2), ``"owner"`` (the owner must act on the
            Horde's side: pop again a minute later, so the worker resumes by
            itself once it is done), or ``"retry"`` (transient: back off).
        line: the log line: the refusal named by its ``rc`` and what the
            owner can do.
    """

    action: str
    line: str


#: What each pop refusal means for the owner, by the Horde's ``rc``: (action,
#: what to do). From the AI Horde's public source (``horde/exceptions.py`` and
#: the pop's ``validate`` in ``horde/apis/v2/base.py``).
POP_REFUSALS: Mapping[str, tuple[str, str]] = {
    "InvalidAPIKey": (
        "stop_key",
        "check your API key (--hordekey): the Horde knows no user with it",
    ),
    "WrongCredentials": (
        "stop_key",
        "the worker name belongs to another user's worker: check your API key, or choose "
        "another --hordeworkername",
    ),
    "DeletedUser": ("stop_key", "the account of this API key is scheduled for deletion"),
    "AnonForbiddenWorker": (
        "stop_key",
        "the anonymous API key cannot run a worker: register on the Horde and use your own key",
    ),
    "ChatDeclarationInvalid": (
        "stop_config",
        "the chat declaration is invalid: check --hordemodelname and --chat-withhold",
    ),
    "PolymorphicNameConflict": (
        "stop_config",
        "an image or interrogation worker already has this name: choose another "
        "--hordeworkername",
    ),
    "ProfaneWorkerName": ("stop_config", "choose another --hordeworkername"),
    "TooManyWorkers": (
        "owner",
        "the account's worker limit is reached (untrusted accounts may have a few distinct "
        "workers): keep --hordeworkername the same across runs, or delete unused workers "
        "on the Horde",
    ),
    "TooManyWorkersTrusted": (
        "owner",
        "the account's worker limit is reached: keep --hordeworkername the same across runs, "
        "or ask the Horde's moderators for more",
    ),
    "TooManySameIPs": (
        "owner",
        "too many of the account's workers run from this address: ask the Horde's moderators",
    ),
    "WorkerInviteOnly": (
        "owner",
        "the Horde takes new workers by invitation only: ask its moderators, or reuse an "
        "existing worker name",
    ),
    "UnsafeIP": (
        "owner",
        "the Horde does not take new workers from VPN addresses: run from another address "
        "or ask its moderators",
    ),
    "WorkerMaintenance": (
        "owner",
        "the worker is in maintenance: fix what made it drop jobs, then take it out of "
        "maintenance on the Horde (its worker page, or PUT /api/v2/workers/<id> with "
        "maintenance false)",
    ),
    "WorkerFlaggedMaintenance": (
        "owner",
        "the account was flagged by the Horde's community: contact its moderators",
    ),
    "NulByteInPayload": ("owner", "the pop held a U+0000 character: check --hordemodelname"),
    "TimeoutIP": ("retry", "this address is in a timeout on the Horde; trying again later"),
    "TooManyNewIPs": ("retry", "the Horde takes no new workers from unknown addresses right now"),
}


def describe_pop_refusal(status: int, rc: str, message: str) -> RefusalAdvice:
    """The loop's answer to a refused pop (see :data:`POP_REFUSALS`).

    Args:
        status: the HTTP status (4xx); rc: the Horde's return code, or ``""``;
        message: the Horde's message (shortened, one line).

    Unknown codes: 401 is a key refusal; any other 4xx is backed off and
    retried. The line is ``"the Horde refused the pop (403 TooManyWorkers: <its
    message>): <what to do>"``.
    """
    action, advice = POP_REFUSALS.get(rc, ("", ""))
    if not action:
        action, advice = (
            ("stop_key", "check your API key (--hordekey)") if status == 401 else ("retry", "")
        )
    named = f"{status} {rc}" if rc else str(status)
    text = _one_line(message, 200)
    line = f"the Horde refused the pop ({named}" + (f": {text}" if text else "") + ")"
    return RefusalAdvice(action, f"{line}: {advice}" if advice else line)


# --- the guard against the Horde's maintenance ------------------------------------------


def aborted_count(count: int, limit: int) -> str:
    """``"aborted 3 in the Horde's hour (maintenance above 20)"``: the jobs the
    Horde counts as aborted (faults, expired leases) in its window, as the
    worker counts them (never fewer than the Horde)."""
    return f"aborted {count} in the Horde's hour (maintenance above {limit})"


def abort_limit_line(
    *, count: int, in_hand: int, limit: int, resume_wall: float, wait_s: float
) -> str:
    """The line said when the guard stops popping, e.g. ``"aborted 19 in the
    Horde's hour (maintenance above 20): not popping, to stay out of maintenance;
    popping again at 14:05:12 (in 58 min) unless more are counted"``.

    Args:
        count: aborted jobs counted in the window.
        in_hand: jobs in hand (each may still become one); said when above 0.
        limit: the Horde's threshold (20).
        resume_wall: epoch seconds when popping is allowed again (local time shown).
        wait_s: seconds until then.
    """
    held = f", {in_hand} job{'s' if in_hand != 1 else ''} in hand" if in_hand else ""
    at = time.strftime("%H:%M:%S", time.localtime(resume_wall))
    minutes = max(1, round(wait_s / 60.0))
    return (
        f"{aborted_count(count, limit)}{held}: not popping, to stay out of maintenance; "
        f"popping again at {at} (in {minutes} min) unless more are counted"
    )


#: Tokens per second above which the real Horde suspects an untrusted owner's text
#: worker (horde/vars.py ``suspicion_thresholds["text"]``, checked at each accepted
#: submit by horde/classes/base/worker.py ``_record_contribution``; a known model of
#: 8B, 14B or 70B parameters has a limit of 150, 100 or 30 there too).
SUSPICION_TOKENS_PER_S = 150
#: Suspicions at which the real Horde pauses an untrusted owner's worker
#: (horde/classes/base/worker.py ``suspicion_threshold``).
SUSPICIONS_TO_PAUSE = 5


def suspicion_line(tokens_per_s: float) -> str:
    """The one line said when koboldcpp served a job faster than the Horde allows an
    untrusted owner's worker and the owner is not trusted (``find_user``)."""
    return (
        f"koboldcpp served a job at {tokens_per_s:.0f} tokens/s, above the "
        f"{SUSPICION_TOKENS_PER_S} tokens/s the Horde allows a worker of an untrusted "
        f"owner: each such job adds a suspicion, and at {SUSPICIONS_TO_PAUSE} the Horde "
        "pauses this worker and sends it fake jobs whose rewards are never credited "
        "(a trusted owner's worker is never suspected)"
    )
