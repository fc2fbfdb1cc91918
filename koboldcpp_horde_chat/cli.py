"""The ``koboldcpp-horde-chat`` command: the standalone worker, or the subcommands
``demo``, ``devhorde`` (the dev Horde alone) and ``devkcpp`` (the scripted
koboldcpp alone), each imported only when asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .hosts.standalone import run_standalone

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (``argv`` defaults to ``sys.argv[1:]``); the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = arguments[0] if arguments else ""
    if command == "demo":
        from .demo import main as subcommand
    elif command == "devhorde":
        from .devkit.serve import main as subcommand
    elif command == "devkcpp":
        from .devkit.serve_kcpp import main as subcommand
    else:
        return run_standalone(arguments)
    return subcommand(arguments[1:])
