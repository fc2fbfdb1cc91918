"""The worker's own time per chat job (20 messages, 2 tools), network and backend excluded.

From the pop's answer to the backend request, plus from the backend's answer to
the submit, as "worker code" (the gaps between its timed client calls) and "on
the wire" (as the servers saw them); ``--journal`` keeps a job journal as the
CLI does. Targets and method: bench/README.md.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.bodies import chat_body
from harness.report import add_json, bench_result, figure, finish, parser, percentile, reproduce
from harness.servers import Servers
from harness.timed_worker import (
    build_worker,
    configure_worker_logging,
    profiled,
    run_jobs,
    state_disk_dir,
)
from harness.timing import Event, client_overheads, server_calls, server_overheads


def run(
    *, runs: int, n_jobs: int, profile: bool = False, journal: bool = False
) -> dict[str, Any]:
    """Run ``runs`` x ``n_jobs`` chat jobs; returns the result dict with the figures.

    ``journal``: the worker keeps a job journal, in a temporary directory beside
    the default state directory.
    """
    if not journal:
        return _run(runs=runs, n_jobs=n_jobs, profile=profile, journal_dir=None)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-", dir=state_disk_dir()) as tmp:
        return _run(runs=runs, n_jobs=n_jobs, profile=profile, journal_dir=Path(tmp))


def _run(
    *, runs: int, n_jobs: int, profile: bool, journal_dir: Path | None
) -> dict[str, Any]:
    configure_worker_logging()
    figures: list[dict[str, Any]] = []
    notes: list[str] = []
    body = chat_body(20, tools=True)
    with Servers() as servers:
        assert servers.kcpp_url is not None
        worker, horde, backend = build_worker(
            servers.horde_url, servers.kcpp_url, journal_dir=journal_dir
        )
        servers.call("queue", kind="chat", n=20, body=body)
        run_jobs(worker, 20)  # warm-up
        servers.call("times")
        med: list[float] = []
        p99: list[float] = []
        pre_all: list[float] = []
        post_all: list[float] = []
        totals: list[float] = []
        wire_med: list[float] = []
        wire_p99: list[float] = []
        wire_all: list[float] = []
        http_calls: list[float] = []
        for r in range(runs):
            ids = servers.call("queue", kind="chat", n=n_jobs, body=body)["ids"]
            horde.events.clear()
            backend.events.clear()
            gc.collect()
            with profiled(profile and r == 0, top=30):
                run_jobs(worker, n_jobs)
            times = servers.call("times")
            counts = servers.call("outcomes", ids=ids)["counts"]
            if counts != {"done": n_jobs}:
                notes.append(f"run {r + 1}: outcomes {counts}")
            per_job = client_overheads(horde.events, backend.events)
            t = [j["total_ms"] for j in per_job]
            totals.extend(t)
            pre_all.extend(j["pre_ms"] for j in per_job)
            post_all.extend(j["post_ms"] for j in per_job)
            if t:
                med.append(statistics.median(t))
                p99.append(percentile(t, 99))
            wire = [j["total_ms"] for j in server_overheads(times)]
            wire_all.extend(wire)
            if wire:
                wire_med.append(statistics.median(wire))
                wire_p99.append(percentile(wire, 99))
            # HTTP client + loopback + server parse, per call: client call time - server time
            http_calls.extend(_http_cost(horde.events, backend.events, times))
    figures.append(figure("overhead per chat job, median (worker code)", "ms", med, limit=2))
    figures.append(figure("overhead per chat job, p99 (worker code)", "ms", p99, limit=10))
    figures.append(figure("  pop answer -> backend request (all jobs)", "ms", pre_all))
    figures.append(figure("  backend answer -> submit (all jobs)", "ms", post_all))
    if wire_all:
        figures.append(figure("overhead on the wire, median (incl. HTTP client)", "ms", wire_med))
        figures.append(figure("overhead on the wire, p99 (incl. HTTP client)", "ms", wire_p99))
    if http_calls:
        figures.append(
            figure(
                "HTTP client + loopback per call",
                "ms",
                http_calls,
                note="client call time minus server handling time",
            )
        )
    notes.append(
        f"{runs} runs x {n_jobs} chat jobs (20 messages, 2 tools, tool-call replies) after "
        f"20 warm-up jobs; pooled over {len(totals)} jobs: median {statistics.median(totals):.3f} ms, "
        f"p99 {percentile(totals, 99):.3f} ms, max {max(totals):.3f} ms"
        if totals
        else "no jobs measured"
    )
    if journal_dir is not None:
        notes.append(f"the worker kept its job journal in {journal_dir.parent}")
    return bench_result(
        "overhead",
        "per-job overhead of a chat job (20 messages, 2 tools)"
        + (", with the job journal" if journal_dir is not None else ""),
        reproduce(
            "bench_overhead.py",
            f"--runs {runs} --jobs {n_jobs}",
            "--journal" if journal_dir is not None else "",
        ),
        figures,
        notes,
    )


def _http_cost(h_events: list[Event], k_events: list[Event], times: dict[str, Any]) -> list[float]:
    """For each pop, submit, tokencount and chat call: its duration at the client minus
    the server's handling time of the matching request (ms)."""
    if not times.get("server_timing"):
        return []
    server: dict[str, list[tuple[float, float]]] = {}
    for horde_kcpp in server_calls(times):
        for name, t0, t1, _ in horde_kcpp:
            server.setdefault(name, []).append((t0, t1))
    out = []
    for name, t0, t1, _ in h_events + k_events:
        for s0, s1 in server.get(name, []):
            if t0 <= s0 and s1 <= t1:
                out.append(((t1 - t0) - (s1 - s0)) * 1e3)
                break
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None, help="chat jobs per run")
    ap.add_argument("--quick", action="store_true", help="one run of 100 jobs")
    ap.add_argument(
        "--journal", action="store_true", help="the worker keeps a job journal, as the CLI does"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the first run")
    add_json(ap)
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    n_jobs = args.jobs or (100 if args.quick else 300)
    return finish(run(runs=runs, n_jobs=n_jobs, profile=args.profile, journal=args.journal), args.json)


if __name__ == "__main__":
    sys.exit(main())
