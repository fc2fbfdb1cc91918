"""The ``koboldcpp-horde-chat`` command: the standalone worker, or the subcommands
``demo``, ``devhorde`` (the dev Horde alone) and ``devkcpp`` (the scripted
koboldcpp alone), each imported only when asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .hosts.standalone import run_standalone
from .hosts.standalone_flags import SUBCOMMANDS

__all__ = ["SUBCOMMANDS", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (``argv`` defaults to ``sys.argv[1:]``); the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] == "demo":
        from .demo import main as demo_main

        return demo_main(arguments[1:])
    if arguments and arguments[0] == "devhorde":
        from .devkit.serve import main as devhorde_main

        return devhorde_main(arguments[1:])
    if arguments and arguments[0] == "devkcpp":
        from .devkit.serve_kcpp import main as devkcpp_main

        return devkcpp_main(arguments[1:])
    return run_standalone(arguments)
