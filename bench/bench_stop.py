"""The bounded stop: time from SIGTERM to the worker process's exit, in each phase of a job.

``python -m koboldcpp_horde_chat --stop-grace G`` against the dev Horde and the
scripted koboldcpp of this process; each round brings a job to one phase
(``--phases``, of those in ``PHASES``), sends SIGTERM and times the exit, and
tells what became of the job. Target, phases and method: bench/README.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import PKG_ROOT
from harness.devkit import DevHorde, ScriptedKoboldcpp, ScriptedReply
from harness.product import HordeClient, Journal, JournalEntry, journal_path
from harness.report import add_json, bench_result, figure, finish, parser, reproduce
from harness.servers import API_KEY
from harness.worker_process import POP, WorkerProcess, job_ids

WORKER_NAME = "bench-stop-worker"
#: Seconds past the grace the process may take to exit (the abort and one fault).
BOUND_EXTRA_S = 2.0
#: Tokens of a long generation; the token delay makes it last grace + LONG_EXTRA_S.
LONG_TOKENS = 300
LONG_EXTRA_S = 5.0
#: Seconds a phase may take to be reached after the worker starts.
READY_TIMEOUT_S = 30.0
#: Seconds past the bound this bench waits for an exit before it kills the worker.
EXIT_TIMEOUT_EXTRA_S = 15.0
FINAL = ("submitted", "faulted", "cancelled", "expired")


def until(condition: Callable[[], bool], why: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {why}")
        time.sleep(0.02)


def long_reply(kcpp: ScriptedKoboldcpp, grace: float) -> None:
    """Every generation lasts ``grace`` + LONG_EXTRA_S seconds (LONG_TOKENS tokens)."""
    kcpp.token_delay_s = (grace + LONG_EXTRA_S) / LONG_TOKENS
    kcpp.script(lambda body: ScriptedReply(text="sky " * LONG_TOKENS))


def ask(text: str, *, stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "stream": stream}


# --- the phases: each queues its jobs and injects its faults (before the worker starts),
# then waits until the job is in that phase. Returns the requests whose job is reported.


@dataclass(frozen=True)
class Phase:
    """One phase a job can be in at the signal."""

    name: str
    label: str
    prepare: Callable[[DevHorde, ScriptedKoboldcpp, float], list[str]]
    reached: Callable[[DevHorde, ScriptedKoboldcpp, WorkerProcess, list[str]], None]
    worker_args: tuple[str, ...] = ()
    horde_options: dict[str, Any] = field(default_factory=dict)
    reported_from: int = 0  # the table reports the jobs of the requests from this index on
    #: Writes the journal an earlier process left (the journal directory), before the start.
    journal: Callable[[DevHorde, Path, float], list[str]] | None = None


def _prep_pop_beside(
    late: Callable[[float], str],
) -> Callable[[DevHorde, ScriptedKoboldcpp, float], list[str]]:
    """Two requests; the pop beside the first job's submit answers ``late(grace)``."""

    def prep(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
        long_reply(kcpp, grace)  # the first job: 40 tokens; the late one: long
        kcpp.script(
            lambda body: ScriptedReply(
                text="sky " * (40 if "first" in json.dumps(body) else LONG_TOKENS)
            )
        )
        first = horde.send_chat(ask("first"), best_effort=True)
        second = horde.send_chat(ask("second"), best_effort=True)
        horde.inject("pop", "ok", late(grace))
        return [first, second]

    return prep


def _reached_pop(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    def first_submitted() -> bool:
        ids = job_ids(horde, rids[0])
        return bool(ids) and any(
            e["job_id"] == ids[0] and e["action"] == "submitted" for e in horde.ledger
        )

    until(first_submitted, "the first job's submit")


def _prep_one(stream: bool = False) -> Callable[[DevHorde, ScriptedKoboldcpp, float], list[str]]:
    def prep(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
        long_reply(kcpp, grace)
        return [horde.send_chat(ask("Tell me about the sky.", stream=stream), best_effort=True)]

    return prep


def _prep_fetch(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    rids = _prep_one()(horde, kcpp, grace)
    horde.inject("storage", f"hang:{grace + 30:g}")
    return rids


def _prep_tokencount(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    rids = _prep_one()(horde, kcpp, grace)
    kcpp.inject("tokencount", f"hang:{grace + 30:g}")
    return rids


def _reached_popped(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    until(lambda: all(job_ids(horde, r) for r in rids), "the job's pop")
    time.sleep(0.3)  # the step is under way


def _reached_generating(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    until(lambda: all(job_ids(horde, r) for r in rids) and kcpp.generating, "the generation")
    time.sleep(0.3)


def _prep_batched(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    long_reply(kcpp, grace)
    return [
        horde.send_chat(ask("Tell me about the sky."), best_effort=True),
        horde.send_chat(ask("Tell me about the sea."), best_effort=True),
    ]


def _prep_submit(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    kcpp.token_delay_s = 0.005
    kcpp.script(lambda body: ScriptedReply(text="sky " * 20))
    rid = horde.send_chat(ask("Tell me about the sky."), best_effort=True)
    down = (503, {"message": "down", "rc": "Unavailable"}, {"Retry-After": "2"})
    horde.inject("submit", *([down] * 20))
    return [rid]


def _reached_submit(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    until(lambda: worker.said("submit failed"), "a failed submit")
    time.sleep(0.3)  # its retry waits


def _prep_own_pop(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    rids = _prep_one()(horde, kcpp, grace)
    horde.inject("pop", f"late:{grace + 30:g}")  # the job is assigned; its answer is late
    return rids


def _prep_submit_late(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    kcpp.token_delay_s = 0.005
    kcpp.script(lambda body: ScriptedReply(text="sky " * 20))
    rid = horde.send_chat(ask("Tell me about the sky."), best_effort=True)
    horde.inject("submit", f"late:{grace + 30:g}")  # accepted at once, answered late
    return [rid]


def _reached_submit_sent(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    def settled() -> bool:
        ids = job_ids(horde, rids[0])
        return bool(ids) and any(
            e["job_id"] == ids[0] and e["action"] in FINAL for e in horde.ledger
        )

    until(settled, "the submit's arrival")
    time.sleep(0.3)


def _prep_progress(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    rids = _prep_one(stream=True)(horde, kcpp, grace)
    horde.inject("progress", *[f"hang:{grace + 30:g}"] * 5)  # no post is answered in time
    return rids


def _reached_progress(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    until(
        lambda: any(r["path"].endswith("/progress") for r in horde.requests_log),
        "the first progress post",
    )
    time.sleep(0.3)


def _prep_retry_after(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    kcpp.token_delay_s = 0.005
    kcpp.script(lambda body: ScriptedReply(text="sky " * 20))
    rid = horde.send_chat(ask("Tell me about the sky."), best_effort=True)
    down = (503, {"message": "down", "rc": "Unavailable"}, {"Retry-After": f"{grace + 5:g}"})
    horde.inject("submit", down)  # once: the retry would be accepted
    return [rid]


def _journal_left(horde: DevHorde, journal_dir: Path, grace: float) -> list[str]:
    """Two chat jobs an earlier process of this worker popped and left in the journal
    (one with its reply kept, one without a terminal action); the Horde answers
    their submits 503 with a Retry-After past the stop; koboldcpp takes the
    connection and answers late (it loads). Returns their requests."""
    rids, ids = [], []
    with HordeClient(horde.url, API_KEY, bridge_agent=str(POP["bridge_agent"])) as client:
        for text in ("first", "second"):
            rids.append(horde.send_chat(ask(text)))
            ids.append(str(client.pop(POP | {"name": WORKER_NAME}, timeout_s=5)["id"]))
    journal = Journal(journal_path(WORKER_NAME, journal_dir))
    for job_id in ids:
        journal.add(JournalEntry(job_id, "chat", str(POP["model_id"]), "", time.time() + 150))
    reply = {"id": ids[0], "message": {"role": "assistant", "content": "Blue."},
             "finish_reason": "stop", "model_id": POP["model_id"], "state": "ok"}
    journal.keep_reply(ids[0], reply)
    down = (503, {"message": "down", "rc": "Unavailable"}, {"Retry-After": f"{grace + 30:g}"})
    horde.inject("submit", *([down] * 4))
    return rids


def _prep_loading(horde: DevHorde, kcpp: ScriptedKoboldcpp, grace: float) -> list[str]:
    kcpp.inject("model", f"hang:{grace + 30:g}")
    return []


def _reached_recovery(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    until(
        lambda: sum(r["path"].endswith("/submit") for r in horde.requests_log) >= 2,
        "the recovery's first submits",
    )
    time.sleep(0.3)


def _reached_idle(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, rids: list[str]
) -> None:
    until(lambda: len(horde.pops) >= 2, "two empty pops")
    time.sleep(0.3)


PHASES: tuple[Phase, ...] = (
    # the pop beside the first submit answers 1.2 s late (hang: the job is assigned then)
    Phase("pop", "pop beside the submit in flight",
          _prep_pop_beside(lambda g: "hang:1.2"), _reached_pop,
          reported_from=1),
    Phase("fetch", "messages fetch", _prep_fetch, _reached_popped,
          horde_options={"offload_bytes": 0}),
    Phase("tokencount", "token count", _prep_tokencount, _reached_popped),
    Phase("streamed", "streamed generation", _prep_one(stream=True), _reached_generating),
    Phase("nonstreamed", "non-streamed generation", _prep_one(), _reached_generating),
    Phase("batched", "batched generation (2 slots)", _prep_batched, _reached_generating,
          worker_args=("--parallelrequests", "2")),
    Phase("submit", "submit being retried (503)", _prep_submit, _reached_submit),
    Phase("idle", "idle (between pops)", lambda h, k, g: [], _reached_idle),
    Phase("ownpop", "the loop's own pop (answer late)", _prep_own_pop, _reached_popped),
    Phase("poplate", "pop beside submit (answer late)",
          _prep_pop_beside(lambda g: f"late:{g + 30:g}"), _reached_pop,
          reported_from=1),
    Phase("submitlate", "submit sent (answer late)", _prep_submit_late, _reached_submit_sent),
    Phase("progress", "progress posts unanswered", _prep_progress, _reached_progress),
    Phase("retryafter", "submit after 503 Retry-After G+5", _prep_retry_after,
          _reached_submit),
    Phase("startup", "recovery at start (503, loading)", _prep_loading, _reached_recovery,
          journal=_journal_left),
)
QUICK_PHASES = ("pop", "tokencount", "streamed", "idle")


#: What the worker logs when it exits with a pop unanswered (a job may come to nobody).
POP_LEFT_LINE = "may be assigned to this stopped worker"


def terminal_action(horde: DevHorde, rid: str, journaled: set[str], said_lost: bool) -> str:
    """What became of the request's job: its ledger action, else whether the journal
    kept it, else whether the worker said it left a pop unanswered."""
    ids = job_ids(horde, rid)
    if not ids:
        return "not popped"
    job_id = ids[-1]
    actions = [e["action"] for e in horde.ledger if e["job_id"] == job_id and e["action"] in FINAL]
    if actions:
        return "+".join(actions)
    if job_id in journaled:
        return "left in the journal"
    return "left to expire, said so" if said_lost else "lost"


def _jobs_line(actions: list[str]) -> str:
    """``"faulted"``, ``"faulted x2"``, ``"faulted, submitted"``: one round's jobs."""
    counts = Counter(actions)
    return ", ".join(a if n == 1 else f"{a} x{n}" for a, n in sorted(counts.items()))


def one_round(phase: Phase, grace: float, workdir: Path) -> dict[str, Any]:
    """Bring a fresh worker's job to ``phase``, send SIGTERM, time the exit."""
    horde = DevHorde(api_keys=(API_KEY,), **phase.horde_options)
    kcpp = ScriptedKoboldcpp(max_context_length=4096)
    horde.start()
    kcpp.start()
    journal_dir = Path(tempfile.mkdtemp(prefix=f"{phase.name}-", dir=workdir))
    try:
        rids = phase.journal(horde, journal_dir, grace) if phase.journal is not None else []
        rids += phase.prepare(horde, kcpp, grace)
        worker = WorkerProcess(
            horde, kcpp, journal_dir, "--stop-grace", f"{grace:g}", *phase.worker_args,
            key=API_KEY, name=WORKER_NAME, cwd=PKG_ROOT,
        )
        try:
            try:
                phase.reached(horde, kcpp, worker, rids)
            except RuntimeError as exc:
                raise RuntimeError(f"{phase.name}: {exc}\n{worker.log()}") from None
            took = worker.sigterm_to_exit(grace + BOUND_EXTRA_S + EXIT_TIMEOUT_EXTRA_S)
        finally:
            worker.stop()
        path = journal_path(WORKER_NAME, journal_dir)
        journaled = (
            {e["job_id"] for e in json.loads(path.read_text())["jobs"]} if path.exists() else set()
        )
        said_lost = bool(worker.said(POP_LEFT_LINE))
        actions = [
            terminal_action(horde, rid, journaled, said_lost)
            for rid in rids[phase.reported_from :]
        ]
        return {
            "seconds": took,
            "actions": actions or ["no job"],
            "exit_code": worker.proc.returncode,
        }
    finally:
        kcpp.stop()
        horde.stop()


def run(*, grace: float, rounds: int, phases: Sequence[Phase], quick: bool) -> dict[str, Any]:
    """Run ``rounds`` rounds of each phase; the result dict with the figures and the table."""
    bound = grace + BOUND_EXTRA_S
    figures: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as tmp:
        for phase in phases:
            results = [one_round(phase, grace, Path(tmp)) for _ in range(rounds)]
            times = [r["seconds"] for r in results if r["seconds"] is not None]
            killed = sum(r["seconds"] is None for r in results)
            actions = sorted({_jobs_line(r["actions"]) for r in results})
            row = {
                "phase": phase.name,
                "label": phase.label,
                "grace_s": grace,
                "median_s": statistics.median(times) if times else float("nan"),
                "max_s": max(times) if times else float("nan"),
                "bound_s": bound,
                "killed": killed,
                "actions": actions,
                "exit_codes": sorted({r["exit_code"] for r in results}),
                "values": times,
            }
            rows.append(row)
            fig = figure(f"SIGTERM -> exit, {phase.label}", "s", times, limit=bound)
            fig["met"] = bool(times) and not killed and max(times) <= bound
            fig["target"] = f"<= {bound:g} s every round"
            figures.append(fig)
    if quick:
        command = reproduce("bench_stop.py", f"--quick --grace {grace:g}")
    else:
        command = reproduce(
            "bench_stop.py",
            f"--grace {grace:g} --rounds {rounds} --phases {','.join(p.name for p in phases)}",
        )
    return bench_result(
        "stop",
        f"SIGTERM to exit of the standalone worker, by phase (--stop-grace {grace:g})",
        command,
        figures,
        [
            f"{rounds} round(s) per phase; bound = grace + {BOUND_EXTRA_S:g} s; a generation "
            f"lasts grace + {LONG_EXTRA_S:g} s",
        ],
        rows=rows,
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"  {'phase':<34} {'grace':>5} {'median':>7} {'max':>7} {'bound':>6}  "
        "job in hand at the signal"
    )
    for r in rows:
        killed = f" ({r['killed']} killed)" if r["killed"] else ""
        print(
            f"  {r['label']:<34} {r['grace_s']:>4g}s {r['median_s']:>6.2f}s {r['max_s']:>6.2f}s "
            f"{r['bound_s']:>5g}s  {' / '.join(r['actions'])}{killed}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--grace", type=float, default=1.0, help="--stop-grace, seconds (default 1)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per phase (default 3)")
    ap.add_argument(
        "--phases", default="", help=f"comma-separated, of {','.join(p.name for p in PHASES)}"
    )
    ap.add_argument("--quick", action="store_true", help=f"1 round of {','.join(QUICK_PHASES)}")
    add_json(ap)
    args = ap.parse_args(argv)
    by_name = {p.name: p for p in PHASES}
    names = [n for n in args.phases.split(",") if n] or (
        list(QUICK_PHASES) if args.quick else list(by_name)
    )
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; known: {list(by_name)}")
    rounds = args.rounds or (1 if args.quick else 3)
    quick = args.quick and not args.phases and args.rounds is None
    result = run(
        grace=args.grace, rounds=rounds, phases=[by_name[n] for n in names], quick=quick
    )
    print_table(result["rows"])
    return finish(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
