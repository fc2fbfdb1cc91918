"""What the worker says about itself, one line per event: pauses, the Horde's
messages, pop refusals, totals and the guard against maintenance (pure; the
clock passed in)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

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

#: A pause shorter than this, seconds, is not said (it flickers).
PAUSE_REPORT_AFTER_S = 2.0
#: Pauses said at once: all but those that flicker in and out.
IMMEDIATE_PAUSES = frozenset(PAUSE_REASONS) - {"local_user", "busy", "kcpp_worker", "same_worker"}
#: Seconds between two summary lines.
SUMMARY_EVERY_S = 600.0
#: Characters of a moderator message kept in its log line.
MESSAGE_MAX_CHARS = 500


class PauseTracker:
    """One line per change of the loop's pausing: :meth:`pausing` (a key of
    :data:`PAUSE_REASONS`) on each pass that does not pop, :meth:`popping` on
    each that pops; each returns the line to log, or None. Popping again is
    said only after a pause that was said."""

    def __init__(self, **details: object) -> None:
        self._details = details
        self._reason: str | None = None
        self._since = 0.0
        self._said: str | None = None

    def pausing(self, reason: str, now: float, *, line: str | None = None) -> str | None:
        """``line`` replaces the reason's words; a new ``line`` is said again."""
        key = f"{reason}:{line}" if line else reason
        if reason != self._reason:
            self._reason, self._since = reason, now
        due = reason in IMMEDIATE_PAUSES or now - self._since >= PAUSE_REPORT_AFTER_S
        if self._said != key and due:
            self._said = key
            return line or PAUSE_REASONS[reason][0].format(**self._details)
        return None

    def popping(self, now: float) -> str | None:
        said, self._reason, self._said = self._said, None, None
        if said is None:
            return None
        return PAUSE_REASONS[said.partition(":")[0]][1].format(**self._details)


def moderator_lines(messages: object, seen: set[str]) -> list[str]:
    """A line per message of the pop answer's ``messages`` not in ``seen``
    (updated): ``message from the Horde (origin moderator, expires
    2026-12-24T00:00:00): <text>``, on one line and shortened."""
    if not isinstance(messages, list):
        return []
    lines = []
    for message in messages:
        text = message.get("message") if isinstance(message, dict) else None
        if not isinstance(text, str) or not text.strip():
            continue
        ident = message.get("id")
        named = isinstance(ident, (str, int)) and not isinstance(ident, bool) and str(ident)
        key = f"id:{ident}" if named else f"text:{text}"
        if key in seen:
            continue
        seen.add(key)
        about = [f"{word} {_one_line(str(message[name]), 60)}"
                 for name, word in (("origin", "origin"), ("expiry", "expires"))
                 if message.get(name) not in (None, "")]
        said = f" ({', '.join(about)})" if about else ""
        lines.append(f"message from the Horde{said}: {_one_line(text, MESSAGE_MAX_CHARS)}")
    return lines


@dataclass
class WorkerStats:
    """Running totals: ``jobs`` accepted submits, ``faults`` sent, ``dropped``
    jobs ended without either, ``started_at`` epoch seconds."""

    started_at: float = field(default_factory=time.time)
    kudos: float = 0.0
    jobs: int = 0
    faults: int = 0
    dropped: int = 0


def summary_line(stats: WorkerStats, uptime_s: float) -> str:
    """``"12 jobs, 340 kudos (850 kudos/h), 0 faults, 0 dropped, uptime 0:24:00"``;
    the rate once the worker has run ten minutes."""
    kudos = stats.kudos
    rate = f" ({kudos / (uptime_s / 3600.0):.0f} kudos/h)" if uptime_s >= 600 else ""
    seconds = int(max(0.0, uptime_s))
    uptime = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return (f"{stats.jobs} jobs, {kudos:.0f} kudos{rate}, {stats.faults} faults, "
            f"{stats.dropped} dropped, uptime {uptime}")


def earnings_line(stats: WorkerStats, elapsed_s: float) -> str:
    """``"[Total:5570 kudos, Time:000h:15m:00s, Jobs:85, EarnRate:22280.00 kudos/hr,
    JobRate:340.00 jobs/hr, JobCost:65.53 kudos/job] Faults:2"``: koboldcpp's own
    worker's line (same fields and formats), so what reads it reads this one."""
    kudos, jobs, hours = stats.kudos, stats.jobs, max(1.0, elapsed_s) / 3600.0
    cost = kudos / jobs if jobs > 0 else 0.0
    seconds = int(max(0.0, elapsed_s))
    time_text = f"{seconds // 3600:03d}h:{seconds // 60 % 60:02d}m:{seconds % 60:02d}s"
    return (f"[Total:{kudos:.0f} kudos, Time:{time_text}, Jobs:{jobs}, "
            f"EarnRate:{kudos / hours:.2f} kudos/hr, JobRate:{jobs / hours:.2f} jobs/hr, "
            f"JobCost:{cost:.2f} kudos/job] Faults:{stats.faults}")


def first_chat_job_line(settings: WorkerSettings) -> str:
    """The line for the worker's first chat job (the start line promised chat
    only once the Horde sends it)."""
    also = " and text jobs" if settings.prompt_jobs else ""
    return f"the Horde sends chat jobs: serving chat jobs{also}"


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass(frozen=True)
class RefusalAdvice:
    """How the loop answers a refused pop: ``action`` ``"stop_key"`` (exit 3),
    ``"stop_config"`` (exit 2), ``"owner"`` (the owner must act: pop again a
    minute later) or ``"retry"`` (back off); ``line`` says what to do."""

    action: str
    line: str


#: What to do, by action and the Horde's ``rc`` (its ``horde/exceptions.py``).
_REFUSALS_BY_ACTION: Mapping[str, Mapping[str, str]] = {
    "stop_key": {
        "InvalidAPIKey": "check your API key (--hordekey): the Horde knows no user with it",
        "WrongCredentials": "the worker name belongs to another user's worker: check your API "
        "key, or choose another --hordeworkername",
        "DeletedUser": "the account of this API key is scheduled for deletion",
        "AnonForbiddenWorker": "the anonymous API key cannot run a worker: register on the "
        "Horde and use your own key",
    },
    "stop_config": {
        "ChatDeclarationInvalid": "the chat declaration is invalid: check --hordemodelname and "
        "--chat-withhold",
        "PolymorphicNameConflict": "an image or interrogation worker already has this name: "
        "choose another --hordeworkername",
        "ProfaneWorkerName": "choose another --hordeworkername",
    },
    "owner": {
        "TooManyWorkers": "the account's worker limit is reached (untrusted accounts may have "
        "a few distinct workers): keep --hordeworkername the same across runs, or delete "
        "unused workers on the Horde",
        "TooManyWorkersTrusted": "the account's worker limit is reached: keep "
        "--hordeworkername the same across runs, or ask the Horde's moderators for more",
        "TooManySameIPs": "too many of the account's workers run from this address: ask the "
        "Horde's moderators",
        "WorkerInviteOnly": "the Horde takes new workers by invitation only: ask its "
        "moderators, or reuse an existing worker name",
        "UnsafeIP": "the Horde does not take new workers from VPN addresses: run from another "
        "address or ask its moderators",
        "WorkerMaintenance": "the worker is in maintenance: fix what made it drop jobs, then "
        "take it out of maintenance on the Horde (its worker page, or PUT "
        "/api/v2/workers/<id> with maintenance false)",
        "WorkerFlaggedMaintenance": "the account was flagged by the Horde's community: contact "
        "its moderators",
        "NulByteInPayload": "the pop held a U+0000 character: check --hordemodelname",
    },
    "retry": {
        "TimeoutIP": "this address is in a timeout on the Horde; trying again later",
        "TooManyNewIPs": "the Horde takes no new workers from unknown addresses right now",
    },
}
#: (action, what to do) by the Horde's ``rc``.
POP_REFUSALS: Mapping[str, tuple[str, str]] = {
    rc: (action, advice) for action, by_rc in _REFUSALS_BY_ACTION.items()
    for rc, advice in by_rc.items()
}


def describe_pop_refusal(status: int, rc: str, message: str) -> RefusalAdvice:
    """The loop's answer to a refused pop; an unknown ``rc`` is a key refusal
    on 401, else retried. The line: ``"the Horde refused the pop (403
    TooManyWorkers: <its message>): <what to do>"``."""
    unknown = ("stop_key", "check your API key (--hordekey)") if status == 401 else ("retry", "")
    action, advice = POP_REFUSALS.get(rc, unknown)
    named = f"{status} {rc}" if rc else str(status)
    text = _one_line(message, 200)
    line = f"the Horde refused the pop ({named}" + (f": {text}" if text else "") + ")"
    return RefusalAdvice(action, f"{line}: {advice}" if advice else line)


# --- the guard against the Horde's maintenance ------------------------------------------


def aborted_count(count: int, limit: int) -> str:
    """``"aborted 3 in the Horde's hour (maintenance above 20)"``."""
    return f"aborted {count} in the Horde's hour (maintenance above {limit})"


def abort_limit_line(*, count: int, in_hand: int, limit: int, resume_wall: float,
                     wait_s: float) -> str:
    """``"aborted 19 in the Horde's hour (maintenance above 20): not popping, to
    stay out of maintenance; popping again at 14:05:12 (in 58 min) unless more
    are counted"``; ``resume_wall`` is epoch seconds, shown in local time."""
    held = f", {in_hand} job{'s' if in_hand != 1 else ''} in hand" if in_hand else ""
    at = time.strftime("%H:%M:%S", time.localtime(resume_wall))
    minutes = max(1, round(wait_s / 60.0))
    return (f"{aborted_count(count, limit)}{held}: not popping, to stay out of maintenance; "
            f"popping again at {at} (in {minutes} min) unless more are counted")


#: Tokens/s above which the Horde suspects an untrusted owner's text worker
#: (its ``suspicion_thresholds["text"]``).
SUSPICION_TOKENS_PER_S = 150
#: Suspicions at which the Horde pauses an untrusted owner's worker.
SUSPICIONS_TO_PAUSE = 5


def suspicion_line(tokens_per_s: float) -> str:
    """The line when koboldcpp served a job faster than the Horde allows an
    untrusted owner's worker."""
    return (f"koboldcpp served a job at {tokens_per_s:.0f} tokens/s, above the "
            f"{SUSPICION_TOKENS_PER_S} tokens/s the Horde allows a worker of an untrusted "
            f"owner: each such job adds a suspicion, and at {SUSPICIONS_TO_PAUSE} the Horde "
            "pauses this worker and sends it fake jobs whose rewards are never credited "
            "(a trusted owner's worker is never suspected)")
