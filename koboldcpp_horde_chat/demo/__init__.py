"""``koboldcpp-horde-chat demo``: the whole path on this machine (see :mod:`.command`)."""

from __future__ import annotations

from .command import (
    OPENING,
    DemoCase,
    FaultCauses,
    Verdict,
    build_parser,
    demo_cases,
    judge,
    main,
    unusable_model_output,
)

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
