"""What a job costs the job journal: today's plain writes against the former durable add.

Today's three writes a job (an add at the pop's answer, the genkey in it; the
reply kept before it is sent; the removal as soon as the Horde answers)
against the former fsync-ed add and remove, side by side, beside the default
state directory and in /tmp.
Method: bench/README.md.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.product import Journal, JournalEntry
from harness.report import add_json, bench_result, figure, finish, parser, percentile, reproduce
from harness.timed_worker import state_disk_dir

WARMUP = 20
#: A chat reply's submit body as the worker keeps it (about 1 KiB of content).
REPLY = {
    "id": "", "message": {"role": "assistant", "content": "The sky is blue. " * 60},
    "finish_reason": "stop", "model_id": "koboldcpp/bench-model", "state": "ok",
    "prompt_tokens": 21, "completion_tokens": 240,
}


def entry(job_id: str, genkey: str = "") -> JournalEntry:
    """A chat job's entry as the worker writes it."""
    return JournalEntry(
        job_id=job_id,
        kind="chat",
        model_id="koboldcpp/bench-model",
        genkey=genkey,
        lease_end=time.time() + 600.0,
    )


def today(journal: Journal, job_id: str) -> tuple[float, float]:
    """Seconds of today's path for one job: (the add at the pop's answer, the
    whole job: that add, the reply kept before its submit, the removal)."""
    only = entry(job_id, "HORDEREQ_0123456789ab")
    t0 = time.perf_counter()
    journal.add(only)
    t1 = time.perf_counter()
    journal.keep_reply(job_id, REPLY | {"id": job_id})
    journal.remove(job_id)
    return t1 - t0, time.perf_counter() - t0


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def former(journal: Journal, job_id: str) -> tuple[float, float]:
    """Seconds of the former path for one job: (the durable add: the add, then
    the file and its directory waited for on disk; add and remove)."""
    only = entry(job_id, "HORDEREQ_0123456789ab")
    t0 = time.perf_counter()
    journal.add(only)
    fsync(journal.path)
    if os.name != "nt":  # directories cannot be opened for fsync on Windows
        fsync(journal.path.parent)
    t1 = time.perf_counter()
    journal.remove(job_id)
    return t1 - t0, time.perf_counter() - t0


def measure(directory: Path, jobs: int) -> dict[str, list[float]]:
    """Per-job microseconds of each path in ``directory``, alternating job by job:
    ``today``/``former`` (the whole job) and ``today_pre``/``former_pre`` (the
    writes before the generation, on the way from the pop to koboldcpp)."""
    now = Journal(directory / "jobs-today.json")
    old = Journal(directory / "jobs-former.json")
    times: dict[str, list[float]] = {"today": [], "former": [], "today_pre": [], "former_pre": []}
    for i in range(WARMUP + jobs):
        a_pre, a = today(now, f"job-{i:06d}-a")
        b_pre, b = former(old, f"job-{i:06d}-b")
        if i >= WARMUP:
            times["today"].append(a * 1e6)
            times["former"].append(b * 1e6)
            times["today_pre"].append(a_pre * 1e6)
            times["former_pre"].append(b_pre * 1e6)
    return times


def run(*, jobs: int, quick: bool) -> dict[str, Any]:
    """Time both paths in both places; the result dict with the figures."""
    figures: list[dict[str, Any]] = []
    notes: list[str] = []
    places = (("state dir disk", state_disk_dir()), ("tmp", Path(tempfile.gettempdir())))
    for where, parent in places:
        directory = Path(tempfile.mkdtemp(prefix="bench-journal-", dir=parent))
        try:
            times = measure(directory, jobs)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        meds = {k: statistics.median(v) for k, v in times.items()}
        p99s = {k: percentile(v, 99) for k, v in times.items()}
        for key, label in (
            ("today", "today (add, kept reply, removal)"),
            ("former", "former (fsync add, remove)"),
            ("today_pre", "before generation, today (1 add)"),
            ("former_pre", "before generation, former (fsync add)"),
        ):
            figures.append(
                figure(f"journal per job, {label}, {where}", "us", times[key],
                       note=f"p99 {p99s[key]:.0f} us")
            )
        figures.append(
            figure(f"journal per job, former / today (medians), {where}", "x",
                   [meds["former"] / meds["today"]])
        )
        notes.append(
            f"{where} ({directory.parent}): per job today median {meds['today']:.0f} us, "
            f"p99 {p99s['today']:.0f} us; former median {meds['former']:.0f} us, "
            f"p99 {p99s['former']:.0f} us; former / today {meds['former'] / meds['today']:.2f}x; "
            f"before the generation today {meds['today_pre']:.0f} us, former "
            f"{meds['former_pre']:.0f} us (medians)"
        )
    notes.append(f"{jobs} jobs of each path per place, alternating, after {WARMUP} warm-up jobs")
    return bench_result(
        "journal",
        "the job journal's cost per job: today's plain writes vs the former fsync",
        reproduce("bench_journal.py", "--quick" if quick else f"--jobs {jobs}"),
        figures,
        notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--jobs", type=int, default=None, help="jobs of each path per place")
    ap.add_argument("--quick", action="store_true", help="300 jobs of each path per place")
    add_json(ap)
    args = ap.parse_args(argv)
    jobs = args.jobs or (300 if args.quick else 2000)
    return finish(run(jobs=jobs, quick=args.quick and args.jobs is None), args.json)


if __name__ == "__main__":
    sys.exit(main())
