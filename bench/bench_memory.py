"""The worker's RSS after start-up, and its growth over 10,000 mixed jobs.

This process is the worker; the jobs are chat with tools, text and streamed
chat, in batches. Target and method: bench/README.md.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Sequence
from typing import Any

from harness.bodies import TEXT_PROMPT, chat_body
from harness.report import add_json, bench_result, figure, finish, parser, reproduce, rss_bytes
from harness.servers import Servers
from harness.timed_worker import build_worker, configure_worker_logging, run_jobs

MB = 1e6
BATCH = 500


def _queue_batch(
    servers: Servers, n: int, tools_body: dict[str, Any], stream_body: dict[str, Any]
) -> list[str]:
    """Queue ``n`` jobs: 45 % chat with tools, 45 % text, 10 % streamed chat; returns the ids."""
    n_stream = n // 10
    n_chat = (n - n_stream) // 2
    n_text = n - n_stream - n_chat
    ids: list[str] = servers.call("queue", kind="chat", n=n_chat, body=tools_body)["ids"]
    ids += servers.call("queue", kind="text", n=n_text, prompt=TEXT_PROMPT)["ids"]
    ids += servers.call("queue", kind="chat", n=n_stream, body=stream_body)["ids"]
    return ids


def run(*, n_jobs: int, warmup: int = 200) -> dict[str, Any]:
    """Serve ``warmup`` then ``n_jobs`` jobs; returns the result dict."""
    configure_worker_logging()
    notes: list[str] = []
    figures: list[dict[str, Any]] = []
    with Servers() as servers:
        servers.call("record", on=False)
        assert servers.kcpp_url is not None
        worker, horde, backend = build_worker(servers.horde_url, servers.kcpp_url)
        gc.collect()
        rss_start = rss_bytes()
        tools_body = chat_body(20, tools=True)
        stream_body = chat_body(20, tools=False, stream=True)
        _queue_batch(servers, warmup, tools_body, stream_body)
        served, _, _ = run_jobs(worker, warmup)
        horde.events.clear()
        backend.events.clear()
        gc.collect()
        rss_warm = rss_bytes()
        objects_warm = len(gc.get_objects())
        checkpoints = [(0, rss_warm)]
        done = 0
        t0 = time.monotonic()
        stalled = False
        outcomes: dict[str, int] = {}
        while done < n_jobs:
            n = min(BATCH, n_jobs - done)
            ids = _queue_batch(servers, n, tools_body, stream_body)
            served, wall, _ = run_jobs(worker, n)
            done += served
            for k, v in servers.call("outcomes", ids=ids)["counts"].items():
                outcomes[k] = outcomes.get(k, 0) + v
            # the timed clients' event lists are the bench's, not the worker's
            horde.events.clear()
            backend.events.clear()
            servers.call("trim")
            if served < n:
                notes.append(f"STALLED after {done} jobs: served {served} of {n} in {wall:.1f} s")
                stalled = True
                break
            if done % 1000 == 0 or done == n_jobs:
                checkpoints.append((done, rss_bytes()))
        elapsed = time.monotonic() - t0
        gc.collect()
        rss_end = rss_bytes()
        objects_end = len(gc.get_objects())
    segments = [
        (b[1] - a[1]) / MB / ((b[0] - a[0]) / 1000)
        for a, b in zip(checkpoints, checkpoints[1:], strict=False)
        if b[0] > a[0]
    ]
    figures.append(figure("RSS after start-up (imports, clients, worker)", "MB", [rss_start / MB]))
    figures.append(figure(f"RSS after {warmup} warm-up jobs", "MB", [rss_warm / MB]))
    full = done >= 10_000
    figures.append(
        figure(
            f"RSS growth over {done} jobs (after warm-up)",
            "MB",
            [(rss_end - rss_warm) / MB],
            limit=5.0 if full else None,
            note="" if full else "the 5 MB target applies to 10,000 jobs",
        )
    )
    if segments:
        figures.append(figure("RSS growth per 1,000 jobs (each segment)", "MB", segments))
    notes.append(f"outcomes (dev Horde request states): {outcomes}")
    notes.append(f"live Python objects: {objects_warm} after warm-up, {objects_end} at the end")
    notes.append(
        "RSS at each checkpoint (jobs: MB): "
        + ", ".join(f"{n}: {r / MB:.1f}" for n, r in checkpoints + [(done, rss_end)])
    )
    notes.append(f"{done} jobs in {elapsed:.1f} s ({done / max(elapsed, 1e-9):.0f} jobs/s, mixed)")
    if stalled:
        notes.append("the run stalled: growth is over fewer jobs than asked")
    return bench_result(
        "memory",
        "RSS after start-up and its growth over many jobs",
        reproduce("bench_memory.py", f"--jobs {n_jobs}"),
        figures,
        notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--jobs", type=int, default=None, help="jobs after warm-up (10,000)")
    ap.add_argument("--quick", action="store_true", help="500 jobs")
    add_json(ap)
    args = ap.parse_args(argv)
    return finish(run(n_jobs=args.jobs or (500 if args.quick else 10_000)), args.json)


if __name__ == "__main__":
    sys.exit(main())
