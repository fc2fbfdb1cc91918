"""``koboldcpp-horde-chat devhorde``: the dev Horde by itself, for trying a worker by hand.

Starts :class:`~koboldcpp_horde_chat.devkit.horde.DevHorde` on ``--host`` and
``--port`` (127.0.0.1:7001 by default; ``--port 0`` takes a free port), prints
its URL, the API key it accepts, how to point a worker at it and a chat and a
text request to send it with ``curl``, and serves until Ctrl-C or SIGTERM. Its
log lines (requests queued, pops, submits, faults) go to stderr.

The first line printed is always ``Dev Horde at <url> (API key: <key>)``, so a
script can read the URL from it; the second names the object store's port
(signed URLs for chat images and offloaded messages). Logging starts once both
ports are bound, so no log line comes before them. Exit codes: 0 after Ctrl-C or SIGTERM, 2 when
the port cannot be bound or ``--latency-ms`` is not a number of milliseconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.serve_common import (
    add_log_level,
    listen_parser,
    serve_until_stopped,
)

DEFAULT_PORT = 7001
DEFAULT_KEY = "devkey"
#: The bodies of the printed example requests (64 tokens each, so a reply comes quickly).
CHAT_EXAMPLE = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'
TEXT_EXAMPLE = '{"prompt": "Once upon a time", "params": {"max_length": 64}}'


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``koboldcpp-horde-chat devhorde``."""
    p = listen_parser(
        "koboldcpp-horde-chat devhorde",
        "Start a local development AI Horde (chat and text jobs) and keep it "
        "running until Ctrl-C, to point the worker or a patched koboldcpp at.",
        default_port=DEFAULT_PORT,
    )
    p.add_argument(
        "--key",
        default=DEFAULT_KEY,
        help=f"the worker API key it accepts (default {DEFAULT_KEY})",
    )
    p.add_argument(
        "--trusted",
        action="store_true",
        help="treat workers as trusted (a streamed job's lease may then grow to 600 s)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="a network round trip to add to each pop, submit and progress answer "
        "(half before, half after), as a Horde far away would (default 0)",
    )
    add_log_level(p, "log level of the dev Horde's lines on stderr (default INFO)")
    return p


def main(argv: Sequence[str] = ()) -> int:
    """Run the dev Horde until Ctrl-C or SIGTERM; returns the exit code (0, or 2)."""
    args = build_parser().parse_args(list(argv))
    if not args.latency_ms >= 0:
        print("--latency-ms must be a number of milliseconds, 0 or more", flush=True)
        return 2
    horde = DevHorde(
        api_keys=(args.key,),
        host=args.host,
        port=args.port,
        trusted=args.trusted,
        latency_s=args.latency_ms / 1000.0,
    )
    # Logging starts after the ports are bound: the URL and key are the first thing
    # printed, and the image store's port is named in plain words below them.

    def banner() -> str:
        url = horde.url
        return (
            f"Dev Horde at {url} (API key: {args.key})\n"
            f"Its object store at {horde.storage_url} serves chat images and large requests' "
            "messages by signed URL, as the real Horde's does.\n"
            "Its log lines (requests queued, pops, submits, faults) go to stderr.\n"
            "\n"
            "The standalone worker, beside a running koboldcpp:\n"
            f"  koboldcpp-horde-chat --horde-url {url} --hordekey {args.key} "
            "--hordeworkername my-worker\n"
            "No koboldcpp at hand? A scripted one (canned replies, not a model) on port 5001, "
            "in another terminal:\n"
            "  koboldcpp-horde-chat devkcpp\n"
            "A patched koboldcpp:\n"
            f"  AI_HORDE_URL={url} python koboldcpp.py --model MODEL.gguf "
            f"--hordekey {args.key} --hordeworkername my-worker\n"
            "Send a chat request, then read its status (the dev Horde needs no client key):\n"
            f"  curl -s -X POST {url}/api/v2/generate/chat/async -H 'Content-Type: "
            f"application/json' -d '{CHAT_EXAMPLE}'\n"
            f"  curl -s {url}/api/v2/generate/chat/status/REQUEST_ID\n"
            "Send a text request, then read its status:\n"
            f"  curl -s -X POST {url}/api/v2/generate/text/async -H 'Content-Type: "
            f"application/json' -d '{TEXT_EXAMPLE}'\n"
            f"  curl -s {url}/api/v2/generate/text/status/REQUEST_ID\n"
            "\n"
            "Ctrl-C stops it."
        )

    return serve_until_stopped(horde, args, banner=banner, name="Dev Horde")
