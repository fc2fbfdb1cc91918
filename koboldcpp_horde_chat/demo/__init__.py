"""``koboldcpp-horde-chat demo``: the real standalone worker against a local dev
Horde and a koboldcpp (yours when one answers, else the scripted one).

Each case judges the worker: every job it popped must end in exactly one
accepted submit or fault of the seed's shape (seed 000, steps 6 to 8). What the
model did not do as hoped is a note, failing nothing against a real koboldcpp
(every case must be as expected against the scripted one). The journal lives
in a temporary directory, never in the user's state directory.
"""

from __future__ import annotations

from .command import main

__all__ = ["main"]
