"""The Horde's answer to a reply's or a fault's submit, read once for the live
submit (``run/submit.py``) and the start-up recovery (``service/recovery.py``),
which keep only their retry schedules. Pure.

Seed sections "Submit refusals", "7. Fault a job" (every fault the Horde takes
re-opens the request: at most one per job) and "Check the completed reply".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from ..errors import HordeRefusal, HordeUnavailable, JobFault
from ..horde.codes import (
    ABORTED_GEN,
    CHAT_SUBMIT_NONCONFORMANT,
    DUPLICATE_GEN,
    REFUSAL_RCS,
    is_key_refusal,
)
from ..jsonbody import finite_number
from ..translate.submits import FAULT_REPLY_REFUSED

#: What the Horde client gives for a submit: the accepted JSON body, or its error.
Answered = dict[str, Any] | HordeRefusal | HordeUnavailable
#: HTTP statuses that say the Horde did not take a submit (rate limit, unavailable).
NOT_TAKEN_STATUSES: Final = frozenset({429, 503})


class Answer(Enum):
    """What the Horde's answer means for the job."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # DuplicateGen: the Horde had stored the reply already
    ENDED = "ended"  # AbortedGen or 404: the job ended on the Horde first
    KEY_REFUSED = "key_refused"  # 401, or 403 for the credentials
    REFUSED = "refused"  # any other refusal: a reply is faulted instead, a fault dropped
    RETRY = "retry"  # no answer: a reply, or a fault known not to have reached the Horde
    LOST = "lost"  # a fault's answer lost where it may have reached the Horde: never again


@dataclass(frozen=True)
class Reading:
    """One answer read, and what the journal gets from it.

    ``aborted``: the Horde counts an aborted job (a reply answered ``AbortedGen``):
    one more fault in the journal's history. ``not_taken``: a fault known not to
    have reached the Horde: the journal marks it so (it may be sent again).
    """

    answer: Answer
    error: HordeRefusal | HordeUnavailable | None = None
    kudos: float = 0.0
    aborted: bool = False
    not_taken: bool = False

    @property
    def why(self) -> str:
        return "" if self.error is None else self.error.reason

    @property
    def retry_after_s(self) -> float:
        error = self.error
        return (error.retry_after_s or 0.0) if isinstance(error, HordeUnavailable) else 0.0

    @property
    def refusal(self) -> HordeRefusal:
        if not isinstance(self.error, HordeRefusal):
            raise TypeError(f"not a refusal: {self.answer.value}")
        return self.error


def read_answer(answer: Answered, *, fault: bool) -> Reading:
    """Read the answer to a reply's submit (``fault`` False) or a fault's."""
    if isinstance(answer, dict):
        kudos = None if fault else finite_number(answer.get("reward"))
        return Reading(Answer.ACCEPTED, kudos=kudos or 0.0)
    if isinstance(answer, HordeUnavailable):
        # Surely not taken: the connection was refused, or 429 or 503; after any
        # other failure it may have been.
        not_taken = fault and (answer.sent is False or answer.status in NOT_TAKEN_STATUSES)
        kind = Answer.LOST if fault and not not_taken else Answer.RETRY
        return Reading(kind, answer, not_taken=not_taken)
    if is_key_refusal(answer):
        return Reading(Answer.KEY_REFUSED, answer)
    if answer.rc == DUPLICATE_GEN:
        return Reading(Answer.DUPLICATE, answer)
    if answer.rc == ABORTED_GEN or answer.status == 404:
        return Reading(Answer.ENDED, answer, aborted=not fault and answer.rc == ABORTED_GEN)
    return Reading(Answer.REFUSED, answer)


def refused_reply_fault(exc: HordeRefusal) -> JobFault:
    """The fault after a refused reply: ``reply_refused`` for the chat refusals
    (``REFUSAL_RCS``), none for another (such as 400). One after
    ``ChatSubmitNonconformant`` does not count toward maintenance: the Horde
    counts it as a nonconformant reply."""
    return JobFault(f"reply refused ({exc.rc or exc.status}): {exc.message}",
                    fault_reason=FAULT_REPLY_REFUSED if exc.rc in REFUSAL_RCS else None,
                    counts=exc.rc != CHAT_SUBMIT_NONCONFORMANT)
