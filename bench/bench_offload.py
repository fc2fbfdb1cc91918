"""Large offload: a 36 MiB gzip-encoded offloaded conversation with 20 images.

Reproduce (from the repository root):

    python bench/bench_offload.py [--runs 3] [--mib 36] [--images 20] [--quick] [--json OUT]

The dev Horde stores a chat request whose messages (20
text messages, then a user turn with 20 JPEG images as base64 data URLs) are
``--mib`` MiB as compact JSON, gzipped, behind a ``messages_url`` (offload on,
256 KiB threshold, ``Content-Encoding: gzip``). A fresh worker process (so that
its peak RSS is this job's) pops it and serves it as ``koboldcpp-horde-chat``
would: fetch, decode, validate, fit-count (koboldcpp's tokencount), build and
send the chat request to a scripted koboldcpp with vision.

Figures:

* wall time from the pop's answer reaching the worker to the chat request
  arriving at koboldcpp (fetch + gunzip + JSON decode + checks + fit count +
  building and encoding the request). Target: at most 0.5 s.
* peak RSS of the worker process (``ru_maxrss``), total and above its RSS just
  before the pop. Target: at most 3 x the decoded size.
* the bytes sent to tokencount, and how many of the images' base64 samples
  appear in them. Target: none (image data is replaced by a placeholder).

Note: the request the worker sends is larger than 32 MiB, koboldcpp's default
``--maxrequestsize`` (32): koboldcpp answers such a body with 500 "Payload is
too big", and the worker faults such a job without sending it. The scripted
koboldcpp here plays one started with ``--maxrequestsize 64``, and the worker
is told so (``--kcpp-max-request-mb 64``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import (  # noqa: E402
    Servers,
    build_worker,
    configure_worker_logging,
    figure,
    machine_info,
    print_result,
    rss_bytes,
    write_json,
)

MIB = 1024 * 1024
CTX = 32768


def _child(horde_url: str, kcpp_url: str) -> int:
    """The worker process: serve one job, print the timings and RSS as JSON."""

    class _Urls:
        pass

    configure_worker_logging()
    urls: Any = _Urls()
    urls.horde_url, urls.kcpp_url = horde_url, kcpp_url
    worker, horde, backend = build_worker(
        urls, vision=True, ctx=CTX, manners="none", max_request_mib=64
    )
    rss_start = rss_bytes()
    maxrss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.monotonic()
    served = worker.run_once()
    t1 = time.monotonic()
    events: dict[str, tuple[float, float]] = {}
    for name, a, b, _ in sorted(horde.events + backend.events, key=lambda e: e[1]):
        events.setdefault(name, (a, b))  # the job's own calls, not the next pop's
    print(
        json.dumps(
            {
                "served": served,
                "run_once_s": t1 - t0,
                "events": events,
                "rss_start": rss_start,
                "maxrss_start": maxrss_start,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "faults": worker.stats.faults,
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
    return {
        "name": "offload",
        "title": f"a {mib:g} MiB gzip-encoded offloaded conversation with {images} images",
        "machine": machine_info(),
        "command": f"python bench/bench_offload.py --runs {runs} --mib {mib:g} --images {images}",
        "figures": figures,
        "notes": notes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        return _child(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--mib", type=float, default=36.0)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one run")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    result = run(runs=runs, mib=args.mib, images=args.images)
    print_result(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
