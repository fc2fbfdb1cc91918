"""The ``demo`` subcommand's run: its flags, the koboldcpp, the servers, the worker,
the cases sent one at a time, and the printed lines."""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from ..errors import ConfigError
from ..hosts.standalone import configure_logging, run_standalone
from ..hosts.standalone_flags import KCPP_URL_ENV, KCPP_URL_FLAG, FlagParser, resolve_url
from ..koboldcpp.client import KoboldClient
from ..settings import DEFAULT_KCPP_URL
from .cases import DemoCase, demo_cases
from .interrupt import raise_if_interrupted, sigint_handled
from .verdict import _result_lines, judge

DEMO_KEY = "demo-key-0000"
#: The logger the worker's lines reach (the package's), where :class:`FaultCauses` listens.
WORKER_LOGGER = __name__.partition(".")[0]

#: The demo's opening: what it shows, in three lines.
OPENING = (
    "This demo shows the worker serving an AI Horde: the queue where clients leave "
    "requests and workers take them.",
    "Each request becomes a job: the worker asks koboldcpp for the reply and submits it "
    "to the Horde, once.",
    "A job it cannot serve it faults, telling the Horde why. Each case below judges the "
    "worker; the model is noted apart.",
)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``koboldcpp-horde-chat demo``."""
    parser = FlagParser(
        prog="koboldcpp-horde-chat demo",
        description="Run the worker against a local dev Horde and a koboldcpp (yours when "
        "one answers, else a scripted one), send it requests as a client would, and judge "
        "what the worker did with each; what the model said is noted apart.",
    )
    parser.add_argument(
        "--kcpp-url",
        help=f"a running koboldcpp to use (default: KCPP_URL, else {DEFAULT_KCPP_URL}; "
        "when none answers at the default the scripted koboldcpp is used)",
    )
    parser.add_argument(
        "--scripted", action="store_true", help="use the scripted koboldcpp even if one runs"
    )
    parser.add_argument(
        "--kcpp-password", default=os.environ.get("KCPP_PASSWORD", ""),
        help="your koboldcpp's --password (or the KCPP_PASSWORD environment variable)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds to wait for every request to end, in all (default 300)",
    )
    parser.add_argument(
        "--log-level", default="WARNING", type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the worker's and the dev Horde's lines (default WARNING)",
    )
    return parser


#: The worker's line for a faulted job (``job=<id> kind=chat faulted (<reason>): <why>``).
FAULT_LINE = re.compile(r"job=(\S+) kind=\w+ faulted(?: \(\w+\))?: (.*)")


class FaultCauses(logging.Handler):
    """Why the worker faulted each job (``causes``: job id -> why), from its WARNING lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.causes: dict[str, str] = {}
        self.warnings = 0  # WARNING (and worse) lines, counted from each case's start

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings += 1
        match = FAULT_LINE.match(record.getMessage())
        if match:
            self.causes[match.group(1)] = match.group(2)


def _say(text: str) -> None:
    """Print a line at once, so the worker's log lines on stderr interleave in order."""
    print(text, flush=True)


def _wait(
    horde: Any, case: DemoCase, deadline: float, worker: threading.Thread, pops_seen: int
) -> str | None:
    """Wait for the case's request to end (None), until ``deadline`` (monotonic) or the
    worker stops (""), or until the Horde refused a reply of the request and the worker
    withdrew a feature the request needs: why the request is cancelled (it would wait,
    not be served)."""
    while True:
        raise_if_interrupted()
        left = deadline - time.monotonic()
        if horde.wait([case.request_id], timeout_s=max(0.0, min(left, 0.5))):
            return None
        refused = any(
            e["request_id"] == case.request_id and e.get("rc") for e in list(horde.ledger)
        )
        gone = _withdrawn(case, horde, pops_seen, "the request was cancelled") if refused else ""
        if left <= 0 or not worker.is_alive() or gone:
            return gone


def _withdrawn(case: DemoCase, horde: Any, pops_seen: int, outcome: str) -> str:
    """Why ``case`` is not served (ending in ``outcome``) when the worker's latest pop,
    after ``pops_seen`` pops, no longer declares a feature it needs; "" otherwise."""
    needed = case.features_needed
    if not needed or len(horde.pops) <= pops_seen:
        return ""
    body = horde.pops[-1]["body"]
    gone = [name for name in needed if name not in body.get("chat_features", [])]
    if not body.get("chat_jobs") or not gone:
        return ""
    return (
        f"model: the worker withdrew {', '.join(gone)} for a while after the Horde refused "
        f"the model's replies for it: {outcome}"
    )


#: The demo's last line after Ctrl-C (exit code 130, as a shell gives for SIGINT).
INTERRUPTED = "Demo stopped (Ctrl-C): the worker and the servers it started are stopped."


#: Seconds the demo waits for the worker's next pop to read what it declares now.
DECLARATION_WAIT_S = 5.0


def _withdrawn_skip(case: DemoCase, horde: Any, pops_seen: int) -> str:
    """Why a case is not sent, when the worker's next pop (within
    :data:`DECLARATION_WAIT_S`) no longer declares a feature it needs; "" to send it."""
    if not case.features_needed:
        return ""
    deadline = time.monotonic() + DECLARATION_WAIT_S
    while len(horde.pops) <= pops_seen and time.monotonic() < deadline:
        time.sleep(0.1)
    return _withdrawn(case, horde, pops_seen, "not sent")


def main(argv: Sequence[str] = ()) -> int:
    """Run the demo; 0 when every case passed, 1 when not, 2 when the koboldcpp named
    by ``--kcpp-url`` (or a bad ``KCPP_URL``) cannot be used, 130 after Ctrl-C."""
    args = build_parser().parse_args(list(argv))
    try:
        with sigint_handled(ignore=False):
            configure_logging(args.log_level)
            found = _find_koboldcpp(args)
            return 2 if found is None else _run(args, *found)
    except KeyboardInterrupt:
        _say(f"\n{INTERRUPTED}")
        return 130


def _find_koboldcpp(args: argparse.Namespace) -> tuple[str, bool] | None:
    """koboldcpp's URL and whether one answers there; None once the demo said why it
    cannot run."""
    try:
        kcpp_url = resolve_url(args.kcpp_url, KCPP_URL_FLAG, KCPP_URL_ENV, DEFAULT_KCPP_URL)
    except ConfigError as exc:
        print(f"{exc}. Fix it, or run the demo with --scripted.")
        return None
    if args.scripted:
        return kcpp_url, False
    real = KoboldClient(kcpp_url, args.kcpp_password, connect_timeout_s=2.0).ready()
    if not real and args.kcpp_url is not None:
        print(
            f"No koboldcpp answers at {kcpp_url}. Start it, or run the demo with "
            "--scripted to use the devkit's scripted koboldcpp."
        )
        return None
    return kcpp_url, real


def _worker_args(
    args: argparse.Namespace, horde_url: str, kcpp_url: str, journal: str
) -> list[str]:
    flags = {
        "--hordekey": DEMO_KEY,
        "--hordeworkername": "demo-worker",
        "--horde-url": horde_url,
        "--kcpp-url": kcpp_url,
        "--hordegenlen": "256",
        "--journal-dir": journal,
        "--log-level": args.log_level,
        "--kcpp-password": args.kcpp_password,  # only when given
    }
    return [word for flag, value in flags.items() if value for word in (flag, value)]


def _run(args: argparse.Namespace, kcpp_url: str, real: bool) -> int:
    """The demo with its parsed flags and koboldcpp (``real``: one answers there); a
    KeyboardInterrupt passes through once everything it started is stopped."""
    from ..devkit.horde import DevHorde
    from ..devkit.kcpp import ScriptedKoboldcpp

    fault_causes = FaultCauses()
    stop = threading.Event()
    result: dict[str, int] = {}
    started = ExitStack()  # what the demo started, stopped in reverse order
    try:
        journal = started.enter_context(
            tempfile.TemporaryDirectory(
                prefix="koboldcpp-horde-chat-demo-", ignore_cleanup_errors=True
            )
        )
        _say("\n".join(OPENING) + "\n")
        if real:
            _say(f"Using the koboldcpp at {kcpp_url}.")
        else:
            kcpp = started.enter_context(ScriptedKoboldcpp(token_delay_s=0.02, vision=True))
            why = "--scripted" if args.scripted else f"No koboldcpp answers at {kcpp_url}"
            kcpp_url = kcpp.url
            _say(
                f"{why}: using the devkit's SCRIPTED koboldcpp at {kcpp_url} "
                "(canned replies, real koboldcpp response shapes)."
            )
        # A trusted owner: a fast koboldcpp draws no suspicion line, which would be
        # about the dev Horde, not the worker or the model the demo judges.
        horde = DevHorde(api_keys=(DEMO_KEY,), trusted=True)
        started.callback(horde.stop)
        horde.start()
        _say(f"Dev Horde at {horde.url}")
        worker_args = _worker_args(args, horde.url, kcpp_url, journal)
        thread = threading.Thread(
            target=lambda: result.setdefault("code", run_standalone(worker_args, stop_event=stop)),
            name="demo-worker", daemon=True,
        )
        info = KoboldClient(kcpp_url, args.kcpp_password).info()
        cases = demo_cases(info.max_context_length, scripted=not real, vision=info.vision)
        rule = " and the scripted reply is as expected"
        if real:
            rule = '; what your model did not do ("model:") does not fail it'
        _say(f"Each case passes when the worker did right{rule}.")
        sent = sum(not case.skip for case in cases)
        _say(f"Starting the worker; {sent} requests follow, one at a time.\n")
        logging.getLogger(WORKER_LOGGER).addHandler(fault_causes)
        started.callback(logging.getLogger(WORKER_LOGGER).removeHandler, fault_causes)
        thread.start()
        started.callback(thread.join, timeout=10)
        started.callback(stop.set)
        deadline = time.monotonic() + args.timeout
        failed, notes = _run_cases(cases, horde, thread, fault_causes, deadline, not real)
        raise_if_interrupted()
        if not thread.is_alive() and "code" in result:
            _say(f"\nThe worker stopped with exit code {result['code']}; see its lines above.")
        return _summary(cases, horde, failed, notes, not real)
    finally:
        with sigint_handled(ignore=True):
            started.close()
            time.sleep(0)


def _run_cases(
    cases: list[DemoCase], horde: Any, worker: threading.Thread, fault_causes: FaultCauses,
    deadline: float, scripted: bool,
) -> tuple[list[str], int]:
    """Send the cases one at a time and print their lines; the failed cases' names
    and the count of model notes."""
    failed: list[str] = []
    notes = 0
    pops_seen = 0
    for case in cases:
        if not case.skip:
            raise_if_interrupted()
            fault_causes.warnings = 0  # what came before this case is not its
            case.skip = _withdrawn_skip(case, horde, pops_seen) if notes else ""
        if case.skip:
            _say(f"[skip] {case.name:<24} {case.skip}")
            continue
        if case.before:
            _say(f"       {case.before}")
        if case.kind == "text":
            case.request_id = horde.send_text(**case.body)  # prompt, max_length
        else:
            case.request_id = horde.send_chat(
                case.body, best_effort=True, max_attempts=case.max_attempts
            )
        gone = _wait(horde, case, deadline, worker, len(horde.pops))
        finished = gone is None
        pops_seen = len(horde.pops)
        if gone:
            horde.cancel(case.request_id)
            case.skip = gone
            _say(f"[skip] {case.name:<24} {case.skip}")
            notes += 1
            continue
        status = horde.status(case.request_id)
        ledger = [e for e in horde.ledger if e["request_id"] == case.request_id]
        models = {e["job_id"]: (horde.job(e["job_id"]) or {}).get("model") for e in ledger}
        verdict = judge(case, status, ledger, models, finished=finished, causes=fault_causes.causes)
        lines = _result_lines(case, status, verdict, fault_causes.warnings, scripted=scripted)
        _say("\n".join(lines))
        notes += len(verdict.model_notes)
        if not verdict.passed(scripted=scripted):
            failed.append(case.name)
    return failed, notes


def _summary(
    cases: list[DemoCase], horde: Any, failed: list[str], notes: int, scripted: bool
) -> int:
    """Print the dev Horde's ledger and the end line; the exit code."""
    _say("\nLedger (what the dev Horde recorded for each job):")
    for entry in horde.ledger:
        tail = "".join(f" ({entry[key]})" for key in ("fault_reason", "rc") if entry.get(key))
        _say(f"  job {entry['job_id']}: {entry['kind']} {entry['action']}{tail}")
    skipped = [c.name for c in cases if c.skip]
    extra = []
    if notes and not scripted:
        extra.append(
            f"{notes} model note{'s' if notes > 1 else ''}: what the model did, not the worker"
        )
    if skipped:
        extra.append(f"skipped: {', '.join(skipped)}")
    tail = f" ({'; '.join(extra)})" if extra else ""
    if failed:
        _say(f"\nDemo FAILED: {', '.join(failed)}.{tail}")
        return 1
    _say(f"\nDemo passed: the worker did right in all {len(cases) - len(skipped)} cases.{tail}")
    return 0
