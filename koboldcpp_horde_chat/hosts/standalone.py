"""The standalone worker beside a running koboldcpp (``koboldcpp-horde-chat --hordekey
KEY --hordeworkername NAME``): koboldcpp read into settings, the recovery, the pop
loops and the signals. Seed: "Worked example: koboldcpp's embedded worker".
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from ..errors import BackendError, BackendUnauthorized, ConfigError
from ..horde.declaration import BackendCapabilities, model_id_warnings, standalone_model_id
from ..inflight import CallDeadlines, stop_call_ends
from ..koboldcpp.api import BackendInfo
from ..koboldcpp.client import KoboldClient
from ..koboldcpp.manners import BackendIdentity, StandaloneManners
from ..koboldcpp.versions import CHAT_ROUTE_SINCE, at_least, since
from ..service.recovery import Recovery
from ..settings import MIB, WorkerSettings
from ..state.journal_paths import JOURNAL_DIR_ENV, journal_dir
from ..state.shared import WorkerState
from . import hosting
from .key_check import check_api_key
from .standalone_flags import LOG_LEVELS, build_parser, check_flags, parse_withhold

log = logging.getLogger("koboldcpp_horde_chat")

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: str = "INFO") -> None:
    """Log to stderr with koboldcpp-like timestamps (once; keeps existing handlers)."""
    logging.basicConfig(format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    logging.getLogger().setLevel(level.upper())
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def read_koboldcpp(
    args: argparse.Namespace,
    backend: KoboldClient,
    *,
    wait_s: float | None = 0.0,
    stop_event: threading.Event | None = None,
) -> BackendInfo:
    """What the running koboldcpp reports, once it answers.

    Waits up to ``wait_s`` seconds (None: as long as it takes, logging every
    30 s) or until ``stop_event``. ConfigError for a bad flag, a koboldcpp that
    does not answer in time, or one that refuses the password.
    """
    check_flags(args)
    stopper = stop_event if stop_event is not None else threading.Event()
    started = time.monotonic()
    next_note = started
    while True:
        try:
            return backend.info()
        except BackendUnauthorized:
            problem = (
                "refused the password given with --kcpp-password (or KCPP_PASSWORD)"
                if args.kcpp_password
                else "is password protected: pass its password with --kcpp-password or "
                "KCPP_PASSWORD"
            )
            raise ConfigError(f"koboldcpp at {args.kcpp_url} {problem}") from None
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


def settings_from_flags(args: argparse.Namespace) -> WorkerSettings:
    """The checked flags as settings, before koboldcpp is read (what the recovery needs):
    no context, and the model ``--hordemodelname`` names."""
    return WorkerSettings(
        api_key=args.hordekey,
        worker_name=args.hordeworkername,
        model_id=standalone_model_id("", args.hordemodelname),
        backend_max_context_length=0,
        horde_max_context_length=args.hordemaxctx,
        max_length=args.hordegenlen if args.hordegenlen > 0 else 1024,
        horde_url=args.horde_url,
        kcpp_url=args.kcpp_url,
        kcpp_password=args.kcpp_password,
        prompt_jobs=not args.chat_only,
        chat_withhold=parse_withhold(args.chat_withhold),
        trusted=args.trusted,
        threads=args.parallelrequests,
        kcpp_max_request_bytes=args.kcpp_max_request_mb * MIB,
        kcpp_genlimit=args.kcpp_genlimit,
    )


def settings_from_info(
    args: argparse.Namespace, info: BackendInfo
) -> tuple[WorkerSettings, BackendCapabilities]:
    """The flags and koboldcpp's report as settings and capabilities (chat only when
    its version has the chat route). ConfigError for no model loaded, or
    ``--chat-only`` with a koboldcpp too old for chat."""
    if info.model_name in ("", "inactive"):
        raise ConfigError(f"koboldcpp at {args.kcpp_url} has no text model loaded")
    chat = at_least(info.version, CHAT_ROUTE_SINCE)  # an unreadable version: the first job tells
    if not chat and args.chat_only:
        raise ConfigError(
            f"koboldcpp {info.version} at {args.kcpp_url} has no chat route (koboldcpp "
            f"{since(CHAT_ROUTE_SINCE)} added /v1/chat/completions): --chat-only leaves "
            "it nothing to serve; upgrade koboldcpp, or drop --chat-only to serve text jobs"
        )
    model_id = standalone_model_id(info.model_name, args.hordemodelname)
    for warning in model_id_warnings(model_id):
        log.warning("%s", warning)
    settings = replace(
        settings_from_flags(args),
        model_id=model_id,
        backend_max_context_length=info.max_context_length,
        backend_model_name=info.model_name,
        vision=info.vision,
    )
    return settings, hosting.capabilities(settings, chat=chat)


def run_standalone(argv: Sequence[str], *, stop_event: threading.Event | None = None) -> int:
    """Run the worker until SIGINT or SIGTERM (or ``stop_event``); the exit code.

    A first signal stops popping and lets the jobs being served finish within
    ``--stop-grace`` seconds, else faults them; a second faults them at once.
    Exit codes: 0 after a requested stop, 2 for a configuration error or a
    refused declaration, 3 for a refused API key (checked first), 130 after a
    second signal.
    """
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level if args.log_level in LOG_LEVELS else "INFO")
    run = _Run(args, stop_event if stop_event is not None else threading.Event())
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, run.on_signal)
        signal.signal(signal.SIGTERM, run.on_signal)
    # The key after the flags, before the journal, the recovery and the wait for
    # koboldcpp: a wrong one is said now, not at the first pop.
    try:
        check_flags(args)
        # A journal directory the operator named (--journal-dir or the variable) must
        # keep the journal (else exit 2); the default one only turns crash recovery off,
        # saying so (hosting.start_recovery).
        directory = Path(args.journal_dir).expanduser() if args.journal_dir else journal_dir()
        if args.journal_dir:
            hosting.check_journal_dir(directory, "--journal-dir")
        elif os.environ.get(JOURNAL_DIR_ENV, "").strip():
            hosting.check_journal_dir(directory, JOURNAL_DIR_ENV)
        refused = check_api_key(args.horde_url, args.hordekey, deadlines=run.deadlines)
        if refused is not None:
            log.error("%s", refused)
            return 3
        # The jobs an earlier run left in hand go first, as soon as the Horde answers:
        # their leases run while koboldcpp loads or restarts, so the recovery does
        # not wait for it (the pop loops wait for the recovery).
        run.recovery = hosting.start_recovery(
            settings_from_flags(args), directory, run.stop_event, run.deadlines,
            journal_setting="--journal-dir", abort_kcpp=True,
        )
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    try:
        return run.declare_and_serve()
    finally:
        # The recovery's last attempts end by the stop's deadline; the rest stays
        # in the journal, which is released only then (not after a second signal).
        if run.recovery is not None:
            if not run.forced:
                run.recovery.finish(args.stop_grace)
            run.recovery.journal.unlock()


class _Run:
    """One run of the standalone worker: its flags, its stop, its states (one per
    declaration; the last one serves) and its recovery."""

    def __init__(self, args: argparse.Namespace, stop_event: threading.Event) -> None:
        self.args = args
        self.stop_event = stop_event
        # The stop's deadlines exist before any state: a signal during the recovery or
        # the wait for koboldcpp bounds their calls too (the states share them).
        self.deadlines = CallDeadlines()
        self.states: list[WorkerState] = []
        self.forced = False  # a second signal came
        self.recovery: Recovery | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGINT and SIGTERM: the first signal stops, the second exits."""
        grace = self.args.stop_grace
        if self.stop_event.is_set():
            log.warning("second signal: faulting the jobs in hand and exiting now")
            self.forced = True
            for state in self.states:
                state.fault_jobs_now()
            raise SystemExit(130)
        if self.states:
            in_hand = len(self.states[0].jobs_in_hand())
            if in_hand:
                log.info(
                    "signal %d: finishing the %s in hand (within %g s, else faulted), "
                    "then stopping",
                    signum,
                    "job" if in_hand == 1 else f"{in_hand} jobs",
                    grace,
                )
            else:
                log.info("signal %d: stopping (no job in hand)", signum)
            self.states[0].request_stop(grace)
        else:
            log.info("signal %d: stopping (within %g s)", signum, grace)
            self.deadlines.set(stop_call_ends(time.monotonic() + grace))
            self.stop_event.set()

    def declare_and_serve(self) -> int:
        """Read koboldcpp, declare and serve; again when koboldcpp came back serving
        something else. The exit code."""
        args, stop_event = self.args, self.stop_event
        while True:
            try:
                # Its reads end by a stop's deadline.
                backend = hosting.kcpp_client(settings_from_flags(args), self.deadlines)
                info = read_koboldcpp(args, backend, wait_s=args.kcpp_wait, stop_event=stop_event)
                settings, caps = settings_from_info(args, info)
            except ConfigError as exc:  # said as an error, unless a stop cut the wait short
                stopped = stop_event.is_set()
                log.log(logging.INFO if stopped else logging.ERROR, "%s", exc)
                return 0 if stopped else 2
            state = hosting.new_state(settings, self.recovery, self.deadlines, stop_event)
            if self.states:
                state.carry_over(self.states[0])
            self.states[:] = [state]
            log.info("%s", hosting.serving_line(settings, chat=caps.chat))
            hosting.say_koboldcpp_found(info, settings, caps)
            manners = StandaloneManners(
                backend, check_busy=args.parallelrequests <= 1, identity=BackendIdentity.of(info)
            )
            code = self._serve(state, caps, manners)
            if manners.changed is None or stop_event.is_set():
                return code
            log.warning("%s: reading it again to declare what it serves now", manners.changed)

    def _serve(
        self, state: WorkerState, caps: BackendCapabilities, manners: StandaloneManners
    ) -> int:
        """Run a pop loop per ``--parallelrequests`` slot for ``state``'s settings until
        all end; the highest exit code."""
        codes: list[int] = []

        def serve(worker_id: int) -> None:
            codes.append(hosting.run_worker(
                state.settings, manners=manners, caps=caps, worker_id=worker_id, state=state
            ))

        threads = [
            threading.Thread(target=serve, args=(n,), name=f"horde-worker-{n}", daemon=True)
            for n in range(1, self.args.parallelrequests + 1)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.25)
        return max([state.exit_code, *codes])
