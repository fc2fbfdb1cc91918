"""The API key checked at start, before any pop (``GET /api/v2/find_user``).

Both hosts ask once (the standalone worker before its journal and the wait
for koboldcpp, ``hosts/standalone.py``; every host's loops in
``hosting.run_worker``, which share the first answer), so a wrong key fails in
one line at the start instead of at the first pop. The Horde's answers are
read as the real Horde gives them (its ``FindUser``: 404 ``UserNotFound`` for a
key it does not know, 401 ``InvalidAPIKey`` for none, user id 0 for the
anonymous key).
"""

from __future__ import annotations

import hashlib
import logging
import threading

from .. import BRIDGE_AGENT
from ..errors import ConfigError, HordeRefusal, HordeUnavailable
from ..horde.client import HordeClient
from ..horde.codes import is_key_refusal
from ..inflight import CallDeadlines
from ..state.status import POP_REFUSALS

log = logging.getLogger("koboldcpp_horde_chat.hosting")

#: The read timeout of the start's key check, seconds: a Horde that does not
#: answer by then does not hold the start up longer.
KEY_CHECK_TIMEOUT_S = 10.0
_KEY_CHECKS: dict[tuple[str, str], str | None] = {}
#: The ``trusted`` flag of each key's owner, as the key check's answer gave it.
_OWNERS_TRUSTED: dict[tuple[str, str], bool] = {}
_KEY_CHECKS_LOCK = threading.Lock()


def check_api_key(
    horde_url: str,
    api_key: str,
    *,
    deadlines: CallDeadlines | None = None,
    connect_timeout_s: float = 5.0,
    timeout_s: float = KEY_CHECK_TIMEOUT_S,
) -> str | None:
    """Ask the Horde whose ``api_key`` it is (``GET /api/v2/find_user``) before
    any pop, once per Horde and key in this process (the hosts' loops share the
    answer): the line saying why the Horde refuses the key, or None.

    A key the Horde does not know (401, 403 with a credentials ``rc``, 404
    ``UserNotFound``) or the anonymous key (user id 0, which may not run a
    worker) is refused, e.g. ``"the Horde at https://aihorde.net refused the API
    key (404 UserNotFound): check your API key (--hordekey): the Horde knows no
    user with it"``; the Horde's message is left out (it repeats the key). A
    known key logs one line naming its user. A Horde that does not answer, or
    answers the check otherwise (a route it lacks, 5xx), does not hold the
    start up: one WARNING line says so and None is returned (a wrong key then
    shows at the first pop).
    """
    key = (horde_url, hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest())
    with _KEY_CHECKS_LOCK:
        if key in _KEY_CHECKS:
            return _KEY_CHECKS[key]
        problem, trusted = _ask_find_user(
            horde_url, api_key, deadlines, connect_timeout_s, timeout_s
        )
        _KEY_CHECKS[key] = problem
        if trusted is not None:
            _OWNERS_TRUSTED[key] = trusted
        return problem


def owner_trusted(horde_url: str, api_key: str) -> bool | None:
    """The ``trusted`` flag of the key's owner from the key check's answer
    (:func:`check_api_key`), or None when it did not say."""
    key = (horde_url, hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest())
    with _KEY_CHECKS_LOCK:
        return _OWNERS_TRUSTED.get(key)


def _ask_find_user(
    horde_url: str,
    api_key: str,
    deadlines: CallDeadlines | None,
    connect_timeout_s: float,
    timeout_s: float,
) -> tuple[str | None, bool | None]:
    """One key check (see :func:`check_api_key`): the refusal's line or None, and
    the owner's ``trusted`` flag when the Horde gave it."""
    refused = f"the Horde at {horde_url} refused the API key"
    advice = POP_REFUSALS["InvalidAPIKey"][1]
    try:
        with HordeClient(
            horde_url, api_key, bridge_agent=BRIDGE_AGENT, connect_timeout_s=connect_timeout_s,
            deadlines=deadlines,
        ) as client:
            user = client.find_user(timeout_s=timeout_s)
    except ConfigError as exc:
        return f"{refused}: {exc}", None
    except HordeRefusal as exc:
        if is_key_refusal(exc) or (exc.status == 404 and exc.rc == "UserNotFound"):
            named = f"{exc.status} {exc.rc}" if exc.rc else str(exc.status)
            return f"{refused} ({named}): {advice}", None
        log.warning(
            "the Horde at %s did not check the API key (%s %s): starting anyway; a wrong key "
            "shows at the first pop", horde_url, exc.status, exc.rc or "no rc",
        )
        return None, None
    except HordeUnavailable as exc:
        log.warning(
            "the Horde at %s did not answer the API key check (%s): starting anyway; a wrong "
            "key shows at the first pop", horde_url, exc.reason,
        )
        return None, None
    if user.get("id") == 0:
        return f"{refused} (the anonymous user's): {POP_REFUSALS['AnonForbiddenWorker'][1]}", None
    name = user.get("username")
    log.info(
        "the Horde at %s knows the API key%s", horde_url,
        f": user {str(name)[:100]}" if isinstance(name, str) and name else "",
    )
    trusted = user.get("trusted")
    return None, trusted if isinstance(trusted, bool) else None
