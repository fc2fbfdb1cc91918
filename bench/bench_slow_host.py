"""A slow host: the worker's declared limits, jobs served and lost, on a real koboldcpp with one thread.

A real koboldcpp (``KCPP_DIR``, ``KCPP_MODEL``; ``--threads 1 --contextsize
4096``), the dev Horde in this process (the real Horde's 150 s lease by
default, ``--ttl``) and the standalone worker as a process (``python -m
koboldcpp_horde_chat --hordegenlen 256``). For ``--minutes`` the bench keeps
``--queue`` text requests open at the dev Horde, each with
``max_context_length`` 4096 and a ``max_length`` of 64 to 128: one long prompt
(about 2,400 tokens of varied English) in every ``--long-every``, the others a
sentence. Then it cancels the requests still waiting, waits up to ``--drain``
s (a lease) for the jobs in hand, stops the worker and prints, per kind (long,
short): requests sent, served, jobs lost (faulted, expired; faults at the
worker's stop apart), requests never popped, the wait from a request's
sending to its pop, and why the pops passed requests over; how long the
declared context stayed below the requests'; the limits the
worker declared over time (from its pops' bodies); the worker's log lines
about its limits, withdrawals and probes; the command to reproduce. Without a
built koboldcpp and a model it says it was skipped and why. Method:
bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import PKG_ROOT
from harness.devkit import DevHorde, Response
from harness.real_kcpp import KoboldcppProcess, find_koboldcpp, stop_all, stop_on_sigterm
from harness.report import (
    add_json,
    bench_result,
    figure,
    machine_line,
    parser,
    reproduce,
    skipped,
    write_json,
)

API_KEY = "bench-slowhost-key-0123456789"
WORKER_NAME = "bench-slow-host"
CONTEXT = 4096
LONG, SHORT = "long", "short"
#: Words of the worker's log lines shown in the report (its limits, withdrawals, probes).
LIMIT_WORDS = (
    "max_length", "max_context_length", "withdraw", "probe", "measure", "lease",
    "declar", "maintenance", "expire", "fault", "slow", "hung",
)

SENTENCES = (
    "The harbour town woke slowly, its fishing boats rocking against the weathered pier.",
    "Merchants argued over the price of salt while gulls circled above the market square.",
    "A young cartographer spent the winter copying coastlines from a captain's faded journal.",
    "Rain had softened the mountain road, and the mule carts sank to their axles in the mud.",
    "In the library, an old clock ticked louder than the whispers of the students.",
    "The engineer insisted that the bridge could carry twice its load, though nobody believed her.",
    "Every autumn the villagers gathered apples, pressed cider and told the same ghost stories.",
    "The telescope on the hill had not been used since the astronomer left for the capital.",
    "A letter arrived with no return address, sealed with green wax and smelling of pine.",
    "Farmers watched the sky anxiously, for the harvest depended on three more dry weeks.",
    "The orchestra rehearsed in a drafty hall, the violins drifting out of tune with the cold.",
    "Children raced paper boats down the gutter after the storm, cheering each small victory.",
    "The physician kept careful notes on every patient, hoping to understand the strange fever.",
    "At the edge of the forest stood a mill whose wheel had turned for more than two centuries.",
    "The council debated late into the night about whether to build a new school or a granary.",
    "A travelling painter offered portraits in exchange for a meal and a dry place to sleep.",
    "Snow covered the railway tracks, and the evening train arrived four hours behind schedule.",
    "The baker rose before dawn, kneading dough while the rest of the street still slept.",
    "Sailors returning from the south spoke of islands where the birds had never seen a person.",
    "The museum's newest exhibit, a collection of antique maps, drew crowds from distant cities.",
    "She learned to repair clocks from her grandfather, who never let a spring go to waste.",
    "The river flooded its banks in spring, leaving behind fertile silt and ruined fences.",
    "A quiet monastery on the cliff brewed honey beer and sold it to passing pilgrims.",
    "The mathematician scribbled equations on the café window until the owner asked him to stop.",
    "Lanterns swung in the wind as the festival procession wound through the narrow lanes.",
    "Traders from the east brought silk, spices and stories that nobody could quite verify.",
    "The lighthouse keeper logged every passing ship, even in the thickest fog of November.",
    "An apprentice blacksmith burned his hand on the first day and never forgot the lesson.",
    "The garden behind the inn grew herbs that the cook used in a famously fragrant stew.",
    "Scholars disagreed about the age of the ruins, some claiming they predated the kingdom.",
    "A stray dog followed the postman on his rounds until the whole village knew it by name.",
    "The weaver's loom clattered all afternoon, turning dyed wool into blankets for the winter.",
    "When the well ran dry, the town dug a new one deeper than any before it.",
    "The schoolteacher taught geography with a globe whose colours had long since faded.",
    "Fishermen mended their nets on the beach, trading jokes and complaints about the weather.",
    "An inventor demonstrated a flying machine that rose six feet before landing in a pond.",
    "The queen's messenger rode through the night, changing horses at every second village.",
    "Across the valley, the bells of three churches rang at slightly different times.",
    "The potter's wheel spun steadily as she shaped bowls for the coming market day.",
    "A comet appeared in the western sky, and for a week nobody talked of anything else.",
)
QUESTIONS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours of the rainbow.",
    "Say hello to a friend in one short line.",
    "What do bees make?",
    "Give me a word that rhymes with cat.",
    "Describe a cloud in a few words.",
    "What season comes after winter?",
)


def long_prompt(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of varied English (about 4 per token), then a task."""
    parts: list[str] = []
    size = 0
    while size < chars:
        s = rng.choice(SENTENCES)
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts) + "\n\nSummarise the text above in two sentences.\n"


def short_prompt(rng: random.Random) -> str:
    return rng.choice(QUESTIONS) + "\n"


class SlowHostHorde(DevHorde):
    """The dev Horde noting each pop's declaration and answer, and each submit, with
    when it arrived (monotonic seconds)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pop_notes: list[dict[str, Any]] = []
        self.submit_notes: list[dict[str, Any]] = []
        self._notes_lock = threading.Lock()

    def _pop(self, body: dict[str, Any], key: str) -> Response:
        at = time.monotonic()
        resp = super()._pop(body, key)
        try:
            answer = json.loads(resp.body) if resp.body else None
        except ValueError:
            answer = None
        with self._notes_lock:
            self.pop_notes.append({"at": at, "body": body, "status": resp.status, "answer": answer})
        return resp

    def _submit(self, body: dict[str, Any], key: str) -> Response:
        at = time.monotonic()
        resp = super()._submit(body, key)
        with self._notes_lock:
            self.submit_notes.append(
                {"at": at, "id": body.get("id"), "state": body.get("state"), "status": resp.status}
            )
        return resp


def declaration(body: dict[str, Any]) -> tuple[Any, ...]:
    """The limits a pop declares: text max_length and max_context_length, chat's, and
    which kinds it pops for."""
    chat = body.get("chat_limits") or {}
    return (
        body.get("max_length"),
        body.get("max_context_length"),
        chat.get("max_length") if body.get("chat_jobs") else None,
        chat.get("max_context_length") if body.get("chat_jobs") else None,
        body.get("prompt_jobs", True),
        bool(body.get("chat_jobs")),
    )


def show_declaration(d: tuple[Any, ...]) -> str:
    text = f"text max_length {d[0]}, max_context_length {d[1]}"
    if d[5]:
        text += f"; chat max_length {d[2]}, max_context_length {d[3]}"
    if d[4] is False:
        text += " (prompt_jobs false: no text jobs)"
    return text


class WorkerLog:
    """The worker process's stderr, each line with its second since ``t0``, also
    written to ``path``."""

    def __init__(self, proc: subprocess.Popen[str], t0: float, path: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._proc = proc
        self._t0 = t0
        self._file = open(path, "w")  # noqa: SIM115 - closed by the reader thread
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stderr is not None
        for raw in self._proc.stderr:
            line = raw.rstrip("\n")
            t = time.monotonic() - self._t0
            self.lines.append((t, line))
            self._file.write(f"{t:8.1f} {line}\n")
            self._file.flush()
        self._file.close()

    def join(self) -> None:
        self._thread.join(5)


def start_worker(horde_url: str, kcpp_url: str, genlen: int, work: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PKG_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [
            sys.executable, "-m", "koboldcpp_horde_chat",
            "--hordekey", API_KEY,
            "--hordeworkername", WORKER_NAME,
            "--horde-url", horde_url,
            "--kcpp-url", kcpp_url,
            "--hordegenlen", str(genlen),
            "--journal-dir", str(work / "journal"),
            "--log-level", "INFO",
        ],
        cwd=str(PKG_ROOT),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _command(args: argparse.Namespace) -> str:
    return reproduce(
        "bench_slow_host.py",
        f"--minutes {args.minutes:g}",
        f"--queue {args.queue}",
        f"--long-every {args.long_every}",
        f"--genlen {args.genlen}",
        f"--ttl {args.ttl:g}",
        f"--drain {args.drain:g}",
        env=("KCPP_DIR", "KCPP_MODEL"),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    title = "a slow host: declared limits, jobs served and lost (real koboldcpp, 1 thread)"
    command = _command(args)
    kdir, model, why = find_koboldcpp()
    if kdir is None or model is None:
        return skipped("slow_host", title, command, why)
    work = Path(tempfile.mkdtemp(prefix="bench_slow_host_"))
    rng = random.Random(args.seed)
    result = bench_result("slow_host", title, command, [], [])
    result["config"] = {
        "minutes": args.minutes, "queue": args.queue, "long_every": args.long_every,
        "genlen": args.genlen, "ttl_s": args.ttl, "context": CONTEXT, "model": str(model),
        "long_chars": args.long_chars,
    }
    kcpp = KoboldcppProcess(
        kdir, "koboldcpp.py", model, work / "koboldcpp.log",
        extra_args=["--contextsize", str(CONTEXT)],  # after the default 2048: the last one counts
    )
    horde = SlowHostHorde(api_keys=(API_KEY,), ttl_s=args.ttl)
    proc: subprocess.Popen[str] | None = None
    wlog: WorkerLog | None = None
    sent: dict[str, dict[str, Any]] = {}  # request id -> {"kind", "at", "max_length"}
    waiting_at_end: set[str] = set()  # waiting when the sending time ended (then cancelled)
    t0 = time.monotonic()
    try:
        with kcpp:
            ready_s = time.monotonic() - t0
            print(f"koboldcpp ready after {ready_s:.1f} s on {kcpp.url}; logs in {work}", flush=True)
            horde.start()
            t0 = time.monotonic()
            proc = start_worker(horde.url, kcpp.url, args.genlen, work)
            wlog = WorkerLog(proc, t0, work / "worker.log")
            deadline = time.monotonic() + 120
            while not horde.pop_notes:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker never popped; see " + str(work / "worker.log"))
                time.sleep(0.2)
            first_pop_s = horde.pop_notes[0]["at"] - t0
            print(f"worker's first pop {first_pop_s:.1f} s after its start; sending for "
                  f"{args.minutes:g} min", flush=True)
            t_send = time.monotonic()
            end_send = t_send + args.minutes * 60
            n = 0
            next_print = t_send + 30
            while time.monotonic() < end_send:
                open_ids = [
                    r for r in sent if horde.status(r)["state"] in ("waiting", "processing")
                ]
                while len(open_ids) < args.queue:
                    kind = LONG if n % args.long_every == 0 else SHORT
                    prompt = long_prompt(rng, args.long_chars) if kind == LONG else short_prompt(rng)
                    max_length = rng.randint(64, 128)
                    rid = horde.send_text(
                        prompt, max_length=max_length, max_context_length=CONTEXT,
                        params={"temperature": 0.7}, max_attempts=3,
                    )
                    sent[rid] = {"kind": kind, "at": time.monotonic() - t0, "max_length": max_length}
                    open_ids.append(rid)
                    n += 1
                if time.monotonic() >= next_print:
                    done = sum(horde.status(r)["state"] == "done" for r in sent)
                    last = horde.pop_notes[-1]["body"]
                    print(f"  {time.monotonic() - t_send:5.0f} s: sent {len(sent)}, served {done}; "
                          f"declared {show_declaration(declaration(last))}", flush=True)
                    next_print += 30
                time.sleep(0.5)
            # The requests still waiting are cancelled (none is popped after the sending
            # time); the jobs in hand get up to --drain s to end, so the worker's stop
            # does not fault them.
            t_stop_send = time.monotonic()
            for rid in sent:
                if horde.status(rid)["state"] == "waiting":
                    waiting_at_end.add(rid)
                    horde.cancel(rid)
            drain_end = time.monotonic() + args.drain
            while time.monotonic() < drain_end:
                if not any(horde.status(r)["state"] == "processing" for r in sent):
                    break
                time.sleep(0.5)
            t_end = time.monotonic()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            wlog.join()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        stop_all()
        horde.stop()
    result["logs"] = str(work)
    summarise(result, horde, sent, waiting_at_end, wlog, t0, t_send, t_stop_send, t_end)
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["ready_s"] = round(ready_s, 1)
    result["first_pop_s"] = round(first_pop_s, 1)
    if args.keep_logs is False:
        shutil.rmtree(work / "journal", ignore_errors=True)
    return result


def summarise(
    result: dict[str, Any],
    horde: SlowHostHorde,
    sent: dict[str, dict[str, Any]],
    waiting_at_end: set[str],
    wlog: WorkerLog | None,
    t0: float,
    t_send: float,
    t_stop_send: float,
    t_end: float,
) -> None:
    ledger = horde.ledger
    pops = list(horde.pop_notes)
    submits = {s["id"]: s for s in horde.submit_notes}
    job_popped: dict[str, float] = {}
    for p in pops:
        ans = p["answer"] or {}
        if ans.get("id"):
            job_popped[ans["id"]] = p["at"]
    per: dict[str, dict[str, Any]] = {
        k: {"sent": 0, "served": 0, "faulted_jobs": 0, "expired_jobs": 0, "failed_requests": 0,
            "never_popped": 0, "waiting_again_at_end": 0, "in_hand_at_end": 0,
            "faulted_at_stop": 0, "job_s": [], "wait_s": []}
        for k in (LONG, SHORT)
    }
    job_kind: dict[str, str] = {}
    for rid, info in sent.items():
        st = horde.status(rid)
        row = per[info["kind"]]
        row["sent"] += 1
        for jid in st["job_ids"]:
            job_kind[jid] = info["kind"]
        if st["job_ids"] and st["job_ids"][0] in job_popped:
            row["wait_s"].append(job_popped[st["job_ids"][0]] - t0 - info["at"])
        elif rid in waiting_at_end:
            row["wait_s"].append(t_stop_send - t0 - info["at"])  # never popped: at least this
        if st["state"] == "done":
            row["served"] += 1
        elif st["state"] == "faulted":
            row["failed_requests"] += 1
        elif rid in waiting_at_end:
            row["never_popped" if not st["job_ids"] else "waiting_again_at_end"] += 1
        elif st["state"] == "processing":
            row["in_hand_at_end"] += 1
    fault_reasons: dict[str, int] = {}
    for entry in ledger:
        kind = job_kind.get(entry["job_id"])
        if kind is None:
            continue
        if entry["action"] == "faulted":
            per[kind]["faulted_jobs"] += 1
            sub = submits.get(entry["job_id"])
            if sub is not None and sub["at"] >= t_end:
                per[kind]["faulted_at_stop"] += 1
            reason = str(entry.get("fault_reason"))
            fault_reasons[reason] = fault_reasons.get(reason, 0) + 1
        elif entry["action"] == "expired":
            per[kind]["expired_jobs"] += 1
        elif entry["action"] == "submitted" and entry["job_id"] in job_popped:
            sub = submits.get(entry["job_id"])
            if sub is not None:
                per[kind]["job_s"].append(sub["at"] - job_popped[entry["job_id"]])
    table = [
        "  kind   sent  served  faulted jobs  expired jobs  requests failed  never popped  "
        "in hand at end   pop->submit s (min/median/max)   sent->popped s (median/max)"
    ]
    for kind in (LONG, SHORT):
        r = per[kind]
        js = r["job_s"]
        times = (
            f"{min(js):.0f} / {statistics.median(js):.0f} / {max(js):.0f}" if js else "n/a"
        )
        ws = r["wait_s"]
        waits = f"{statistics.median(ws):.0f} / {max(ws):.0f}" if ws else "n/a"
        table.append(
            f"  {kind:<6} {r['sent']:>4}  {r['served']:>6}  {r['faulted_jobs']:>12}  "
            f"{r['expired_jobs']:>12}  {r['failed_requests']:>15}  "
            f"{r['never_popped']:>12}  {r['in_hand_at_end']:>14}   {times:<30}   {waits}"
        )
    result["table"] = table
    result["per_kind"] = {
        k: {**v, "job_s": [round(x, 1) for x in v["job_s"]], "wait_s": [round(x, 1) for x in v["wait_s"]]}
        for k, v in per.items()
    }
    result["fault_reasons"] = fault_reasons
    figures = []
    for kind in (LONG, SHORT):
        if per[kind]["job_s"]:
            figures.append(figure(f"{kind} job, pop -> submit", "s", per[kind]["job_s"]))
    result["figures"] = figures
    # Declared limits over time, from the pops' bodies.
    changes: list[tuple[float, tuple[Any, ...]]] = []
    for p in pops:
        d = declaration(p["body"])
        if not changes or changes[-1][1] != d:
            changes.append((p["at"] - t0, d))
    # How long the text context declared stayed below what the requests ask for
    # (the Horde then passes every one of them over, short or long).
    below = 0.0
    for (t, d), nxt in zip(changes, [*changes[1:], (t_end - t0, None)], strict=True):
        if isinstance(d[1], int) and d[1] < CONTEXT:
            below += nxt[0] - t
    result["below_context_s"] = round(below, 1)
    result["declarations"] = [
        {"at_s": round(t, 1), "limits": show_declaration(d)} for t, d in changes
    ]
    # Pop gaps (the worker not popping: withdrawn, probing, busy) over 10 s.
    gaps = []
    for a, b in zip(pops, pops[1:], strict=False):
        busy = (a["answer"] or {}).get("id")
        if not busy and b["at"] - a["at"] > 10:
            gaps.append((round(a["at"] - t0, 1), round(b["at"] - a["at"], 1)))
    result["idle_pop_gaps"] = gaps
    skipped_by: dict[str, int] = {}
    skip_pops = 0
    for p in pops:
        sk = (p["answer"] or {}).get("skipped") or {}
        if sk:
            skip_pops += 1
        for reason, count in sk.items():
            skipped_by[reason] = skipped_by.get(reason, 0) + count
    result["pops"] = {
        "total": len(pops),
        "with_job": sum(1 for p in pops if (p["answer"] or {}).get("id")),
        "passing_requests_over": skip_pops,
        "skipped_by_reason": skipped_by,
    }
    lines = []
    if wlog is not None:
        lines = [
            f"{t:7.1f} s {line}"
            for t, line in wlog.lines
            if any(w in line for w in LIMIT_WORDS)
        ]
    result["worker_lines"] = lines
    result["window_s"] = {
        "send_start": round(t_send - t0, 1),
        "send_end": round(t_stop_send - t0, 1),
        "end": round(t_end - t0, 1),
    }


def print_report(result: dict[str, Any]) -> None:
    print(f"== slow_host: {result['title']}")
    print("  " + machine_line(result["machine"]))
    if result.get("skipped"):
        print(f"  skipped: {result['skipped']}")
        print(f"  reproduce: {result['command']}")
        return
    cfg = result["config"]
    print(
        f"  koboldcpp --threads 1 --contextsize {cfg['context']}, {Path(cfg['model']).name}; "
        f"worker --hordegenlen {cfg['genlen']}; lease (ttl) {cfg['ttl_s']:g} s; "
        f"requests: max_context_length {cfg['context']}, max_length 64-128, one long "
        f"(~{cfg['long_chars']} chars) in {cfg['long_every']}, {cfg['queue']} open at a time"
    )
    w = result["window_s"]
    print(
        f"  koboldcpp ready {result['ready_s']} s; worker's first pop {result['first_pop_s']} s; "
        f"sending from {w['send_start']} s to {w['send_end']} s, the jobs in hand ended by "
        f"{w['end']} s (times since the worker's start)"
    )
    for line in result["table"]:
        print(line)
    for kind, r in result["per_kind"].items():
        if r["faulted_at_stop"] or r["waiting_again_at_end"]:
            print(
                f"  {kind}: {r['faulted_at_stop']} job(s) faulted at the worker's stop (still in hand "
                f"after the drain), {r['waiting_again_at_end']} request(s) waiting again at the end "
                "(after a lost job)"
            )
    print(
        "  never popped: still waiting when the sending time ended (then cancelled); "
        "sent->popped counts them until then"
    )
    if result["fault_reasons"]:
        print(f"  fault reasons: {result['fault_reasons']}")
    p = result["pops"]
    print(
        f"  pops: {p['total']}, {p['with_job']} with a job; {p['passing_requests_over']} passed "
        f"requests over, by reason (summed over pops): {p['skipped_by_reason']}"
    )
    print("  declared limits over time (first, each change, last):")
    decls = result["declarations"]
    for d in decls:
        print(f"    {d['at_s']:7.1f} s  {d['limits']}")
    if decls:
        print(f"    (last: {decls[-1]['limits']})")
    print(
        f"  text max_context_length declared below the requests' {result['config']['context']}: "
        f"{result['below_context_s']} s of {w['end'] - decls[0]['at_s'] if decls else 0:.0f} s "
        "(the Horde then gives the worker none of them, short or long)"
    )
    if result["idle_pop_gaps"]:
        print("  gaps of more than 10 s between pops without a job in hand (at s, gap s): "
              + ", ".join(f"{a}: {g}" for a, g in result["idle_pop_gaps"]))
    print("  the worker's lines about its limits, withdrawals, probes, leases and faults:")
    for line in result["worker_lines"][:80]:
        print("    " + line)
    if len(result["worker_lines"]) > 80:
        print(f"    ... {len(result['worker_lines']) - 80} more in {result['logs']}/worker.log")
    for fig in result["figures"]:
        print(f"  {fig['name']}: min {fig['min']:.1f} median {fig['median']:.1f} "
              f"max {fig['max']:.1f} s (n={fig['n']})")
    print(f"  logs (koboldcpp, worker): {result['logs']}")
    print(f"  reproduce: {result['command']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--minutes", type=float, default=6.0, help="how long to send requests (6)")
    ap.add_argument("--queue", type=int, default=3, help="requests open at a time (3)")
    ap.add_argument("--long-every", type=int, default=4, help="one long request in N (4)")
    ap.add_argument("--long-chars", type=int, default=9500, help="a long prompt's characters (9500)")
    ap.add_argument("--genlen", type=int, default=256, help="the worker's --hordegenlen (256)")
    ap.add_argument("--ttl", type=float, default=150.0, help="the job lease, s (150, the real Horde's)")
    ap.add_argument("--drain", type=float, default=150.0,
                    help="after sending, how long to wait for the jobs in hand, s (150: a lease)")
    ap.add_argument("--seed", type=int, default=1, help="the prompts' random seed (1)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the worker's journal directory")
    add_json(ap)
    args = ap.parse_args(argv)
    stop_on_sigterm()
    try:
        result = run(args)
    except KeyboardInterrupt:
        stop_all()
        raise
    print_report(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
