"""Settings both hosts refuse at start-up, each with the same one line.

The standalone worker (``tests/integration/test_cli_startup.py``) exits 2 with
the line; inside koboldcpp (``tests/unit/test_inside_kcpp.py``) the worker thread
logs ``worker N: not started: <line>`` and koboldcpp serves on. Both run the
checks of ``koboldcpp_horde_chat.hosts.hosting``.
"""

from __future__ import annotations

from typing import NamedTuple


class Refused(NamedTuple):
    """A setting both modes refuse: ``--hordeworkername``, the environment, ``--hordegenlen``."""

    name: str
    env: dict[str, str]
    genlen: int
    line: str


REFUSED_AT_START = {
    # The Horde stores at most 100 characters (the real Horde refuses a longer name).
    "a 101-character name": Refused(
        "x" * 101,
        {},
        0,
        "--hordeworkername: the name is 101 characters long; the Horde takes at most 100",
    ),
    "a name of spaces": Refused(
        "   ", {}, 0, "--hordeworkername: a worker name is required (not empty or only spaces)"
    ),
    "a Horde URL without a scheme": Refused(
        "w",
        {"AI_HORDE_URL": "aihorde.net"},
        0,
        "AI_HORDE_URL needs an http:// or https:// URL, not 'aihorde.net'",
    ),
    "a negative --hordegenlen": Refused(
        "w", {}, -1, "--hordegenlen and --hordemaxctx must not be negative"
    ),
}
