"""Which routes a koboldcpp's version (``/api/extra/version``) serves (pure).

``POST /v1/chat/completions`` came in 1.46. An older koboldcpp does not answer 404
for it: any path ending in ``/completions`` is its text completion (1.45), so a
probe cannot tell, and would take the model lock (1.116.1 L6890). A later version
without the route (a proxy) is found out by the first chat job. ``GET /props``
(the chat template) came in 1.79.
"""

from __future__ import annotations

import re

CHAT_ROUTE_SINCE = (1, 46)
PROPS_SINCE = (1, 79)

_LEADING_NUMBERS = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def at_least(version: str, release: tuple[int, ...]) -> bool:
    """``"1.104.yr0-ROCm"`` reads as ``(1, 104)``; True for a version without a
    leading number."""
    match = _LEADING_NUMBERS.match(version)
    return match is None or tuple(int(part) for part in match.group(1).split(".")) >= release


def since(release: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in release)
