"""A 36 MiB gzip-encoded offloaded conversation with 20 JPEG images, served by a fresh worker.

Wall time from the pop's answer to the chat request at koboldcpp (fetch,
gunzip, decode, checks, fit count, build and send), the worker process's peak
RSS, and whether image bytes reach tokencount. Targets and method: bench/README.md.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.report import add_json, bench_result, figure, finish, parser, reproduce, rss_bytes
from harness.servers import Servers
from harness.timed_worker import build_worker, configure_worker_logging
from harness.timing import first_spans

MIB = 1024 * 1024
CTX = 32768


def _child(horde_url: str, kcpp_url: str) -> int:
    """The worker process: serve one job, print the timings and RSS as JSON."""
    configure_worker_logging()
    worker, horde, backend = build_worker(
        horde_url, kcpp_url, vision=True, ctx=CTX, manners="none", max_request_mib=64
    )
    rss_start = rss_bytes()
    maxrss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.monotonic()
    served = worker.run_once()
    t1 = time.monotonic()
    events = first_spans(horde.events + backend.events)  # the job's own calls, not the next pop's
    print(
        json.dumps(
            {
                "served": served,
                "run_once_s": t1 - t0,
                "events": events,
                "rss_start": rss_start,
                "maxrss_start": maxrss_start,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "faults": worker.state.stats.faults,
            }
        ),
        flush=True,
    )
    return 0


def run(*, runs: int, mib: float, images: int) -> dict[str, Any]:
    """``runs`` fresh worker processes, one offloaded job each; returns the result dict."""
    target = int(mib * MIB) - 64 * 1024  # under the worker's 36 MiB cap on the decoded body
    walls: list[float] = []
    fetch_s: list[float] = []
    count_s: list[float] = []
    build_s: list[float] = []
    peak: list[float] = []
    peak_above: list[float] = []
    tc_bytes: list[float] = []
    leaks: list[int] = []
    decoded = 0
    notes: list[str] = []
    with Servers(
        "--vision",
        "--ctx",
        str(CTX),
        "--offload-bytes",
        str(256 * 1024),
        "--gzip",
        "--max-request-mib",
        "64",
    ) as servers:
        assert servers.kcpp_url is not None
        for r in range(runs):
            queued = servers.call("queue_offload", images=images, target_bytes=target, seed=r + 1)
            decoded = queued["decoded_bytes"]
            servers.call("times")
            servers.call("trim")
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", servers.horde_url, servers.kcpp_url],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if out.returncode != 0 or not out.stdout.strip():
                notes.append(f"run {r + 1}: worker process failed: {out.stderr[-500:]}")
                continue
            child = json.loads(out.stdout.strip().splitlines()[-1])
            times = servers.call("times")
            counts = servers.call("outcomes", ids=[queued["id"]])["counts"]
            tcs = servers.call("tokencount_bodies")["bodies"]
            ev = child["events"]
            chat_arrivals = [t0 for path, t0, _t1, _n in times["kcpp"] if path == "/v1/chat/completions"]
            chat_sizes = [n for path, _t0, _t1, n in times["kcpp"] if path == "/v1/chat/completions"]
            if "pop" not in ev or "tokencount" not in ev:
                notes.append(f"run {r + 1}: the job did not reach the fit count; outcome {counts}")
                continue
            pop_ret = ev["pop"][1]
            tc_in, tc_ret = ev["tokencount"]
            if chat_arrivals and "chat" in ev:
                walls.append(chat_arrivals[0] - pop_ret)
                build_s.append(chat_arrivals[0] - tc_ret)
            else:
                notes.append(f"run {r + 1}: no chat request reached koboldcpp; outcome {counts}")
            fetch_s.append(tc_in - pop_ret)
            count_s.append(tc_ret - tc_in)
            peak.append(child["maxrss"] / MIB)
            peak_above.append((child["maxrss"] - child["rss_start"]) / MIB)
            for tc in tcs:
                tc_bytes.append(tc["bytes"])
                leaks.append(tc["image_samples_found"])
            if r == 0:
                notes.append(
                    f"outcome {counts}; chat request body {chat_sizes[0] / MIB if chat_sizes else 0:.1f} MiB; "
                    f"worker RSS before the pop {child['rss_start'] / MIB:.1f} MiB"
                )
    dec_mib = decoded / MIB
    limit = 3 * dec_mib
    figures = [
        figure("wall: pop answer -> chat request at koboldcpp", "s", walls, limit=0.5),
        figure("  fetch + gunzip + decode + checks + fit text", "s", fetch_s),
        figure("  tokencount round trip (koboldcpp)", "s", count_s),
        figure("  build + encode + send the chat request", "s", build_s),
        figure("peak RSS of the worker process", "MiB", peak, limit=limit, note=f"3 x {dec_mib:.1f} MiB decoded"),
        figure("peak RSS above the RSS before the pop", "MiB", peak_above, limit=limit),
        figure("bytes sent to tokencount", "bytes", tc_bytes),
        figure(
            "image base64 samples found in tokencount bodies",
            "count",
            leaks,
            limit=0,
            note=f"{images} images sampled per run",
        ),
    ]
    notes.append(
        f"decoded conversation {dec_mib:.1f} MiB ({decoded} bytes), {images} images; "
        f"{runs} runs, each in a fresh worker process; servers in another process"
    )
    notes.append(
        "the chat request is above koboldcpp's default --maxrequestsize of 32 MiB "
        "(a real koboldcpp answers 500 'Payload is too big'); the scripted one allows 64 MiB"
    )
    return bench_result(
        "offload",
        f"a {mib:g} MiB gzip-encoded offloaded conversation with {images} images",
        reproduce("bench_offload.py", f"--runs {runs} --mib {mib:g} --images {images}"),
        figures,
        notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        return _child(argv[1], argv[2])
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--mib", type=float, default=36.0)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one run")
    add_json(ap)
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    return finish(run(runs=runs, mib=args.mib, images=args.images), args.json)


if __name__ == "__main__":
    sys.exit(main())
