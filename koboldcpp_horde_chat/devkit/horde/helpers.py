"""Small helpers of the dev Horde: its logger, error answers, value checks, the
bridge agent as the Horde reads it, dates, compact JSON and the reward formula.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import re
from typing import Any, TypeGuard

from koboldcpp_horde_chat.devkit.horde.values import LLM_VALIDATED_BACKENDS

log = logging.getLogger("koboldcpp_horde_chat.devkit.horde")


class _ApiError(Exception):
    """An HTTP error answer: ``{"message": ..., "rc": ...}`` plus ``extra`` keys.

    ``rc`` None leaves the key out, as the Horde's input validation answers do.
    """

    def __init__(
        self, status: int, rc: str | None, message: str, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.rc = rc
        self.message = message
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"message": self.message}
        if self.rc is not None:
            out["rc"] = self.rc
        out.update(self.extra)
        return out


def _invalid_input(field_name: str, reason: str) -> _ApiError:
    """The Horde's answer to a body that fails its input model: 400 with
    ``{"message": "Input payload validation failed", "errors": {field: reason}}``
    and no ``rc``."""
    return _ApiError(400, None, "Input payload validation failed", {"errors": {field_name: reason}})


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# A semantic version whose minor and patch parts may be left out ("2", "2.1", "2.1.3",
# each with an optional -prerelease and +build): how the Horde reads the second
# field of a bridge agent. Numbers have no leading zero.
_NUM = r"(?:0|[1-9][0-9]*)"
_IDENT = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_VERSION = re.compile(
    rf"{_NUM}(?:\.{_NUM}(?:\.{_NUM})?)?"
    rf"(?:-{_IDENT}(?:\.{_IDENT})*)?"
    r"(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)


def _sanitize(text: str) -> str:
    """What the Horde stores of a free-text field: HTML-escaped ``&<>``, stripped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").strip()


def parse_bridge_agent(agent: str) -> tuple[str, str]:
    """``(name, version)`` of a bridge agent ``"<name>:<version>:<anything>"``, as the
    Horde reads it: the stored (sanitized) agent split at its first two colons.

    An agent without two colons, or whose version is not a semantic version
    (minor and patch optional), reads as ``("unknown", "0")``.
    """
    parts = _sanitize(agent).split(":", 2)
    if len(parts) != 3 or not _VERSION.fullmatch(parts[1]):
        return "unknown", "0"
    return parts[0], parts[1]


def is_validated_backend(agent: str) -> bool:
    """True when the bridge agent's name is in :data:`LLM_VALIDATED_BACKENDS`."""
    return parse_bridge_agent(agent)[0] in LLM_VALIDATED_BACKENDS


def _nul_path(obj: Any, path: str = "") -> str | None:
    """Where the first U+0000 sits in a JSON value (a dotted path, ``<root>`` for
    the value itself), or None when there is none. Keys count too."""
    if isinstance(obj, str):
        return (path or "<root>") if "\x00" in obj else None
    if isinstance(obj, dict):
        for key, value in obj.items():
            where = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return where
            found = _nul_path(value, where)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found = _nul_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _job_answer(job_id: str, payload: dict[str, Any], ttl: Any, model: Any) -> dict[str, Any]:
    """A pop answer carrying one job, as the Horde shapes it (the chat flag is added
    by the caller for a chat job)."""
    return {
        "payload": payload,
        "id": job_id,
        "ids": [job_id],
        "messages": [],
        "ttl": ttl,
        "extra_source_images": None,
        "skipped": {},
        "softprompt": None,
        "model": model,
    }


def _rfc822(epoch_s: float) -> str:
    """An absolute time as the Horde writes dates in its answers (RFC 822, UTC)."""
    return email.utils.formatdate(epoch_s)


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _output_kudos(nbytes: int) -> float:
    """The dev Horde's reward: 0.1 kudos per estimated token (4 bytes), floor 20 tokens."""
    tokens = max(20, math.ceil(nbytes / 4))
    return round(tokens / 10, 2)
