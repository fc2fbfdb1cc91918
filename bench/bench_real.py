"""Real backend ratio: the same chat request sent to a real koboldcpp directly and through the worker.

Reproduce (from the repository root):

    python bench/bench_real.py [--runs 5] [--tokens 64] [--quick] [--json OUT]

Needs a koboldcpp built locally: ``$KCPP_DIR`` (default ``kcpp-src`` in the
repository, which git ignores, holding ``koboldcpp.py`` and a built
``koboldcpp_default.so``) and a GGUF model (``$KCPP_MODEL``, default the first
``*.gguf`` in ``$KCPP_DIR/models``). Without them it prints that it was
skipped and why.

The bench starts its own koboldcpp on a free 127.0.0.1 port (``--contextsize
2048 --threads 1 --quiet``), the dev Horde in a server process, and the worker
here (as ``koboldcpp-horde-chat`` builds it). Each run sends the same chat
request (temperature 0, fixed seed, so the same tokens every time) four ways:
through the worker and directly, each not streamed and streamed (``stream:
true``: the worker relays it as progress posts). The direct requests replay
the exact body the worker sent (new genkey). Odd runs go direct first; before
each request the bench waits until koboldcpp is idle. A warm-up run comes
first (koboldcpp's prompt cache then serves every run alike).

Figures (target 1.05 for the ratios):

* job time / its backend time: from the dev Horde answering the pop to the
  submit arriving, over the worker's own koboldcpp call for that job (request
  sent -> answer read; streamed: stream opened -> stream ended). The same
  generation is on both sides, so koboldcpp's speed cancels out: this is what
  the worker adds to a job (tokencount, building, parsing, progress, submit);
* time to first token, streamed: the first progress post arriving at the Horde
  (from the pop's answer) over the first SSE text chunk of the direct request
  (from sending it);
* added by the worker per job, in ms (job time - backend time);
* the plain total ratios through / direct, for reference only: they compare
  two separate generations, and on a shared 2-core machine koboldcpp's speed
  wanders by +/-15 % from one generation to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import (  # noqa: E402
    Servers,
    build_worker,
    configure_worker_logging,
    figure,
    machine_info,
    print_result,
    write_json,
)

KCPP_DIR = Path(
    os.environ.get("KCPP_DIR") or Path(__file__).resolve().parents[1] / "kcpp-src"
)
MODELS_DIR = KCPP_DIR / "models"


def find_koboldcpp() -> tuple[Path | None, Path | None, str]:
    """(koboldcpp dir, model, "") when usable, else (None, None, why not)."""
    script = KCPP_DIR / "koboldcpp.py"
    if not script.is_file():
        return None, None, f"no koboldcpp.py in {KCPP_DIR} (set KCPP_DIR)"
    if not any(KCPP_DIR.glob("koboldcpp_*.so")):
        return None, None, f"koboldcpp in {KCPP_DIR} is not built (no koboldcpp_*.so)"
    env_model = os.environ.get("KCPP_MODEL")
    if env_model:
        model = Path(env_model)
        if not model.is_file():
            return None, None, f"KCPP_MODEL={env_model} does not exist"
        return KCPP_DIR, model, ""
    models = sorted(MODELS_DIR.glob("*.gguf")) if MODELS_DIR.is_dir() else []
    if not models:
        return None, None, f"no GGUF model in {MODELS_DIR} (set KCPP_MODEL)"
    return KCPP_DIR, models[0], ""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def koboldcpp_argv(script: str, model: Path, port: int) -> list[str]:
    """How the benchmarks start koboldcpp: ``script`` (its ``koboldcpp.py``) on
    127.0.0.1:``port`` with ``model``, a 2048 context, one thread, no launcher."""
    return [
        sys.executable,
        script,
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--contextsize",
        "2048",
        "--threads",
        "1",
        "--skiplauncher",
        "--quiet",
    ]


class RealKoboldcpp:
    """A koboldcpp process on a free port; ``url`` once ready. Context manager."""

    def __init__(self, kdir: Path, model: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            koboldcpp_argv("koboldcpp.py", model, self.port),
            cwd=str(kdir),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"koboldcpp exited with {self._proc.returncode}; see {log_path}")
            try:
                if requests.get(self.url + "/api/v1/info/version", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"koboldcpp did not answer within 180 s; see {log_path}")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> RealKoboldcpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _through(servers: Servers, worker: Any, backend: Any, body: dict[str, Any]) -> dict[str, float]:
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
    times = servers.call("times")
    pop_done = next(t1 for p, _t0, t1, jid in times["horde"] if p.endswith("/pop") and jid)
    submit_in = next(t0 for p, t0, _t1, _ in times["horde"] if p.endswith("/submit"))
    posts = [t0 for p, t0, _t1, _ in times["horde"] if p.endswith("/progress")]
    spans = {name: (t0, t1) for name, t0, t1, _ in backend.events}
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
    command = f"python bench/bench_real.py --runs {runs} --tokens {tokens}"
    if kdir is None or model is None:
        return {
            "name": "real",
            "title": "real koboldcpp: direct vs through the worker",
            "machine": machine_info(),
            "command": command,
            "skipped": why,
            "figures": [],
            "notes": [f"skipped: {why}"],
        }
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
    with RealKoboldcpp(kdir, model, log_path) as kcpp, Servers("--no-kcpp") as servers:
        # manners "none": the bench's own direct requests would otherwise look like a
        # local user to StandaloneManners and pause the worker (the perf read before
        # each pop is outside the pop -> submit span measured here anyway)
        worker, _horde, backend = build_worker(servers, kcpp_url=kcpp.url, ctx=2048, manners="none")
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
    return {
        "name": "real",
        "title": "real koboldcpp: the same chat request directly and through the worker",
        "machine": machine_info(),
        "command": command,
        "figures": figures,
        "notes": notes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of the request")
    ap.add_argument("--quick", action="store_true", help="1 run after the warm-up")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 5)
    result = run(runs=runs, tokens=args.tokens)
    if result.get("skipped"):
        print(f"== real: skipped: {result['skipped']}")
        print(f"  reproduce: {result['command']}")
    else:
        print_result(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
