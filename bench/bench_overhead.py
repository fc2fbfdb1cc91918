"""Per-job overhead: the worker's own time around the backend call of a chat job.

Reproduce (from the repository root):

    python bench/bench_overhead.py [--runs 3] [--jobs 300] [--quick] [--journal] [--profile] [--json OUT]

For a chat job with 20 messages and 2 tools, the worker's own time from
receiving the pop response to sending the backend request, plus from the
backend's last byte to sending the submit, network and backend time excluded.
Target: median at most 2 ms, p99 at most 10 ms.

Two measurements of the same jobs:

* "worker code": the clients are wrapped (``bench_throughput.TimedHorde`` and
  ``TimedKobold``); overhead = (tokencount called - pop returned) + (chat
  completion called - tokencount returned) + (submit called - chat completion
  returned). The koboldcpp tokencount in between is backend time (the fit
  check's count, seed step 3) and is left out. This is the figure held to the
  target: it is everything the worker does, and nothing that happens inside
  its HTTP client.
* "on the wire": the same three gaps seen by the servers (the dev Horde's pop
  answer finished -> koboldcpp's tokencount arrives, and so on). It adds the
  HTTP client's work (``requests``: building and parsing requests, reading the
  answer) and the servers' own accept and parse time, so it is an upper bound.

The worker runs as ``koboldcpp-horde-chat`` runs it (see bench_throughput.py),
without a job journal unless ``--journal`` is given: then it keeps one, as
the CLI does, in a temporary directory beside the default state directory
(``~/.local/state``), and each job's journal writes count in its overhead.
The servers run in a separate process.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import (  # noqa: E402
    Servers,
    build_worker,
    chat_body,
    client_overheads,
    configure_worker_logging,
    figure,
    machine_info,
    percentile,
    print_result,
    run_jobs,
    server_overheads,
    write_json,
)

from koboldcpp_horde_chat.service.journal import default_state_dir  # noqa: E402


def run(
    *, runs: int, n_jobs: int, profile: bool = False, journal: bool = False
) -> dict[str, Any]:
    """Run ``runs`` x ``n_jobs`` chat jobs; returns the result dict with the figures.

    ``journal``: the worker keeps a job journal (see the module docstring).
    """
    if not journal:
        return _run(runs=runs, n_jobs=n_jobs, profile=profile, journal_dir=None)
    parent = default_state_dir().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-", dir=parent) as tmp:
        return _run(runs=runs, n_jobs=n_jobs, profile=profile, journal_dir=Path(tmp))


def _run(
    *, runs: int, n_jobs: int, profile: bool, journal_dir: Path | None
) -> dict[str, Any]:
    configure_worker_logging()
    figures: list[dict[str, Any]] = []
    notes: list[str] = []
    body = chat_body(20, tools=True)
    with Servers() as servers:
        worker, horde, backend = build_worker(servers, journal_dir=journal_dir)
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
        profiler = None
        for r in range(runs):
            ids = servers.call("queue", kind="chat", n=n_jobs, body=body)["ids"]
            horde.events.clear()
            backend.events.clear()
            gc.collect()
            if profile and r == 0:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            run_jobs(worker, n_jobs)
            if profiler is not None and r == 0:
                profiler.disable()
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
    if profiler is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(30)
        print(buf.getvalue())
    if journal_dir is not None:
        notes.append(f"the worker kept its job journal in {journal_dir.parent}")
    return {
        "name": "overhead",
        "title": "per-job overhead of a chat job (20 messages, 2 tools)"
        + (", with the job journal" if journal_dir is not None else ""),
        "machine": machine_info(),
        "command": f"python bench/bench_overhead.py --runs {runs} --jobs {n_jobs}"
        + (" --journal" if journal_dir is not None else ""),
        "figures": figures,
        "notes": notes,
    }


def _http_cost(
    h_events: list[tuple[str, float, float, str | None]],
    k_events: list[tuple[str, float, float, str | None]],
    times: dict[str, Any],
) -> list[float]:
    """For each pop, submit, tokencount and chat call: its duration at the client minus
    the server's handling time of the matching request (ms)."""
    if not times.get("server_timing"):
        return []
    server: dict[str, list[tuple[float, float]]] = {}
    for path, t0, t1, _ in times["horde"]:
        server.setdefault(path.rsplit("/", 1)[-1], []).append((t0, t1))
    for path, t0, t1, _ in times["kcpp"]:
        name = {"/api/extra/tokencount": "tokencount", "/v1/chat/completions": "chat"}.get(path)
        if name:
            server.setdefault(name, []).append((t0, t1))
    out = []
    for name, t0, t1, _ in h_events + k_events:
        for s0, s1 in server.get(name, []):
            if t0 <= s0 and s1 <= t1:
                out.append(((t1 - t0) - (s1 - s0)) * 1e3)
                break
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None, help="chat jobs per run")
    ap.add_argument("--quick", action="store_true", help="one run of 100 jobs")
    ap.add_argument(
        "--journal", action="store_true", help="the worker keeps a job journal, as the CLI does"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the first run")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    n_jobs = args.jobs or (100 if args.quick else 300)
    result = run(runs=runs, n_jobs=n_jobs, profile=args.profile, journal=args.journal)
    print_result(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
