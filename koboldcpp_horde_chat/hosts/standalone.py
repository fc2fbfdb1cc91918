"""The standalone worker beside a running koboldcpp: its flags, start-up and run.

``koboldcpp-horde-chat --hordekey KEY --hordeworkername NAME [...]`` (see
:mod:`.cli`) serves chat and text jobs for the model loaded in the koboldcpp at
``--kcpp-url``; :func:`run_standalone` is that command. The demo runs the same
function against a local dev Horde.

Flag names and meanings follow koboldcpp's own (``--hordegenlen``,
``--hordemaxctx``, ``--hordemodelname``...). Seed: "Worked example:
koboldcpp's embedded worker".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from .. import __version__
from ..errors import BackendError, BackendUnauthorized, ConfigError
from ..horde.declaration import BackendCapabilities, model_id_warnings, standalone_model_id
from ..inflight import CallDeadlines, stop_call_ends
from ..koboldcpp.client import KoboldClient
from ..koboldcpp.manners import BackendIdentity, StandaloneManners
from ..service.recovery import Recovery
from ..settings import (
    DEFAULT_HORDE_URL,
    DEFAULT_KCPP_URL,
    MIB,
    WorkerSettings,
)
from ..state.journal import Journal
from ..state.journal_paths import JOURNAL_DIR_ENV, default_state_dir, journal_dir
from ..state.shared import WorkerState
from .hosting import (
    check_journal_dir,
    check_limits,
    check_url,
    open_journal,
    open_state,
    run_worker,
    serving_line,
    start_recovery,
    worker_name_from,
)

log = logging.getLogger("koboldcpp_horde_chat")

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
LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
#: Features and guarantees an operator may withhold with --chat-withhold.
WITHHOLDABLE = (
    "seed",
    "presence_penalty",
    "tools",
    "json_object",
    "json_schema",
    "reasoning_effort",
    "vision",
    "prompt_overflow_refused",
)


def configure_logging(level: str = "INFO") -> None:
    """Log to stderr with koboldcpp-like timestamps (once; keeps existing handlers)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    """The standalone worker's flags."""
    p = argparse.ArgumentParser(
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
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--hordekey",
        default=os.environ.get("AI_HORDE_API_KEY", ""),
        help="your AI Horde API key (or the AI_HORDE_API_KEY environment variable)",
    )
    p.add_argument(
        "--hordeworkername",
        default=None,
        help="your AI Horde worker name, 1 to 100 characters (or HORDE_WORKER_NAME)",
    )
    p.add_argument(
        "--kcpp-url",
        default=None,
        help=f"koboldcpp's URL (default: the KCPP_URL environment variable, else "
        f"{DEFAULT_KCPP_URL})",
    )
    p.add_argument(
        "--kcpp-wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long to wait at start-up for koboldcpp to answer, then exit with code 2 "
        "(default: wait as long as it takes, logging every 30 s)",
    )
    p.add_argument(
        "--kcpp-password",
        default=os.environ.get("KCPP_PASSWORD", ""),
        help="koboldcpp's --password (or the KCPP_PASSWORD environment variable)",
    )
    p.add_argument(
        "--horde-url",
        default=None,
        help=f"the Horde's URL (default: the AI_HORDE_URL environment variable, else "
        f"{DEFAULT_HORDE_URL})",
    )
    p.add_argument(
        "--hordemodelname",
        default="",
        help="your AI Horde display model name (default: the name koboldcpp reports)",
    )
    p.add_argument(
        "--hordegenlen",
        type=int,
        default=0,
        help="the most tokens your worker will generate for one job (0 or unset: 1024)",
    )
    p.add_argument(
        "--hordemaxctx",
        type=int,
        default=0,
        help="the largest context your worker accepts; 0 matches koboldcpp's context",
    )
    p.add_argument(
        "--kcpp-max-request-mb",
        type=int,
        default=32,
        metavar="MB",
        help="koboldcpp's --maxrequestsize (default 32): a chat job whose request to "
        "koboldcpp would be larger is faulted without sending it",
    )
    p.add_argument(
        "--kcpp-genlimit",
        type=int,
        default=0,
        metavar="TOKENS",
        help="koboldcpp's --genlimit, when it was started with one (koboldcpp does not "
        "report it): the worker then declares and generates at most that many tokens "
        "(default 0: none)",
    )
    p.add_argument(
        "--chat-only", action="store_true", help="serve chat jobs only (pop with prompt_jobs false)"
    )
    p.add_argument(
        "--chat-withhold",
        default="",
        metavar="NAMES",
        help="comma-separated chat features or guarantees not to declare, from: "
        + ", ".join(WITHHOLDABLE),
    )
    p.add_argument(
        "--trusted",
        action="store_true",
        help="this worker is trusted by the Horde (streamed jobs may then run up to 600 s)",
    )
    p.add_argument(
        "--parallelrequests",
        type=int,
        default=1,
        metavar="N",
        help="serve N jobs at once, as koboldcpp's flag of that name does (start koboldcpp "
        "with the same --parallelrequests so it batches them; default 1)",
    )
    p.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE_S,
        metavar="SECONDS",
        help="after Ctrl-C or SIGTERM, how long a job in hand may take to finish before it "
        f"is aborted and faulted (default {DEFAULT_STOP_GRACE_S:g}, under docker stop's 10 s)",
    )
    p.add_argument(
        "--journal-dir",
        default=None,
        metavar="DIR",
        help="where the journal of jobs in hand is kept, so a restart after a crash faults "
        f"them at once (default: ${JOURNAL_DIR_ENV}, else {default_state_dir()})",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper() or "INFO",
        choices=LOG_LEVELS,
        type=str.upper,
        help=f"log level (default: ${LOG_LEVEL_ENV}, else INFO)",
    )
    return p


def parse_withhold(text: str) -> frozenset[str]:
    """``"json_schema, tools"`` -> ``frozenset({"json_schema", "tools"})``.

    Raises ConfigError for a name that is not a known feature or guarantee.
    """
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(WITHHOLDABLE))
    if unknown:
        raise ConfigError(
            f"--chat-withhold: unknown name(s) {', '.join(unknown)}; "
            f"known: {', '.join(WITHHOLDABLE)}"
        )
    return names


def normalise_url(value: str, flag: str) -> str:
    """``value`` as a base URL without a trailing slash (:func:`hosting.check_url`).

    ``flag`` names where the value came from (``--horde-url``, ``AI_HORDE_URL``,
    ``--kcpp-url`` or ``KCPP_URL``). A Horde URL given with the API path
    (``https://aihorde.net/api/v2``) is cut back to its base. Raises
    ConfigError, naming ``flag``, for anything but an http(s) URL.
    """
    return check_url(value, flag, horde=flag in (HORDE_URL_FLAG, HORDE_URL_ENV))


def resolve_url(
    given: str | None,
    flag: str,
    env_name: str,
    default: str,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The URL to use, normalised by :func:`normalise_url`.

    The flag's value when it was given (``given`` is not None); else the
    environment variable ``env_name`` when it is set and not blank; else
    ``default``. Raises ConfigError naming the flag or the variable the bad
    value came from, e.g. ``AI_HORDE_URL needs an http:// or https:// URL``.
    """
    if given is not None:
        return normalise_url(given, flag)
    env = os.environ if environ is None else environ
    value = env.get(env_name, "")
    if not value.strip():
        return default
    return normalise_url(value, env_name)


def check_flags(args: argparse.Namespace) -> None:
    """Check the flags that need no koboldcpp.

    Resolves and normalises the URLs in ``args`` (:func:`resolve_url`) and
    strips the worker name. Raises ConfigError with a message naming the flag
    (or the environment variable a bad URL came from).
    """
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


def settings_from_args(
    args: argparse.Namespace,
    backend: KoboldClient,
    *,
    wait_s: float | None = 0.0,
    stop_event: threading.Event | None = None,
) -> tuple[WorkerSettings, BackendCapabilities]:
    """Read the running koboldcpp and the flags into settings.

    Waits for koboldcpp to answer: up to ``wait_s`` seconds, or as long as
    it takes when ``wait_s`` is None, logging every 30 s; ``stop_event``
    ends the wait. Raises ConfigError for a bad flag, an unreachable (within
    ``wait_s``) or protected koboldcpp, a refused password, or no model loaded.
    """
    check_flags(args)
    withhold = parse_withhold(args.chat_withhold)
    stopper = stop_event if stop_event is not None else threading.Event()
    started = time.monotonic()
    next_note = started
    while True:
        try:
            info = backend.info()
            break
        except BackendUnauthorized:
            if args.kcpp_password:
                raise ConfigError(
                    f"koboldcpp at {args.kcpp_url} refused the password given with "
                    "--kcpp-password (or KCPP_PASSWORD)"
                ) from None
            raise ConfigError(
                f"koboldcpp at {args.kcpp_url} is password protected: pass its password "
                "with --kcpp-password or KCPP_PASSWORD"
            ) from None
        except BackendError as exc:
            now = time.monotonic()
            if wait_s is not None and now - started >= wait_s:
                waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
                if exc.status:  # something else answers there (a wrong port, say)
                    raise ConfigError(
                        f"{args.kcpp_url} answers, but not as koboldcpp ({exc}){waited}: "
                        "is --kcpp-url koboldcpp's address?"
                    ) from None
                raise ConfigError(
                    f"koboldcpp at {args.kcpp_url} does not answer{waited}: {exc}"
                ) from None
            if now >= next_note:
                log.info("waiting for koboldcpp at %s (%s)", args.kcpp_url, exc.detail)
                next_note = now + 30.0
            pause = 3.0 if wait_s is None else min(3.0, wait_s - (now - started))
            if stopper.wait(max(0.0, pause)):
                raise ConfigError("stopped while waiting for koboldcpp") from None
    if info.model_name in ("", "inactive"):
        raise ConfigError(f"koboldcpp at {args.kcpp_url} has no text model loaded")
    model_id = standalone_model_id(info.model_name, args.hordemodelname)
    for warning in model_id_warnings(model_id):
        log.warning("%s", warning)
    settings = WorkerSettings(
        api_key=args.hordekey,
        worker_name=args.hordeworkername,
        model_id=model_id,
        backend_max_context_length=info.max_context_length,
        backend_model_name=info.model_name,
        horde_max_context_length=args.hordemaxctx,
        max_length=args.hordegenlen if args.hordegenlen > 0 else 1024,
        horde_url=args.horde_url,
        kcpp_url=args.kcpp_url,
        kcpp_password=args.kcpp_password,
        vision=info.vision,
        prompt_jobs=not args.chat_only,
        chat_withhold=withhold,
        trusted=args.trusted,
        threads=args.parallelrequests,
        kcpp_max_request_bytes=args.kcpp_max_request_mb * MIB,
        kcpp_genlimit=args.kcpp_genlimit,
    )
    caps = BackendCapabilities(vision=info.vision, image_url=settings.image_url_transport)
    return settings, caps


def run_standalone(argv: Sequence[str], *, stop_event: threading.Event | None = None) -> int:
    """Run the worker until SIGINT or SIGTERM (or ``stop_event``); returns the exit code.

    Ends the jobs the journal says an earlier run left in hand as soon as the
    Horde answers, on a thread of its own (``recovery.Recovery``); meanwhile
    waits for koboldcpp for ``--kcpp-wait`` seconds, or as long as it takes
    without that flag (a signal ends the wait). Then runs ``--parallelrequests`` pop
    loops sharing one state. A first signal stops popping; a job in hand may
    finish within ``--stop-grace`` seconds, else it is aborted and faulted. A
    second signal faults the jobs in hand at once and exits. Exit codes: 0
    after a requested stop, 2 for a configuration error (koboldcpp not
    answering within ``--kcpp-wait`` among them) or a declaration the Horde
    refused, 3 for an API key the Horde refused, 130 after a second signal.
    """
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level if args.log_level in LOG_LEVELS else "INFO")
    if stop_event is None:
        stop_event = threading.Event()
    stopper = stop_event
    states: list[WorkerState] = []
    # The stop's deadlines exist before any state: a signal during the recovery or
    # the wait for koboldcpp bounds their calls too (the states share them).
    deadlines = CallDeadlines()
    forced: list[bool] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stopper.is_set():
            log.warning("second signal: faulting the jobs in hand and exiting now")
            forced.append(True)
            for state in states:
                state.fault_jobs_now()
            raise SystemExit(130)
        if states:
            in_hand = len(states[0].jobs_in_hand())
            if in_hand:
                log.info(
                    "signal %d: finishing the %s in hand (within %g s, else faulted), "
                    "then stopping",
                    signum,
                    "job" if in_hand == 1 else f"{in_hand} jobs",
                    args.stop_grace,
                )
            else:
                log.info("signal %d: stopping (no job in hand)", signum)
            states[0].request_stop(args.stop_grace)
        else:
            log.info("signal %d: stopping (within %g s)", signum, args.stop_grace)
            deadlines.set(stop_call_ends(time.monotonic() + args.stop_grace))
            stopper.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    # A directory the operator named must keep the journal (else exit 2); the
    # default one only turns crash recovery off, saying so (hosting.open_journal).
    journal_source: str | None = None
    if args.journal_dir:
        directory, journal_source = Path(args.journal_dir).expanduser(), "--journal-dir"
    else:
        directory = journal_dir()
        if os.environ.get(JOURNAL_DIR_ENV, "").strip():
            journal_source = JOURNAL_DIR_ENV
    # The jobs an earlier run left in hand go first, as soon as the Horde answers:
    # their leases run while koboldcpp loads or restarts, so the recovery does
    # not wait for it (the pop loops wait for the recovery).
    try:
        check_flags(args)
        if journal_source is not None:
            check_journal_dir(directory, journal_source)
        journal = open_journal(args.hordeworkername, directory, journal_setting="--journal-dir")
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    recovery = None
    if journal is not None:
        recovery = start_recovery(
            journal,
            horde_url=args.horde_url,
            api_key=args.hordekey,
            model_id_default=standalone_model_id("", args.hordemodelname),
            stop_event=stop_event,
            kcpp=(args.kcpp_url, args.kcpp_password),
            deadlines=deadlines,
        )
    try:
        return _run_declared(args, stop_event, states, directory, journal, recovery, deadlines)
    finally:
        # The recovery's last attempts end by the stop's deadline; the rest stays
        # in the journal, which is released only then (not after a second signal).
        if recovery is not None and not forced:
            recovery.finish(args.stop_grace)
        if journal is not None:
            journal.unlock()


def _run_declared(
    args: argparse.Namespace,
    stop_event: threading.Event,
    states: list[WorkerState],
    directory: Path,
    journal: Journal | None,
    recovery: Recovery | None,
    deadlines: CallDeadlines,
) -> int:
    """Read koboldcpp, declare and serve; read it again and declare anew when it
    came back serving something else. The exit code."""
    while True:
        try:
            backend = KoboldClient(args.kcpp_url, args.kcpp_password)
            backend.deadlines = deadlines  # its reads end by a stop's deadline
            settings, caps = settings_from_args(
                args, backend, wait_s=args.kcpp_wait, stop_event=stop_event
            )
        except ConfigError as exc:
            if stop_event.is_set():
                log.info("%s", exc)
                return 0
            log.error("%s", exc)
            return 2
        if journal is not None:
            state = open_state(
                settings, directory, stop_event=stop_event, journal=journal, recovery=recovery,
                call_deadlines=deadlines,
            )
        else:
            state = WorkerState(
                settings, stop_event=stop_event, journal=None, call_deadlines=deadlines
            )
        if states:
            state.carry_over(states[0])
        states[:] = [state]
        log.info("%s", serving_line(settings))
        manners = StandaloneManners(
            backend,
            check_busy=args.parallelrequests <= 1,
            identity=BackendIdentity(
                settings.backend_model_name, settings.backend_max_context_length, settings.vision
            ),
        )
        code = _serve(settings, caps, state, manners, args.parallelrequests)
        if manners.changed is None or stop_event.is_set():
            return code
        log.warning("%s: reading it again to declare what it serves now", manners.changed)


def _serve(
    settings: WorkerSettings,
    caps: BackendCapabilities,
    state: WorkerState,
    manners: StandaloneManners,
    slots: int,
) -> int:
    """Run ``slots`` pop loops on threads of their own until they stop; the exit code."""
    codes: list[int] = []

    def serve(worker_id: int) -> None:
        codes.append(
            run_worker(settings, manners=manners, caps=caps, worker_id=worker_id, state=state)
        )

    threads = [
        threading.Thread(target=serve, args=(n,), name=f"horde-worker-{n}", daemon=True)
        for n in range(1, slots + 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.25)
    return max([state.exit_code, *codes])
