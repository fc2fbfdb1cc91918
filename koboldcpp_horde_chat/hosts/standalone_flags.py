"""The standalone worker's flags, parsed and checked with messages naming the flag
(or the environment variable a bad value came from). Their names and meanings
follow koboldcpp's own (``--hordegenlen``, ``--hordemaxctx``...).
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Iterable, Mapping
from typing import NoReturn

from .. import __version__
from ..errors import ConfigError
from ..settings import DEFAULT_HORDE_URL, DEFAULT_KCPP_URL
from ..state.journal_paths import JOURNAL_DIR_ENV, default_state_dir
from .hosting import check_limits, check_url, worker_name_from

HORDE_URL_FLAG = "--horde-url"
HORDE_URL_ENV = "AI_HORDE_URL"
KCPP_URL_FLAG = "--kcpp-url"
KCPP_URL_ENV = "KCPP_URL"

#: Seconds a job in hand may take to finish after a stop signal (docker stop
#: sends SIGKILL 10 s after SIGTERM; Kubernetes 30 s; systemd 90 s).
DEFAULT_STOP_GRACE_S = 6.0
#: The most pop loops ``--parallelrequests`` runs (the Horde takes 1 to 50 ``threads``).
MAX_PARALLEL_REQUESTS = 50

#: Log levels --log-level (or the variable) takes.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_ENV = "KCPP_HORDE_LOG_LEVEL"
#: Features and guarantees an operator may withhold with --chat-withhold.
WITHHOLDABLE = (
    "seed", "presence_penalty", "tools", "json_object", "json_schema", "reasoning_effort",
    "vision", "prompt_overflow_refused",
)


#: The subcommands named first (``cli.main``); a near miss of one is hinted at.
SUBCOMMANDS = ("demo", "devhorde", "devkcpp")

#: koboldcpp's own flags an operator may bring along: the worker's flag to use instead,
#: and why. The worker reaches koboldcpp by URL and never starts or configures it.
KOBOLDCPP_HABITS = {
    "--port": ("--kcpp-url", "the worker takes koboldcpp's URL: --kcpp-url http://127.0.0.1:5001"),
    "--host": ("--kcpp-url", "the worker takes koboldcpp's URL: --kcpp-url http://127.0.0.1:5001"),
    "--password": ("--kcpp-password", "the worker takes koboldcpp's --password so"),
    "--maxrequestsize": ("--kcpp-max-request-mb", "koboldcpp's --maxrequestsize, in MB"),
    "--genlimit": ("--kcpp-genlimit", "the value of koboldcpp's --genlimit"),
}


def unknown_argument_hint(
    given: str, flags: Iterable[str], subcommands: Iterable[str] = ()
) -> str:
    """A hint for an argument the parser does not know (``--port``, ``dmeo``; without
    a value typed with it), in one clause: the worker's flag for one of koboldcpp's,
    else the nearest flag or subcommand; "" when nothing is near."""
    long_flags = [f for f in flags if f.startswith("--")]
    if given in KOBOLDCPP_HABITS and KOBOLDCPP_HABITS[given][0] in long_flags:
        flag, why = KOBOLDCPP_HABITS[given]
        return f"did you mean {flag}? ({why})"
    if given.startswith("-"):
        near = difflib.get_close_matches(given, long_flags, n=1, cutoff=0.6)
        return f"did you mean {near[0]}?" if near else ""
    near = difflib.get_close_matches(given, list(subcommands), n=1, cutoff=0.6)
    return f"did you mean the subcommand {near[0]}? (named first)" if near else ""


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose mistakes are one line on stderr (exit code 2), not
    argparse's usage dump."""

    #: The subcommands a near miss of one is hinted at (``build_parser``).
    subcommands: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            words = message[len(prefix) :].split()
            given = next((w for w in words if w.startswith("-")), words[0] if words else "")
            given = given.split("=", 1)[0]  # a value typed with it (a key, say) is not repeated
            hint = unknown_argument_hint(given, self._option_string_actions, self.subcommands)
            if hint:
                self.exit(2, f"{self.prog}: error: unknown argument {given}; {hint}\n")
            message = f"unknown argument {given}"
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The standalone worker's flags."""
    p = FlagParser(
        prog="koboldcpp-horde-chat",
        description=(
            "Serve AI Horde chat and text jobs with the model of a running koboldcpp.\n"
            "Three subcommands, named first, try it on this machine (see below)."
        ),
        epilog=(
            "subcommands (each takes --help):\n"
            "  koboldcpp-horde-chat demo      watch the whole path against a local dev Horde\n"
            "  koboldcpp-horde-chat devhorde  start a local dev Horde to point a worker at\n"
            "  koboldcpp-horde-chat devkcpp   start a scripted koboldcpp (no model) on 5001"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.subcommands = SUBCOMMANDS
    add = p.add_argument
    # The key, the name, and where koboldcpp and the Horde are.
    add("--version", action="version", version=f"%(prog)s {__version__}")
    add("--hordekey", default=os.environ.get("AI_HORDE_API_KEY", ""),
        help="your AI Horde API key (or the AI_HORDE_API_KEY environment variable)")
    add("--hordeworkername",
        help="your AI Horde worker name, 1 to 100 characters (or HORDE_WORKER_NAME)")
    add("--kcpp-url", help="koboldcpp's URL (default: the KCPP_URL environment variable, else "
        f"{DEFAULT_KCPP_URL})")
    add("--kcpp-wait", type=float, metavar="SECONDS",
        help="how long to wait at start-up for koboldcpp to answer, then exit with code 2 "
        "(default: wait as long as it takes, logging every 30 s)")
    add("--kcpp-password", default=os.environ.get("KCPP_PASSWORD", ""),
        help="koboldcpp's --password (or the KCPP_PASSWORD environment variable)")
    add("--horde-url", help="the Horde's URL (default: the AI_HORDE_URL environment variable, "
        f"else {DEFAULT_HORDE_URL})")
    _add_serving_flags(p)
    return p


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
    """What the worker declares to the Horde, and how it runs."""
    add = p.add_argument
    add("--hordemodelname", default="",
        help="your AI Horde display model name (default: the name koboldcpp reports)")
    add("--hordegenlen", type=int, default=0,
        help="the most tokens your worker will generate for one job (0 or unset: 1024)")
    add("--hordemaxctx", type=int, default=0,
        help="the largest context your worker accepts; 0 matches koboldcpp's context")
    add("--kcpp-max-request-mb", type=int, default=32, metavar="MB",
        help="koboldcpp's --maxrequestsize (default 32): a chat job whose request to "
        "koboldcpp would be larger is faulted without sending it")
    add("--kcpp-genlimit", type=int, default=0, metavar="TOKENS",
        help="koboldcpp's --genlimit, when it was started with one (koboldcpp does not "
        "report it): the worker then declares and generates at most that many tokens "
        "(default 0: none)")
    add("--chat-only", action="store_true",
        help="serve chat jobs only (pop with prompt_jobs false; a Horde without the chat "
        "routes ignores it and sends text jobs, which are then served)")
    add("--chat-withhold", default="", metavar="NAMES",
        help="comma-separated chat features or guarantees not to declare, from: "
        + ", ".join(WITHHOLDABLE))
    add("--trusted", action="store_true",
        help="this worker is trusted by the Horde (streamed jobs may then run up to 600 s)")
    # How it runs.
    add("--parallelrequests", type=int, default=1, metavar="N",
        help="serve N jobs at once, as koboldcpp's flag of that name does (start koboldcpp "
        "with the same --parallelrequests so it batches them; default 1)")
    add("--stop-grace", type=float, default=DEFAULT_STOP_GRACE_S, metavar="SECONDS",
        help="after Ctrl-C or SIGTERM, how long a job in hand may take to finish before it "
        f"is aborted and faulted (default {DEFAULT_STOP_GRACE_S:g}, under docker stop's 10 s)")
    add("--journal-dir", metavar="DIR",
        help="where the journal of jobs in hand is kept, so a restart after a crash faults "
        f"them at once (default: ${JOURNAL_DIR_ENV}, else {default_state_dir()})")
    add("--log-level", default=os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper() or "INFO",
        choices=LOG_LEVELS, type=str.upper,
        help=f"log level (default: ${LOG_LEVEL_ENV}, else INFO)")


def parse_withhold(text: str) -> frozenset[str]:
    """``"json_schema, tools"`` -> ``frozenset({"json_schema", "tools"})``; ConfigError
    for an unknown name."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(WITHHOLDABLE))
    if unknown:
        raise ConfigError(
            f"--chat-withhold: unknown name(s) {', '.join(unknown)}; "
            f"known: {', '.join(WITHHOLDABLE)}"
        )
    return names


def resolve_url(
    given: str | None,
    flag: str,
    env_name: str,
    default: str,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The flag's value when given, else ``env_name``'s when not blank, else ``default``;
    checked by ``hosting.check_url`` (as a Horde URL for the Horde's flag and
    variable), naming the flag or the variable a bad value came from."""
    if given is not None:
        return check_url(given, flag, horde=flag == HORDE_URL_FLAG)
    value = (os.environ if environ is None else environ).get(env_name, "")
    if not value.strip():
        return default
    return check_url(value, env_name, horde=env_name == HORDE_URL_ENV)


def check_flags(args: argparse.Namespace) -> None:
    """Check the flags that need no koboldcpp, resolving the URLs and the worker name
    in ``args``; ConfigError naming the flag."""
    if args.log_level not in LOG_LEVELS:  # argparse checks the flag, not its default
        raise ConfigError(
            f"{LOG_LEVEL_ENV} must be one of {', '.join(LOG_LEVELS)}, not {args.log_level!r}"
        )
    if not args.hordekey:
        raise ConfigError("--hordekey is required (or set AI_HORDE_API_KEY)")
    args.hordeworkername = worker_name_from(args.hordeworkername)
    check_limits(args.hordegenlen, args.hordemaxctx)
    if args.kcpp_max_request_mb < 1:
        raise ConfigError("--kcpp-max-request-mb must be at least 1")
    if args.kcpp_genlimit < 0:
        raise ConfigError("--kcpp-genlimit must not be negative (0: none)")
    if args.kcpp_wait is not None and not args.kcpp_wait >= 0:
        raise ConfigError("--kcpp-wait must be a number of seconds, 0 or more")
    if not 1 <= args.parallelrequests <= MAX_PARALLEL_REQUESTS:
        raise ConfigError(f"--parallelrequests must be 1 to {MAX_PARALLEL_REQUESTS}")
    if not args.stop_grace >= 0:
        raise ConfigError("--stop-grace must be a number of seconds, 0 or more")
    parse_withhold(args.chat_withhold)
    args.horde_url = resolve_url(args.horde_url, HORDE_URL_FLAG, HORDE_URL_ENV, DEFAULT_HORDE_URL)
    args.kcpp_url = resolve_url(args.kcpp_url, KCPP_URL_FLAG, KCPP_URL_ENV, DEFAULT_KCPP_URL)
