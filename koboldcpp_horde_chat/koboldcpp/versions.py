"""What a koboldcpp's version says it serves (pure; no I/O).

koboldcpp reports its release in ``GET /api/extra/version`` ``version``
(``"1.116.1"``; 1.116.1 ``koboldcpp.py`` L6102-6104). Two of the routes the
worker needs came with a release:

- ``POST /v1/chat/completions`` came in koboldcpp 1.46 (its commit "Implement
  basic chat/completions openai endpoint", October 2023). An older koboldcpp
  has no chat route, and does not answer 404 for it either: its POST
  dispatch takes any path ending in ``/completions`` for the text completions
  route (1.45 ``koboldcpp.py``: ``self.path.endswith('/completions')``), so a
  chat request gets a text completion of an empty prompt. A probe of the route
  cannot tell, and would cost a generation slot besides: koboldcpp takes its
  model lock before it looks at a POST's path (1.116.1 L6890, the dispatch at
  L6982). The version is what tells; a koboldcpp that reports a later one
  but answers the chat route 404 (a build or a proxy without it) is found out
  by the first chat job (``WorkerState.chat_route_missing``).
- ``GET /props`` came in koboldcpp 1.79 (commit "API: add /props route"):
  ``{"chat_template": <the model's template>, ...}`` (1.116.1 L6316-6335). The
  template is what the model file carries (``cached_chat_template``, L11694-11695);
  ``""`` when it carries none, and koboldcpp then renders chat with its
  fallback tags, Alpaca's ``### Instruction:`` and ``### Response:``
  (L4264-4270, "Alpaca will be used" at L11713), unless ``--chatcompletionsadapter``
  names other tags. Before 1.79 ``/props`` answers 404 and the template is
  unknown.
"""

from __future__ import annotations

import re

CHAT_ROUTE_SINCE = (1, 46)
"""The first koboldcpp release with ``POST /v1/chat/completions``."""
PROPS_SINCE = (1, 79)
"""The first koboldcpp release with ``GET /props`` (the chat template)."""

_LEADING_NUMBERS = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def parse_version(version: str) -> tuple[int, ...] | None:
    """The leading dotted numbers of a koboldcpp version: ``"1.116.1"`` gives
    ``(1, 116, 1)``, ``"1.104.yr0-ROCm"`` gives ``(1, 104)``; None when it
    starts with no number (``""``, ``"unknown"``)."""
    match = _LEADING_NUMBERS.match(version)
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def has_chat_route(version: str) -> bool:
    """Whether a koboldcpp reporting ``version`` has ``POST /v1/chat/completions``
    (1.46 and later). True for a version that cannot be read: the first chat
    job tells then."""
    parsed = parse_version(version)
    return parsed is None or parsed >= CHAT_ROUTE_SINCE


def has_props_route(version: str) -> bool:
    """Whether a koboldcpp reporting ``version`` has ``GET /props`` (1.79 and
    later; True for a version that cannot be read: asking costs one GET)."""
    parsed = parse_version(version)
    return parsed is None or parsed >= PROPS_SINCE


def since(release: tuple[int, ...]) -> str:
    """``(1, 46)`` as ``"1.46"``."""
    return ".".join(str(part) for part in release)
