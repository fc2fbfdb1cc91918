"""``koboldcpp-horde-chat devkcpp``: the scripted koboldcpp by itself, for trying a worker by hand.

Starts :class:`~koboldcpp_horde_chat.devkit.kcpp.ScriptedKoboldcpp` on ``--host``
and ``--port`` (127.0.0.1:5001 by default, where the standalone worker looks for
koboldcpp; ``--port 0`` takes a free port), says in its first line that it is
scripted (canned replies, not a model), prints how to point the standalone worker
at it and the dev Horde, and serves until Ctrl-C or SIGTERM. Its log lines go to
stderr.

The first line printed is always ``Scripted koboldcpp at <url> (model <name>,
context <n> tokens, vision on|off): canned replies, not a model``, so a script can
read the URL from it. Exit codes: 0 after Ctrl-C or SIGTERM, 2 when the port
cannot be bound or ``--contextsize`` is below 256.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from koboldcpp_horde_chat.devkit.kcpp import CHATML_TEMPLATE, ScriptedKoboldcpp
from koboldcpp_horde_chat.devkit.serve import DEFAULT_KEY, DEFAULT_PORT
from koboldcpp_horde_chat.devkit.serve_common import (
    add_log_level,
    listen_parser,
    serve_until_stopped,
)

DEFAULT_KCPP_PORT = 5001
DEFAULT_MODEL = "koboldcpp/scripted-model"
#: The smallest context it accepts, tokens (the worker needs room for a prompt and a reply).
MIN_CONTEXT = 256


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``koboldcpp-horde-chat devkcpp``."""
    p = listen_parser(
        "koboldcpp-horde-chat devkcpp",
        "Start a scripted koboldcpp (koboldcpp 1.116.1's HTTP API with canned "
        "replies, not a model) and keep it running until Ctrl-C, to try the standalone "
        "worker with the dev Horde without koboldcpp or a model.",
        default_port=DEFAULT_KCPP_PORT,
        port_note=", koboldcpp's",
    )
    p.add_argument(
        "--vision",
        action="store_true",
        help="report a vision projector, so the worker declares and serves image jobs",
    )
    p.add_argument(
        "--model-name",
        default=DEFAULT_MODEL,
        help=f"the model name it reports (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--contextsize",
        type=int,
        default=4096,
        help="the context size it reports, tokens (default 4096)",
    )
    p.add_argument(
        "--kcpp-version",
        default="1.116.1",
        help="the koboldcpp version it reports in /api/extra/version (default 1.116.1)",
    )
    p.add_argument(
        "--no-chat-route",
        action="store_true",
        help="answer /v1/chat/completions 404, as a koboldcpp without the route "
        "(koboldcpp before 1.46 had none)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="report no chat template in /props (a model without one: koboldcpp "
        "renders chat with its Alpaca fallback)",
    )
    add_log_level(p, "log level of its lines on stderr (default INFO)")
    return p


def main(argv: Sequence[str] = ()) -> int:
    """Run the scripted koboldcpp until Ctrl-C or SIGTERM; returns the exit code (0, or 2)."""
    args = build_parser().parse_args(list(argv))
    if args.contextsize < MIN_CONTEXT:
        print(f"--contextsize must be at least {MIN_CONTEXT} tokens", flush=True)
        return 2
    kcpp = ScriptedKoboldcpp(
        model_name=args.model_name,
        max_context_length=args.contextsize,
        vision=args.vision,
        version=args.kcpp_version,
        chat_route=not args.no_chat_route,
        chat_template="" if args.no_chat_template else CHATML_TEMPLATE,
        host=args.host,
        port=args.port,
    )
    # Logging starts after the port is bound: what it is comes first.

    def banner() -> str:
        url = kcpp.url
        horde = f"http://127.0.0.1:{DEFAULT_PORT}"
        return (
            f"Scripted koboldcpp at {url} (model {args.model_name}, context {args.contextsize} "
            f"tokens, vision {'on' if args.vision else 'off'}): canned replies, not a model\n"
            "It answers koboldcpp 1.116.1's routes the way koboldcpp does; its log lines go to "
            "stderr.\n"
            "\n"
            "The standalone worker, with the dev Horde (koboldcpp-horde-chat devhorde) running:\n"
            f"  koboldcpp-horde-chat --horde-url {horde} --kcpp-url {url} "
            f"--hordekey {DEFAULT_KEY} --hordeworkername my-worker\n"
            "\n"
            "Ctrl-C stops it."
        )

    return serve_until_stopped(kcpp, args, banner=banner, name="Scripted koboldcpp")
