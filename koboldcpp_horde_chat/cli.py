"""The ``koboldcpp-horde-chat`` command (and ``python -m koboldcpp_horde_chat``).

``koboldcpp-horde-chat --hordekey KEY --hordeworkername NAME [...]`` runs the
standalone worker beside a running koboldcpp (:mod:`.standalone`);
``koboldcpp-horde-chat demo`` runs the whole path against a local dev Horde
(:mod:`.demo`); ``koboldcpp-horde-chat devhorde`` starts the dev Horde by itself,
for trying a worker or a patched koboldcpp by hand (:mod:`.devkit.serve`);
``koboldcpp-horde-chat devkcpp`` starts the scripted koboldcpp by itself (canned
replies, not a model), for trying the standalone worker without koboldcpp
(:mod:`.devkit.serve_kcpp`).

The subcommands are imported only when asked for; none of them imports this
module.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .hosts.standalone import run_standalone
from .hosts.standalone_flags import SUBCOMMANDS

__all__ = ["SUBCOMMANDS", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``koboldcpp-horde-chat``; returns the exit code.

    ``argv`` defaults to ``sys.argv[1:]``. ``demo``, ``devhorde`` or ``devkcpp`` as the
    first argument run that subcommand with the rest; anything else is the
    standalone worker's flags (:func:`.standalone.run_standalone`).
    """
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
