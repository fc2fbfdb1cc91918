"""``koboldcpp-horde-chat demo``: the whole path on this machine, in one command.

Starts the dev Horde on 127.0.0.1, uses the koboldcpp at ``--kcpp-url`` when
one answers and the devkit's scripted koboldcpp otherwise (said plainly),
runs the real standalone worker against them, and sends requests one at a time
as a client would. Each case is a verdict about the worker: every job it popped
ended in exactly one accepted submit or fault of the seed's shape (seed 000,
steps 6 to 8). What the model did not do as the case hoped (no tool call, a
reply cut at max_tokens, JSON that is not an object) is printed apart as a
model note and fails nothing against a real koboldcpp; against the scripted one
every case must be as expected. The image case is sent when koboldcpp reports
vision and named as skipped otherwise. Exit 0 when every case passed. The
worker keeps its job journal in a temporary directory removed at the end, never
in the user's state directory.

Its modules: :mod:`.cases` (what each case sends and hopes for),
:mod:`.verdict` (judging the worker from the dev Horde's ledger, pure) and
:mod:`.command` (the flags, the koboldcpp choice, the servers, the worker and
the printed lines).
"""

from __future__ import annotations

from .cases import DemoCase, demo_cases
from .command import OPENING, FaultCauses, build_parser, main
from .verdict import Verdict, judge, unusable_model_output

__all__ = [
    "OPENING",
    "DemoCase",
    "FaultCauses",
    "Verdict",
    "build_parser",
    "demo_cases",
    "judge",
    "main",
    "unusable_model_output",
]
