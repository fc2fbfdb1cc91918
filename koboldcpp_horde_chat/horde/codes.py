"""The Horde's return codes a worker acts on, in one place (pure; no I/O).

The Horde names each refusal by ``rc`` in its JSON answer (seed "Submit
refusals", "7. Fault a job"; the rest from the AI Horde's public API). The
pop's refusals, each with what the owner can do, are ``state.status``'s
table, since they are said to the owner.
"""

from __future__ import annotations

from typing import Final

from ..errors import HordeRefusal

#: 403 codes that mean the API key (or the worker name's owner) is wrong.
CREDENTIAL_RCS: Final = frozenset({"InvalidAPIKey", "WrongCredentials", "NotTrusted"})
#: A submit's answer that says the job was already settled or ended on the Horde.
SETTLED_RCS: Final = frozenset({"AbortedGen", "DuplicateGen"})
#: The refusals of a chat reply that the fault after them names ``reply_refused``.
REFUSAL_RCS: Final = frozenset(
    {"ChatSubmitInvalid", "ChatSubmitNonconformant", "ChatModelMismatch"}
)


def is_key_refusal(exc: HordeRefusal) -> bool:
    """401, or 403 with a credentials ``rc``: the API key is wrong (by status and rc only)."""
    return exc.status == 401 or (exc.status == 403 and exc.rc in CREDENTIAL_RCS)
