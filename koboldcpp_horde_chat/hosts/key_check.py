"""The API key checked once at start (``GET /api/v2/find_user``), so a wrong key
fails in one line then, not at the first pop. The real Horde answers 404
``UserNotFound`` for a key it does not know, 401 ``InvalidAPIKey`` for none and
user id 0 for the anonymous key.
"""

from __future__ import annotations

import hashlib
import logging
import threading

from .. import BRIDGE_AGENT
from ..errors import ConfigError, HordeRefusal, HordeUnavailable
from ..horde.client import HordeClient
from ..horde.codes import USER_NOT_FOUND, is_key_refusal
from ..inflight import CallDeadlines
from ..state.status import POP_REFUSALS

log = logging.getLogger("koboldcpp_horde_chat.hosting")

#: The read timeout of the start's key check, seconds: a Horde that does not
#: answer by then does not hold the start up longer.
KEY_CHECK_TIMEOUT_S = 10.0
#: (refusal line or None, owner's ``trusted`` flag or None), by Horde and key hash.
_KEY_CHECKS: dict[tuple[str, str], tuple[str | None, bool | None]] = {}
_KEY_CHECKS_LOCK = threading.Lock()


def _key(horde_url: str, api_key: str) -> tuple[str, str]:
    return horde_url, hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest()


def check_api_key(
    horde_url: str,
    api_key: str,
    *,
    deadlines: CallDeadlines | None = None,
    connect_timeout_s: float = 5.0,
    timeout_s: float = KEY_CHECK_TIMEOUT_S,
) -> str | None:
    """Why the Horde refuses ``api_key``, in one line, or None; asked once per Horde
    and key in this process.

    A key the Horde does not know, or the anonymous one, is refused (the Horde's
    message is left out: it repeats the key). A Horde that does not answer the
    check holds nothing up: one WARNING line, and None.
    """
    key = _key(horde_url, api_key)
    with _KEY_CHECKS_LOCK:
        if key not in _KEY_CHECKS:
            _KEY_CHECKS[key] = _ask_find_user(
                horde_url, api_key, deadlines, connect_timeout_s, timeout_s
            )
        return _KEY_CHECKS[key][0]


def owner_trusted(horde_url: str, api_key: str) -> bool | None:
    """The key owner's ``trusted`` flag from :func:`check_api_key`'s answer, or None."""
    with _KEY_CHECKS_LOCK:
        return _KEY_CHECKS.get(_key(horde_url, api_key), (None, None))[1]


def _ask_find_user(
    horde_url: str,
    api_key: str,
    deadlines: CallDeadlines | None,
    connect_timeout_s: float,
    timeout_s: float,
) -> tuple[str | None, bool | None]:
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
        if is_key_refusal(exc) or (exc.status == 404 and exc.rc == USER_NOT_FOUND):
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
