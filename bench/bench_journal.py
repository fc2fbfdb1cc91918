"""What a job costs the job journal: today's plain writes against the former durable add.

Reproduce (from the repository root):

    python bench/bench_journal.py [--jobs 2000] [--quick] [--json OUT]

A job's life writes the journal (``journal.Journal``, a whole-file rewrite:
a temporary file, then ``os.replace``) at these points:

* today's path: an add at the pop's answer, an add again with the genkey
  before the generation, a remove after the terminal action: three plain
  writes (``Journal.add(entry)`` twice, ``Journal.remove(id)``), which the
  kernel keeps when the process is killed;
* the former path: one durable add before the generation (``Journal.add(entry,
  durable=True)``: the file and its directory ``fsync``-ed), then the remove.

Both are timed side by side in one run, one job of each in turn (two journal
files in the same directory), in a temporary directory on the disk of the
default state directory (``~/.local/state``, or ``$XDG_STATE_HOME``) and one
in the system's temporary directory (``/tmp``). It prints the median and p99
microseconds per job and the ratio former / today of the medians, and the
part before the generation (today's two adds, the former durable add), which
the job waits for between the pop's answer and koboldcpp. Nothing
else of a job is timed: the worker's own time per job is ``bench_overhead.py``'s
(``--journal`` to include these writes as the worker makes them).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import (  # noqa: E402
    figure,
    machine_info,
    percentile,
    print_result,
    write_json,
)

from koboldcpp_horde_chat.service.journal import Journal, JournalEntry, default_state_dir  # noqa: E402

WARMUP = 20


def entry(job_id: str, genkey: str = "") -> JournalEntry:
    """A chat job's entry as the worker writes it (genkey "" before the generation)."""
    return JournalEntry(
        job_id=job_id,
        kind="chat",
        model_id="koboldcpp/bench-model",
        genkey=genkey,
        lease_end=time.time() + 600.0,
    )


def today(journal: Journal, job_id: str) -> tuple[float, float]:
    """Seconds of today's path for one job: (the two adds, all three writes)."""
    first, second = entry(job_id), entry(job_id, "HORDEREQ_0123456789ab")
    t0 = time.perf_counter()
    journal.add(first)
    journal.add(second)
    t1 = time.perf_counter()
    journal.remove(job_id)
    return t1 - t0, time.perf_counter() - t0


def former(journal: Journal, job_id: str) -> tuple[float, float]:
    """Seconds of the former path for one job: (the durable add, add and remove)."""
    only = entry(job_id, "HORDEREQ_0123456789ab")
    t0 = time.perf_counter()
    journal.add(only, durable=True)
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


def state_disk_dir() -> Path:
    """The parent of the default state directory (created when missing)."""
    parent = default_state_dir().parent
    parent.mkdir(parents=True, exist_ok=True)
    return parent


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
            ("today", "today (add, add, remove)"),
            ("former", "former (fsync add, remove)"),
            ("today_pre", "before generation, today (2 adds)"),
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
    return {
        "name": "journal",
        "title": "the job journal's cost per job: today's plain writes vs the former fsync",
        "machine": machine_info(),
        "command": "python bench/bench_journal.py" + (" --quick" if quick else f" --jobs {jobs}"),
        "figures": figures,
        "notes": notes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None, help="jobs of each path per place")
    ap.add_argument("--quick", action="store_true", help="300 jobs of each path per place")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    jobs = args.jobs or (300 if args.quick else 2000)
    result = run(jobs=jobs, quick=args.quick and args.jobs is None)
    print_result(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
