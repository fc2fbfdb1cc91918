"""The devkit's dev Horde and scripted koboldcpp, for the benchmarks that run them.

Kept apart from ``product`` so that a worker process does not load them.
"""

from __future__ import annotations

import time

from koboldcpp_horde_chat.devkit import kcpp as kcpp_module
from koboldcpp_horde_chat.devkit._http import Request, Response
from koboldcpp_horde_chat.devkit.horde import DevHorde, is_validated_backend
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

__all__ = [
    "DevHorde",
    "Request",
    "Response",
    "ScriptedKoboldcpp",
    "ScriptedReply",
    "TimedDevHorde",
    "is_validated_backend",
    "kcpp_module",
]


class TimedDevHorde(DevHorde):
    """The dev Horde, handing each call of its Horde API to :meth:`on_call` with when
    the request was read and when its answer was ready (after the simulated
    latency), on the machine-wide monotonic clock."""

    #: Whether the dev Horde has the hook this class times (else nothing is timed).
    TIMED = hasattr(DevHorde, "_serve_horde")

    def _serve_horde(self, req: Request) -> Response:
        t_in = time.monotonic()
        resp = super()._serve_horde(req)
        self.on_call(req, resp, t_in, time.monotonic())
        return resp

    def on_call(self, req: Request, resp: Response, t_in: float, t_out: float) -> None:
        """One call of the Horde API, timed; nothing here."""
