"""Jobs per second through the whole pop loop, and the idle gap between jobs.

Text and chat jobs (20 messages, 2 tools) through ``Worker.run_once`` against
the dev Horde and an instant scripted koboldcpp; koboldcpp's own embedded loop
(0.1 s pause, a thread per submit) on the same servers for scale; the gap from
a submit's answer to the next pop. Targets and method: bench/README.md.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from harness.bodies import TEXT_PROMPT, chat_body
from harness.product import BackendCapabilities, WorkerSettings, pop_body
from harness.report import add_json, bench_result, figure, finish, parser, percentile, reproduce
from harness.servers import API_KEY, Servers
from harness.timed_worker import build_worker, configure_worker_logging, profiled, run_jobs
from harness.timing import idle_gaps, server_calls


def _url_json(url: str, data: dict[str, Any] | None, headers: dict[str, str]) -> Any:
    """koboldcpp's make_url_request: urllib, JSON in and out, None on any failure."""
    try:
        req = urllib.request.Request(
            url,
            data=json.dumps(data).encode() if data is not None else None,
            headers={"Content-Type": "application/json", **headers},
            method="POST" if data is not None else "GET",
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read().decode())
    except Exception:  # koboldcpp prints and returns None
        return None


def embedded_style_loop(servers: Servers, n: int, settings: WorkerSettings) -> tuple[int, float]:
    """Serve ``n`` jobs the way koboldcpp's embedded worker does: pop, generate,
    submit in a new thread, sleep 0.1 s (text jobs, as koboldcpp 1.116.1 serves
    them; its idle and busy checks read globals and cost nothing here).
    Returns (served, seconds)."""
    kcpp = servers.kcpp_url
    assert kcpp is not None
    headers = {"apikey": API_KEY, "Client-Agent": "bench:1:embedded-style"}
    body = pop_body(settings, BackendCapabilities())
    threads: list[threading.Thread] = []
    served = 0
    t0 = time.monotonic()
    while served < n:
        pop = _url_json(servers.horde_url + "/api/v2/generate/text/pop", body, headers)
        if not pop or not pop.get("id"):
            time.sleep(1.0)
            continue
        genkey = f"HORDEREQ_{random.randint(100, 999)}"
        payload = dict(pop["payload"])
        payload["genkey"] = genkey
        out = _url_json(kcpp + "/api/v1/generate", payload, {})
        submit = {"id": pop["id"], "generation": out["results"][0]["text"], "state": "ok"}
        th = threading.Thread(
            target=_url_json,
            args=(servers.horde_url + "/api/v2/generate/text/submit", submit, headers),
        )
        th.start()
        threads.append(th)
        served += 1
        time.sleep(0.1)
    for th in threads:
        th.join()
    return served, time.monotonic() - t0


# --------------------------------------------------------------------------------------

def run(
    *, runs: int, n_jobs: int, embedded_jobs: int, manners: str = "standalone", profile: bool = False
) -> dict[str, Any]:
    """Throughput (text, chat, embedded-style) and idle gaps; returns the result dict."""
    configure_worker_logging()
    figures: list[dict[str, Any]] = []
    notes: list[str] = []
    with Servers() as servers:
        assert servers.kcpp_url is not None
        worker, horde, backend = build_worker(servers.horde_url, servers.kcpp_url, manners=manners)
        rates: dict[str, list[float]] = {"text": [], "chat": []}
        cpu_per_job: dict[str, list[float]] = {"text": [], "chat": []}
        server_per_job: dict[str, list[float]] = {"text": [], "chat": []}
        gaps: list[float] = []
        gaps_client: list[float] = []
        gap_medians: list[float] = []
        outcomes: dict[str, int] = {}
        body = chat_body(20, tools=True)
        # warm-up: connections, lazy imports, first-call caches
        servers.call("queue", kind="chat", n=10, body=body)
        servers.call("queue", kind="text", n=10, prompt=TEXT_PROMPT)
        run_jobs(worker, 20)
        servers.call("times")
        for r in range(runs):
            for kind in ("text", "chat"):
                if kind == "chat":
                    ids = servers.call("queue", kind="chat", n=n_jobs, body=body)["ids"]
                else:
                    ids = servers.call("queue", kind="text", n=n_jobs, prompt=TEXT_PROMPT)["ids"]
                horde.events.clear()
                backend.events.clear()
                gc.collect()
                with profiled(profile and r == 0 and kind == "chat", top=25):
                    served, wall, cpu = run_jobs(worker, n_jobs)
                times = servers.call("times")
                for k, v in servers.call("outcomes", ids=ids)["counts"].items():
                    outcomes[f"{kind}:{k}"] = outcomes.get(f"{kind}:{k}", 0) + v
                if served < n_jobs:
                    notes.append(
                        f"run {r + 1} {kind}: STALLED, served {served} of {n_jobs} jobs in "
                        f"{wall:.1f} s (the worker waited between pops)"
                    )
                rates[kind].append(served / wall)
                cpu_per_job[kind].append(cpu / max(served, 1) * 1e3)
                handled = sum(t1 - t0 for _p, t0, t1, _x in times["horde"] + times["kcpp"])
                server_per_job[kind].append(handled / max(served, 1) * 1e3)
                g = idle_gaps(server_calls(times)[0])
                gaps.extend(g)
                if g:
                    gap_medians.append(statistics.median(g))
                gaps_client.extend(idle_gaps(horde.events))
        figures.append(figure("throughput, text jobs", "jobs/s", rates["text"], limit=150, better="higher"))
        figures.append(
            figure("throughput, chat jobs (20 msgs, 2 tools)", "jobs/s", rates["chat"], limit=150, better="higher")
        )
        figures.append(figure("worker CPU per text job", "ms", cpu_per_job["text"]))
        figures.append(figure("worker CPU per chat job", "ms", cpu_per_job["chat"]))
        if servers.server_timing:
            figures.append(
                figure(
                    "server handlers per text job",
                    "ms",
                    server_per_job["text"],
                    note="dev Horde + scripted koboldcpp, other process",
                )
            )
            figures.append(figure("server handlers per chat job", "ms", server_per_job["chat"]))
        # koboldcpp's embedded loop, for scale
        emb: list[float] = []
        for _ in range(max(1, min(runs, 2))):
            servers.call("queue", kind="text", n=embedded_jobs, prompt=TEXT_PROMPT)
            served, wall = embedded_style_loop(servers, embedded_jobs, worker.settings)
            emb.append(served / wall)
        servers.call("times")
        figures.append(
            figure(
                "embedded-style loop (0.1 s pause), text",
                "jobs/s",
                emb,
                note="koboldcpp's own loop, for scale",
            )
        )
        figures.append(
            figure(
                "idle gap: submit answered -> next pop (per run)",
                "ms",
                gap_medians,
                limit=5,
                note="median of each run",
            )
        )
        figures.append(
            figure(
                "idle gap, all jobs: p99 "
                f"{percentile(gaps, 99):.2f} ms",
                "ms",
                gaps,
            )
        )
        figures.append(
            figure("idle gap inside the worker (submit returned -> pop called)", "ms", gaps_client)
        )
        perf_calls = [(t1 - t0) * 1e3 for name, t0, t1, _ in backend.events if name == "perf"]
        if perf_calls:
            figures.append(figure("GET /api/extra/perf before each pop", "ms", perf_calls))
        notes.append(f"outcomes (dev Horde request states): {outcomes}")
        notes.append(
            f"{runs} runs x {n_jobs} jobs of each kind after 20 warm-up jobs; manners={manners}; "
            "servers in a separate process"
        )
    return bench_result(
        "throughput",
        "jobs per second through the full loop, and the idle gap between jobs",
        reproduce(
            "bench_throughput.py",
            f"--runs {runs} --jobs {n_jobs} --embedded-jobs {embedded_jobs}",
            f"--manners {manners}" if manners != "standalone" else "",
        ),
        figures,
        notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None, help="jobs of each kind per run")
    ap.add_argument("--embedded-jobs", type=int, default=None)
    ap.add_argument("--manners", choices=("standalone", "none"), default="standalone")
    ap.add_argument("--quick", action="store_true", help="fewer runs and jobs (about 10 s)")
    ap.add_argument("--profile", action="store_true", help="cProfile the first chat run")
    add_json(ap)
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    n_jobs = args.jobs or (100 if args.quick else 400)
    emb = args.embedded_jobs or (10 if args.quick else 20)
    res = run(runs=runs, n_jobs=n_jobs, embedded_jobs=emb, manners=args.manners, profile=args.profile)
    return finish(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
