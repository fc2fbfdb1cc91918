"""The Horde's return codes (``rc``) the worker acts on (seed "Submit refusals",
"7. Fault a job", "Streaming progress"). The pop's refusals, with what the owner
can do, are in ``state.status``'s table."""

from __future__ import annotations

from typing import Final

from ..errors import HordeRefusal

ABORTED_GEN: Final = "AbortedGen"
DUPLICATE_GEN: Final = "DuplicateGen"
CHAT_SUBMIT_INVALID: Final = "ChatSubmitInvalid"
CHAT_SUBMIT_NONCONFORMANT: Final = "ChatSubmitNonconformant"
USER_NOT_FOUND: Final = "UserNotFound"
WORKER_MAINTENANCE: Final = "WorkerMaintenance"
#: Progress answers: 409 with ``expected_seq``, and 404 for a job that ended.
PROGRESS_OUT_OF_SEQUENCE: Final = "ChatProgressOutOfSequence"
JOB_ABORTED: Final = "ChatJobAborted"

#: 403 codes that mean the API key (or the worker name's owner) is wrong.
CREDENTIAL_RCS: Final = frozenset({"InvalidAPIKey", "WrongCredentials", "NotTrusted"})
#: Refusals of a chat reply; the fault after them names ``reply_refused``.
REFUSAL_RCS: Final = frozenset({CHAT_SUBMIT_INVALID, CHAT_SUBMIT_NONCONFORMANT,
                                "ChatModelMismatch"})


def is_key_refusal(exc: HordeRefusal) -> bool:
    """401, or 403 with a credentials ``rc``: the API key is wrong."""
    return exc.status == 401 or (exc.status == 403 and exc.rc in CREDENTIAL_RCS)
