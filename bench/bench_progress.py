"""Progress post interval and token-to-post delay of the worker on a steady koboldcpp stream.

The standalone worker, in this process, serves streamed chat jobs from the dev
Horde while the scripted koboldcpp streams ``--tokens`` tokens at
``--token-delay`` s each; ``--json`` writes bench/results/bench_progress-*.json.
Targets and method: bench/README.md.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
import threading
from datetime import datetime, timezone
from typing import Any

from harness import RESULTS
from harness.devkit import DevHorde, ScriptedKoboldcpp, ScriptedReply
from harness.product import run_standalone
from harness.report import parser, reproduce
from harness.servers import API_KEY

PROGRESS = "/api/v2/generate/text/progress"
INTERVAL_TARGET = (0.75, 1.25)
DELAY_TARGET = 1.2
WORDS = "steady rain fell on the old stone bridge while the river ran north past town "


def reply_text(tokens: int) -> str:
    """``tokens`` tokens of the scripted tokenizer (4 characters each), no tags."""
    text = (WORDS * (tokens * 4 // len(WORDS) + 1))[: tokens * 4]
    return text


def measure(horde: DevHorde, kcpp: ScriptedKoboldcpp, tokens: int, timeout_s: float) -> dict[str, Any]:
    """Send one streamed request, wait for it, and compute one run's figures (seconds)."""
    text = reply_text(tokens)
    kcpp.chunk_log.clear()
    kcpp.script(lambda body: ScriptedReply(text=text))
    log_start = len(horde.requests_log)
    rid = horde.send_chat(
        {
            "messages": [{"role": "user", "content": "Tell me about the bridge."}],
            "max_tokens": tokens + 16,
            "stream": True,
        }
    )
    if not horde.wait([rid], timeout_s=timeout_s):
        raise SystemExit(f"the request did not finish within {timeout_s:.0f} s")
    status = horde.status(rid)
    if not status["done"] or status["message"]["content"] != text:
        raise SystemExit(f"the request did not complete with the scripted text: {status['state']}")

    posts = [
        (r["at"], json.loads(r["body"]))
        for r in horde.requests_log[log_start:]
        if r["path"] == PROGRESS
    ]
    if len({p["seq"] for _, p in posts}) != len(posts):
        raise SystemExit("a progress post was retried; the figures would mix retries in")
    posted = "".join(p["delta"]["content"] for _, p in posts)
    if posted != text:
        raise SystemExit("the posted content differs from the reply; nothing to compare")

    # Post i delivers characters [ends[i-1], ends[i]) and arrives at times[i].
    times = [t for t, _ in posts]
    ends: list[int] = []
    total = 0
    for _, p in posts:
        total += len(p["delta"]["content"])
        ends.append(total)
    chunks = [(t, d.get("content", "")) for t, d in kcpp.chunk_log if d.get("content")]
    if "".join(c for _, c in chunks) != text:
        raise SystemExit("the scripted koboldcpp's chunk log does not hold the reply")
    delays: list[float] = []
    offset = 0
    for t, piece in chunks:
        offset += len(piece)
        delivered_by = bisect.bisect_left(ends, offset)  # the post holding the chunk's last char
        delays.append(times[delivered_by] - t)

    intervals = [b - a for a, b in zip(times, times[1:], strict=False)]
    steady = intervals[:-1] if len(intervals) > 1 else intervals
    return {
        "posts": len(posts),
        "stream_s": chunks[-1][0] - chunks[0][0],
        "interval_median_s": statistics.median(steady),
        "interval_worst_s": max(steady, key=lambda g: abs(g - 1.0)),
        "interval_max_s": max(steady),
        "delay_median_s": statistics.median(delays),
        "delay_worst_s": max(delays),
    }


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--token-delay", type=float, default=0.005, help="seconds per token")
    ap.add_argument("--json", action="store_true", help="write bench/results/bench_progress-*.json")
    args = ap.parse_args()
    command = reproduce(
        "bench_progress.py",
        f"--runs {args.runs} --tokens {args.tokens} --token-delay {args.token_delay:g}",
        "--json" if args.json else "",
    )
    print(
        f"python {sys.version.split()[0]}; {args.runs} runs of {args.tokens} tokens "
        f"at {args.token_delay:g} s a token"
    )
    print(f"reproduce: {command}")

    horde = DevHorde(api_keys=(API_KEY,))
    kcpp = ScriptedKoboldcpp(
        max_context_length=max(4096, 2 * args.tokens + 1024), token_delay_s=args.token_delay
    )
    kcpp.log_chunks = True
    horde.start()
    kcpp.start()
    stop = threading.Event()
    argv = [
        "--hordekey", API_KEY,
        "--hordeworkername", "bench-worker",
        "--horde-url", horde.url,
        "--kcpp-url", kcpp.url,
        "--hordegenlen", str(args.tokens + 64),
        "--log-level", "WARNING",
    ]
    worker = threading.Thread(target=run_standalone, args=(argv,), kwargs={"stop_event": stop})
    worker.start()
    runs: list[dict[str, Any]] = []
    try:
        for i in range(args.runs):
            run = measure(horde, kcpp, args.tokens, timeout_s=60 + 4 * args.tokens * args.token_delay)
            runs.append(run)
            print(
                f"run {i + 1}: {run['posts']} posts over {run['stream_s']:.1f} s; "
                f"interval median {run['interval_median_s']:.3f} s, worst "
                f"{run['interval_worst_s']:.3f} s; delay median {run['delay_median_s']:.3f} s, "
                f"worst {run['delay_worst_s']:.3f} s"
            )
    finally:
        stop.set()
        worker.join(15)
        kcpp.stop()
        horde.stop()

    figures = {
        key: summary(runs, key)
        for key in ("interval_median_s", "interval_worst_s", "delay_median_s", "delay_worst_s")
    }
    print("over the runs (min / median / max), seconds:")
    for key, label, ok in (
        ("interval_median_s", "post interval, median", _in_interval_target),
        ("interval_worst_s", "post interval, worst ", _in_interval_target),
        ("delay_median_s", "token->post delay, median", _in_delay_target),
        ("delay_worst_s", "token->post delay, worst ", _in_delay_target),
    ):
        f = figures[key]
        verdict = "ok" if ok(f["min"]) and ok(f["max"]) else "OFF TARGET"
        print(f"  {label:26} {f['min']:.3f} / {f['median']:.3f} / {f['max']:.3f}  [{verdict}]")
    print(
        f"targets: interval {INTERVAL_TARGET[0]:.2f}-{INTERVAL_TARGET[1]:.2f} s, "
        f"delay <= {DELAY_TARGET:.1f} s"
    )
    if args.json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = RESULTS / f"bench_progress-{stamp}.json"
        out.write_text(
            json.dumps(
                {
                    "bench": "bench_progress",
                    "reproduce": command,
                    "python": sys.version.split()[0],
                    "tokens": args.tokens,
                    "token_delay_s": args.token_delay,
                    "runs": runs,
                    "summary": figures,
                    "targets": {"interval_s": list(INTERVAL_TARGET), "delay_max_s": DELAY_TARGET},
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {out}")


def _in_interval_target(value: float) -> bool:
    return INTERVAL_TARGET[0] <= value <= INTERVAL_TARGET[1]


def _in_delay_target(value: float) -> bool:
    return value <= DELAY_TARGET


if __name__ == "__main__":
    main()
