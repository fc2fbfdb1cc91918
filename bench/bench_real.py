"""The same chat request sent to a real koboldcpp directly and through the worker.

Not streamed and streamed, alternating which goes first: the job's time over
its backend time, time to first token, and what the worker adds per job. Needs
a built koboldcpp and a model (``KCPP_DIR``, ``KCPP_MODEL``); without them it
says it was skipped and why. Targets and method: bench/README.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests
from harness.product import Worker
from harness.real_kcpp import KoboldcppProcess, find_koboldcpp
from harness.report import (
    add_json,
    bench_result,
    figure,
    finish,
    parser,
    reproduce,
    skipped,
    write_json,
)
from harness.servers import Servers
from harness.timed_worker import TimedKobold, build_worker, configure_worker_logging
from harness.timing import first_spans, server_calls


def _settle(url: str) -> float:
    """Wait until koboldcpp is idle (its last request fully finished), then 0.2 s more,
    so that no measured request queues behind the previous one's clean-up.

    Returns koboldcpp's own time for the last generation (``last_process_time +
    last_eval_time`` of ``/api/extra/perf``, seconds), or NaN when unknown.
    """
    deadline = time.monotonic() + 30
    gen = float("nan")
    while time.monotonic() < deadline:
        try:
            perf = requests.get(url + "/api/extra/perf", timeout=5).json()
            if perf.get("idle") == 1 and not perf.get("queue"):
                gen = float(perf.get("last_process_time") or 0) + float(
                    perf.get("last_eval_time") or 0
                )
                break
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.05)
    time.sleep(0.2)
    return gen


def _direct(url: str, body: dict[str, Any], *, stream: bool) -> tuple[float, float, int]:
    """POST ``body`` to koboldcpp's /v1/chat/completions; (ttft s, total s, completion tokens)."""
    body = dict(body)
    body["genkey"] = "HORDEREQ_" + os.urandom(6).hex()  # not a local user for the worker's manners
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body.pop("stream_options", None)
    t0 = time.monotonic()
    ttft = float("nan")
    tokens = -1
    with requests.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=300) as resp:
        if not stream:
            out = resp.json()
            total = time.monotonic() - t0
            return total, total, int(out.get("usage", {}).get("completion_tokens", -1))
        buf = b""
        done = False
        while not done:
            chunk = resp.raw.read1(65536)  # what arrived, without waiting for a full block
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if (delta.get("content") or delta.get("reasoning_content")) and ttft != ttft:
                        ttft = time.monotonic() - t0
                usage = event.get("usage")
                if isinstance(usage, dict):
                    tokens = int(usage.get("completion_tokens", -1))
    return ttft, time.monotonic() - t0, tokens


def _through(
    servers: Servers, worker: Worker, backend: TimedKobold, body: dict[str, Any]
) -> dict[str, float]:
    """Queue ``body`` at the dev Horde and let the worker serve it.

    Returns seconds: ``ttft`` (pop answered -> first progress post arrived, NaN
    when not streamed), ``total`` (pop answered -> submit arrived), ``backend``
    (the worker's koboldcpp call: request sent -> answer read, or stream opened
    -> stream ended), and ``tokens`` (completion tokens submitted).
    """
    rid = servers.call("queue", kind="chat", n=1, body=body)["ids"][0]
    servers.call("times")
    backend.events.clear()
    for _ in range(5):
        if worker.run_once():
            break
    horde, _kcpp = server_calls(servers.call("times"))
    pop_done = next(t1 for name, _t0, t1, jid in horde if name == "pop" and jid)
    submit_in = next(t0 for name, t0, _t1, _ in horde if name == "submit")
    posts = [t0 for name, t0, _t1, _ in horde if name == "progress"]
    spans = first_spans(backend.events)
    if "chat" in spans:
        backend_s = spans["chat"][1] - spans["chat"][0]
    elif "chat_stream" in spans and "stream_end" in spans:
        backend_s = spans["stream_end"][1] - spans["chat_stream"][0]
    else:
        backend_s = float("nan")
    status = servers.call("status", id=rid)
    return {
        "ttft": (posts[0] - pop_done) if posts else float("nan"),
        "total": submit_in - pop_done,
        "backend": backend_s,
        "tokens": float(status.get("completion_tokens") or -1),
    }


def run(*, runs: int, tokens: int) -> dict[str, Any]:
    kdir, model, why = find_koboldcpp()
    command = reproduce(
        "bench_real.py", f"--runs {runs} --tokens {tokens}", env=("KCPP_DIR", "KCPP_MODEL")
    )
    if kdir is None or model is None:
        return skipped("real", "real koboldcpp: direct vs through the worker", command, why)
    configure_worker_logging()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_real_kcpp_{os.getpid()}.log"
    notes: list[str] = [f"koboldcpp {kdir.name}, model {model.name}, --contextsize 2048 --threads 1"]
    plain = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colours and say why you like each."},
        ],
        "max_tokens": tokens,
        "temperature": 0.0,
        "seed": 1,
    }
    streamed = dict(plain, stream=True)
    measured: list[dict[str, dict[str, float]]] = []
    kcpp_process = KoboldcppProcess(kdir, "koboldcpp.py", model, log_path)
    with kcpp_process as kcpp, Servers("--no-kcpp") as servers:
        # manners "none": the bench's own direct requests would otherwise look like a
        # local user to StandaloneManners and pause the worker (the perf read before
        # each pop is outside the pop -> submit span measured here anyway)
        worker, _horde, backend = build_worker(servers.horde_url, kcpp.url, ctx=2048, manners="none")
        kept: dict[str, dict[str, Any]] = {}

        def through(key: str, body: dict[str, Any]) -> dict[str, float]:
            out = _through(servers, worker, backend, body)
            if backend.last_chat_body is None:
                raise RuntimeError("the worker sent no chat request")
            kept[key] = backend.last_chat_body
            _settle(kcpp.url)
            return out

        def direct(key: str) -> dict[str, float]:
            ttft, total, tokens_d = _direct(kcpp.url, kept[key], stream=key == "stream")
            _settle(kcpp.url)
            return {"ttft": ttft, "total": total, "tokens": float(tokens_d)}

        _settle(kcpp.url)
        for r in range(runs + 1):  # run 0 warms koboldcpp's prompt cache up
            m: dict[str, dict[str, float]] = {}
            # odd runs send the direct request first, so that a slow phase of the
            # machine does not always fall on the same path
            if r % 2 == 0 or not kept:
                m["w"] = through("plain", plain)
                m["d"] = direct("plain")
                m["ws"] = through("stream", streamed)
                m["ds"] = direct("stream")
            else:
                m["d"] = direct("plain")
                m["w"] = through("plain", plain)
                m["ds"] = direct("stream")
                m["ws"] = through("stream", streamed)
            if r:
                measured.append(m)
    token_pairs = [(int(m["w"]["tokens"]), int(m["d"]["tokens"])) for m in measured]
    figures = [
        figure(
            "job time / its backend time, not streamed",
            "x",
            [m["w"]["total"] / m["w"]["backend"] for m in measured],
            limit=1.05,
            note="pop answered -> submit, over the worker's koboldcpp call",
        ),
        figure(
            "job time / its backend time, streamed",
            "x",
            [m["ws"]["total"] / m["ws"]["backend"] for m in measured],
            limit=1.05,
            note="over stream opened -> stream ended",
        ),
        figure(
            "time to first token ratio, streamed (worker/direct)",
            "x",
            [m["ws"]["ttft"] / m["ds"]["ttft"] for m in measured],
            limit=1.05,
            note="first progress post vs first SSE text",
        ),
        figure(
            "added by the worker per job, not streamed",
            "ms",
            [(m["w"]["total"] - m["w"]["backend"]) * 1e3 for m in measured],
        ),
        figure(
            "added by the worker per job, streamed",
            "ms",
            [(m["ws"]["total"] - m["ws"]["backend"]) * 1e3 for m in measured],
        ),
        figure(
            "  total ratio worker/direct, not streamed",
            "x",
            [m["w"]["total"] / m["d"]["total"] for m in measured],
            note="separate generations: koboldcpp's speed wanders",
        ),
        figure(
            "  total ratio worker/direct, streamed",
            "x",
            [m["ws"]["total"] / m["ds"]["total"] for m in measured],
        ),
        figure("  direct total, not streamed", "s", [m["d"]["total"] for m in measured]),
        figure("  direct time to first token", "s", [m["ds"]["ttft"] for m in measured]),
        figure("  worker time to first token", "s", [m["ws"]["ttft"] for m in measured]),
    ]
    notes.append(f"completion tokens (worker, direct) per run: {token_pairs}")
    return bench_result(
        "real",
        "real koboldcpp: the same chat request directly and through the worker",
        command,
        figures,
        notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of the request")
    ap.add_argument("--quick", action="store_true", help="1 run after the warm-up")
    add_json(ap)
    args = ap.parse_args(argv)
    result = run(runs=args.runs or (1 if args.quick else 5), tokens=args.tokens)
    if not result.get("skipped"):
        return finish(result, args.json)
    print(f"== real: skipped: {result['skipped']}")
    print(f"  reproduce: {result['command']}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
