"""Throughput and idle gap of the whole pop loop, plus the harness the other benches share.

Reproduce (from the repository root):

    python bench/bench_throughput.py [--runs 3] [--jobs 400] [--quick] [--json OUT]

What it measures:

* throughput: jobs per second through ``Worker.run_once`` against the dev
  Horde and a scripted koboldcpp answering instantly (``token_delay_s=0``),
  for text jobs and for chat jobs (20 messages, 2 tools: each chat job is a
  pop, a tokencount, a chat completion returning a tool call, and a
  structured submit). Target: at least 150 jobs/s.
* for scale, in the same run: a loop with koboldcpp's embedded worker's fixed
  pauses (0.1 s after each job, one thread per submit), on the same servers.
* idle gap: from the Horde finishing a submit's answer to the next pop arriving
  at the Horde, while jobs are queued. Target: median at most 5 ms.

The worker runs in this process exactly as ``koboldcpp-horde-chat`` builds it
(``StandaloneManners``, so a ``GET /api/extra/perf`` precedes a pop at most
once a second while koboldcpp is idle, and INFO logging formatted and written
to ``os.devnull``). The dev Horde and the
scripted koboldcpp run in a separate server process (``--serve``), so their
CPU does not share this process's GIL; both record request arrival and answer
times on the shared monotonic clock. The clients are wrapped (subclasses of
``HordeClient`` and ``KoboldClient``) to time each call from the worker's side.

The harness part of this module (``Servers``, ``TimedHorde``, ``TimedKobold``,
``build_worker``, ``figure``...) is imported by ``bench_overhead.py``,
``bench_memory.py``, ``bench_offload.py`` and ``bench_real.py``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
# BENCH_PKG_ROOT=<dir holding a koboldcpp_horde_chat copy> benchmarks a scratch copy instead
PKG_ROOT = Path(os.environ.get("BENCH_PKG_ROOT") or ROOT)
if str(PKG_ROOT) not in sys.path:
    sys.path.insert(0, str(PKG_ROOT))

from koboldcpp_horde_chat.horde.client import HordeClient  # noqa: E402
from koboldcpp_horde_chat.horde.declaration import BackendCapabilities, pop_body  # noqa: E402
from koboldcpp_horde_chat.kcpp.client import BackendStream, KoboldClient  # noqa: E402
from koboldcpp_horde_chat.kcpp.manners import NoManners, StandaloneManners  # noqa: E402
from koboldcpp_horde_chat.service.journal import Journal, journal_path  # noqa: E402
from koboldcpp_horde_chat.service.loop import Worker  # noqa: E402
from koboldcpp_horde_chat.service.state import WorkerState  # noqa: E402
from koboldcpp_horde_chat.settings import WorkerSettings  # noqa: E402

API_KEY = "bench-key-0123456789"
MODEL = "koboldcpp/bench-model"
WORKER_NAME = "bench-worker"
MACHINE_NOTE = (
    "on a machine shared with other work figures vary between runs: "
    "compare medians, and re-run before concluding"
)

# --------------------------------------------------------------------------------------
# statistics and figures


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def figure(
    name: str,
    unit: str,
    values: Sequence[float],
    *,
    limit: float | None = None,
    better: str = "lower",
    note: str = "",
) -> dict[str, Any]:
    """One reported figure: min / median / max of ``values`` (one per run or per item).

    ``limit`` is the target; ``met`` compares the median with it
    (``better`` "lower": median <= limit; "higher": median >= limit).
    """
    vals = [float(v) for v in values]
    med = statistics.median(vals) if vals else float("nan")
    fig: dict[str, Any] = {
        "name": name,
        "unit": unit,
        "n": len(vals),
        "min": min(vals) if vals else float("nan"),
        "median": med,
        "max": max(vals) if vals else float("nan"),
        "values": [round(v, 4) for v in vals[:50]],
    }
    if limit is not None:
        fig["target"] = f"{'<=' if better == 'lower' else '>='} {limit:g} {unit}"
        fig["limit"] = limit
        fig["better"] = better
        fig["met"] = bool(med <= limit) if better == "lower" else bool(med >= limit)
    if note:
        fig["note"] = note
    return fig


def format_figure(fig: dict[str, Any]) -> str:
    """``name: min .. median .. max unit  [target: met/NOT met]`` on one line."""

    def num(x: float) -> str:
        if x != x:  # NaN
            return "n/a"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"

    text = (
        f"  {fig['name']:<44} min {num(fig['min']):>7}  median {num(fig['median']):>7}  "
        f"max {num(fig['max']):>7} {fig['unit']}"
    )
    if "target" in fig:
        text += f"   [target {fig['target']}: {'met' if fig['met'] else 'NOT met'}]"
    if fig.get("note"):
        text += f"   ({fig['note']})"
    return text


def machine_info() -> dict[str, Any]:
    """CPU, Python and load, to print beside the figures."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": load,
        "note": MACHINE_NOTE,
    }


def rss_bytes() -> int:
    """This process's resident set size now, bytes (from /proc/self/statm)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def print_result(result: dict[str, Any]) -> None:
    """Print a bench result: header, machine note, figures, notes, the command."""
    print(f"== {result['name']}: {result.get('title', '')}")
    m = result.get("machine") or machine_info()
    print(f"  machine: {m['cpu']} x{m['cpus']}, Python {m['python']}, load {' '.join(m['loadavg'])}")
    print(f"  note: {MACHINE_NOTE}")
    for fig in result["figures"]:
        print(format_figure(fig))
    for note in result.get("notes", []):
        print(f"  - {note}")
    print(f"  reproduce: {result['command']}")


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``path`` (nothing when None)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2, default=str))


# --------------------------------------------------------------------------------------
# the server process: dev Horde + scripted koboldcpp, timed at the server side


def _serve_main(argv: Sequence[str]) -> int:
    """Run the servers; one JSON command per stdin line, one JSON answer per stdout line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--vision", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--offload-bytes", type=int, default=0)
    ap.add_argument("--gzip", action="store_true")
    ap.add_argument("--max-request-mib", type=int, default=0)
    ap.add_argument("--no-kcpp", action="store_true")
    ap.add_argument("--trusted", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    from koboldcpp_horde_chat.devkit import kcpp as kcpp_mod
    from koboldcpp_horde_chat.devkit._http import Request, Response
    from koboldcpp_horde_chat.devkit.horde import DevHorde

    if args.max_request_mib:
        # koboldcpp started with --maxrequestsize <MiB> (its default is 32)
        kcpp_mod.MAX_REQUEST_BYTES = args.max_request_mib * 1024 * 1024

    horde_events: list[tuple[str, float, float, bytes, bytes]] = []
    kcpp_events: list[tuple[str, float, float, int]] = []
    record = {"on": True}
    mono = time.monotonic

    class TimedDevHorde(DevHorde):
        def _serve_horde(self, req: Request) -> Response:
            t0 = mono()
            resp = super()._serve_horde(req)
            if record["on"]:
                horde_events.append((req.path, t0, mono(), req.body, resp.body))
            return resp

    class TimedKcpp(kcpp_mod.ScriptedKoboldcpp):
        def _handle(self, h: Any) -> None:
            t0 = mono()
            try:
                super()._handle(h)
            finally:
                if record["on"]:
                    path = h.path.split("?", 1)[0]
                    kcpp_events.append((path, t0, mono(), int(h.headers.get("content-length") or 0)))

    server_timing = hasattr(DevHorde, "_serve_horde") and hasattr(
        kcpp_mod.ScriptedKoboldcpp, "_handle"
    )
    horde = TimedDevHorde(
        api_keys=(API_KEY,),
        trusted=args.trusted,
        offload_bytes=args.offload_bytes or None,
        offload_gzip=args.gzip,
    )
    horde.start()
    kcpp: Any = None
    if not args.no_kcpp:
        kcpp = TimedKcpp(
            model_name=MODEL,
            max_context_length=args.ctx,
            vision=args.vision,
            token_delay_s=0.0,
            abort_reply_delay_s=0.0,
        )
        kcpp.start()
    offload_samples: dict[str, list[str]] = {}

    def job_id(raw: bytes) -> str | None:
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        value = obj.get("id") if isinstance(obj, dict) else None
        return value if isinstance(value, str) else None

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "queue":
            ids = []
            for _ in range(int(cmd["n"])):
                if cmd["kind"] == "chat":
                    ids.append(
                        horde.send_chat(cmd["body"], best_effort=bool(cmd.get("best_effort")))
                    )
                else:
                    ids.append(
                        horde.send_text(
                            cmd["prompt"],
                            max_length=int(cmd.get("max_length", 80)),
                            max_context_length=int(cmd.get("max_context_length", 1024)),
                            params=cmd.get("params"),
                        )
                    )
            return {"ids": ids}
        if op == "queue_offload":
            body, samples, decoded = offload_conversation(
                int(cmd["images"]), int(cmd["target_bytes"]), int(cmd.get("seed", 1))
            )
            rid = horde.send_chat(body, best_effort=True)
            offload_samples[rid] = samples
            return {"id": rid, "decoded_bytes": decoded}
        if op == "tokencount_bodies":
            # bytes of every tokencount prompt since the last trim, and image bytes in them
            samples = [s for v in offload_samples.values() for s in v]
            out = []
            for r in list(kcpp.requests) if kcpp is not None else []:
                if r["path"] in ("/api/extra/tokencount", "/api/extra/tokenize"):
                    prompt = (r.get("body") or {}).get("prompt") or ""
                    out.append(
                        {
                            "bytes": len(prompt.encode("utf-8")),
                            "image_samples_found": sum(1 for s in samples if s in prompt),
                            "image_samples": len(samples),
                        }
                    )
            return {"bodies": out}
        if op == "times":
            h_ev = [
                (
                    p,
                    t0,
                    t1,
                    job_id(resp) if p.endswith("/pop") else job_id(body),
                )
                for p, t0, t1, body, resp in horde_events
            ]
            k_ev = list(kcpp_events)
            horde_events.clear()
            kcpp_events.clear()
            return {"horde": h_ev, "kcpp": k_ev, "server_timing": server_timing}
        if op == "record":
            record["on"] = bool(cmd["on"])
            return {"ok": True}
        if op == "wait":
            return {"done": horde.wait(cmd["ids"], float(cmd.get("timeout", 30)))}
        if op == "outcomes":
            ids = cmd["ids"]
            horde.wait(ids, float(cmd.get("timeout", 5.0)))  # a submit may still be in flight
            counts: dict[str, int] = {}
            for rid in ids:
                st = horde.status(rid)
                key = st["state"]
                if st.get("refusals"):
                    key += f" (refused {st['refusals'][-1]['rc']})"
                counts[key] = counts.get(key, 0) + 1
            return {"counts": counts}
        if op == "status":
            status: dict[str, Any] = horde.status(cmd["id"])
            return status
        if op == "trim":
            # the dev Horde and the scripted koboldcpp keep every request for tests;
            # a long bench run drops them (the server's memory is not what is measured)
            if kcpp is not None:
                for name in ("requests", "generations", "tokencount_messages"):
                    lst = getattr(kcpp, name, None)
                    if isinstance(lst, list):
                        del lst[:]
            lock = getattr(horde, "_lock", None)
            if lock is not None:
                with lock:
                    for name in ("_pops", "_requests_log"):
                        lst = getattr(horde, name, None)
                        if isinstance(lst, list):
                            del lst[:]
            horde_events.clear()
            kcpp_events.clear()
            return {"ok": True}
        if op == "quit":
            return {"ok": True}
        raise ValueError(f"unknown command {op!r}")

    print(
        json.dumps(
            {
                "horde": horde.url,
                "kcpp": kcpp.url if kcpp is not None else None,
                "pid": os.getpid(),
                "server_timing": server_timing,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            answer = handle(cmd)
        except Exception as exc:  # report to the bench, keep serving
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
        if cmd.get("cmd") == "quit":
            break
    if kcpp is not None:
        kcpp.stop()
    horde.stop()
    return 0


class Servers:
    """The server process (dev Horde + scripted koboldcpp) and its command channel.

    Use as a context manager. ``call(cmd, **fields)`` sends one command and
    returns its JSON answer; raises RuntimeError when the server reports an error.
    """

    def __init__(self, *extra_args: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", *extra_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
        )
        hello = self._readline()
        self.horde_url: str = hello["horde"]
        self.kcpp_url: str | None = hello["kcpp"]
        self.pid: int = hello["pid"]
        self.server_timing: bool = hello["server_timing"]
        self._lock = threading.Lock()

    def _readline(self) -> dict[str, Any]:
        out: IO[str] | None = self._proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError("the bench server process ended")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            stdin = self._proc.stdin
            assert stdin is not None
            stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            stdin.flush()
            answer = self._readline()
        if "error" in answer:
            raise RuntimeError(f"bench server: {answer['error']}")
        return answer

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# the worker side: timed clients and the worker as the standalone CLI builds it

Event = tuple[str, float, float, str | None]
"""(call, entered, returned, job id) on the monotonic clock."""


class TimedHorde(HordeClient):
    """A ``HordeClient`` that records when each call was entered and returned."""

    def __init__(self, *args: Any, events: list[Event] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the loop's client and the one its next pop goes out on share one record
        self.events: list[Event] = events if events is not None else []

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        answer: dict[str, Any] = {}
        try:
            answer = super().pop(body, timeout_s=timeout_s)
            return answer
        finally:
            jid = answer.get("id")
            self.events.append(("pop", t0, time.monotonic(), jid if isinstance(jid, str) else None))

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            return super().submit(body, timeout_s=timeout_s)
        finally:
            self.events.append(("submit", t0, time.monotonic(), str(body.get("id"))))

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            return super().progress(body, timeout_s=timeout_s)
        finally:
            self.events.append(("progress", t0, time.monotonic(), str(body.get("id"))))


class TimedStream(BackendStream):
    """A ``BackendStream`` proxy that records when the stream ended (``read_chunk``
    returned ``b""`` or raised). It delegates everything to the wrapped stream."""

    def __init__(self, inner: BackendStream, events: list[Event]) -> None:  # noqa: D107
        # the base class's __init__ is not called: the inner stream holds the state
        self._inner = inner
        self._events = events
        self._t0 = time.monotonic()

    @property
    def status(self) -> int:
        return self._inner.status

    @property
    def headers(self) -> dict[str, str]:
        return self._inner.headers

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def read_chunk(self) -> bytes:
        try:
            chunk = self._inner.read_chunk()
        except BaseException:
            self._events.append(("stream_end", self._t0, time.monotonic(), None))
            raise
        if not chunk:
            self._events.append(("stream_end", self._t0, time.monotonic(), None))
        return chunk

    def close(self) -> None:
        self._inner.close()


class TimedKobold(KoboldClient):
    """A ``KoboldClient`` that records each call; ``sent_bodies`` keeps the last chat body."""

    def __init__(self, *args: Any, events: list[Event] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the loop's client and the one its next pop goes out on share one record
        self.events: list[Event] = events if events is not None else []
        self._last_chat_body: dict[str, Any] | bytes | bytearray | None = None

    @property
    def last_chat_body(self) -> dict[str, Any] | None:
        """The last chat body sent, decoded (the worker sends it encoded)."""
        body = self._last_chat_body
        if body is None or isinstance(body, dict):
            return body
        decoded: dict[str, Any] = json.loads(body)
        return decoded

    def _timed(self, name: str, call: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return call()
        finally:
            self.events.append((name, t0, time.monotonic(), None))

    def perf(self, *, timeout_s: float = 5.0) -> dict[str, Any]:
        result: dict[str, Any] = self._timed("perf", lambda: super(TimedKobold, self).perf(timeout_s=timeout_s))
        return result

    def tokencount(self, prompt: str, *, timeout_s: float) -> int:
        result: int = self._timed(
            "tokencount", lambda: super(TimedKobold, self).tokencount(prompt, timeout_s=timeout_s)
        )
        return result

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> dict[str, Any]:
        self._last_chat_body = body
        result: dict[str, Any] = self._timed(
            "chat",
            lambda: super(TimedKobold, self).chat_completion(
                body, timeout_s=timeout_s, cancel=cancel
            ),
        )
        return result

    def open_chat_stream(
        self, body: dict[str, Any] | bytes | bytearray, *, read_timeout_s: float
    ) -> BackendStream:
        self._last_chat_body = body
        result: BackendStream = self._timed(
            "chat_stream",
            lambda: super(TimedKobold, self).open_chat_stream(body, read_timeout_s=read_timeout_s),
        )
        return TimedStream(result, self.events)

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = self._timed(
            "generate",
            lambda: super(TimedKobold, self).generate(payload, timeout_s=timeout_s, cancel=cancel),
        )
        return result


def configure_worker_logging() -> None:
    """INFO logging as the CLI formats it, written to os.devnull (its cost is counted)."""
    fmt = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    datefmt = "%Y-%m-%d %H:%M:%S"
    try:
        from koboldcpp_horde_chat import cli

        fmt = getattr(cli, "LOG_FORMAT", fmt)
        datefmt = getattr(cli, "LOG_DATEFMT", datefmt)
    except ImportError:  # pragma: no cover
        pass
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process
    handler.setFormatter(logging.Formatter(fmt, datefmt))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def build_worker(
    servers: Servers,
    *,
    kcpp_url: str | None = None,
    manners: str = "standalone",
    vision: bool = False,
    ctx: int = 4096,
    max_length: int = 512,
    max_request_mib: int = 32,
    journal_dir: Path | None = None,
) -> tuple[Worker, TimedHorde, TimedKobold]:
    """A ``Worker`` wired as ``koboldcpp-horde-chat`` wires it, with timed clients.

    ``manners``: "standalone" (reads koboldcpp's /api/extra/perf before a pop,
    at most once a second while it is idle, as the CLI does) or "none" (as inside koboldcpp, where the hook reads
    globals for free). ``max_request_mib``: koboldcpp's ``--maxrequestsize``
    (``--kcpp-max-request-mb``). ``journal_dir``: keep the job journal there,
    as the CLI does in its state directory (None: no journal).
    """
    url = kcpp_url or servers.kcpp_url
    assert url is not None
    settings = WorkerSettings(
        api_key=API_KEY,
        worker_name=WORKER_NAME,
        model_id=MODEL,
        backend_max_context_length=ctx,
        max_length=max_length,
        horde_url=servers.horde_url,
        kcpp_url=url,
        vision=vision,
        kcpp_max_request_bytes=max_request_mib * 1024 * 1024,
    )
    horde = TimedHorde(settings.horde_url, settings.api_key, bridge_agent=settings.bridge_agent)
    backend = TimedKobold(settings.kcpp_url)
    state = None
    if journal_dir is not None:
        state = WorkerState(
            settings, journal=Journal(journal_path(settings.worker_name, journal_dir))
        )
    worker = Worker(
        settings,
        horde=horde,
        backend=backend,
        state=state,
        manners=StandaloneManners(backend) if manners == "standalone" else NoManners(),
        caps=BackendCapabilities(vision=vision),
        # The second Horde session the next pop goes out on, beside each submit.
        pop_horde=TimedHorde(
            settings.horde_url,
            settings.api_key,
            bridge_agent=settings.bridge_agent,
            events=horde.events,
        ),
    )
    return worker, horde, backend


def run_jobs(
    worker: Worker, n: int, *, deadline_s: float | None = None, stall_s: float = 5.0
) -> tuple[int, float, float]:
    """Call ``run_once`` until ``n`` jobs were served, ``deadline_s`` passed, or no job
    was served for ``stall_s`` seconds (a worker waiting between pops: shows as
    ``served < n``).

    Returns (served, wall seconds, CPU seconds of this process). The default
    deadline is generous: 20 jobs/s plus 10 s.
    """
    served = 0
    limit = deadline_s if deadline_s is not None else 10.0 + n / 20.0
    w0, c0 = time.monotonic(), time.process_time()
    end = w0 + limit
    last = w0
    while served < n:
        now = time.monotonic()
        if now >= end or now - last > stall_s:
            break
        if worker.run_once():
            served += 1
            last = time.monotonic()
    return served, time.monotonic() - w0, time.process_time() - c0


# --------------------------------------------------------------------------------------
# the job shapes


def chat_body(n_messages: int = 20, *, tools: bool = True, stream: bool = False) -> dict[str, Any]:
    """A client's chat request: ``n_messages`` messages (system, user/assistant turns,
    one earlier tool call and its result, ending with a user turn) and 2 tools."""
    rng = random.Random(6)
    words = (
        "the a worker horde model token context reply stream image tool call weather city "
        "search result kobold prompt queue lease fault submit progress reason summary"
    ).split()

    def sentence(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. " + sentence(30)}
    ]
    turn = 0
    while len(messages) < n_messages - 1:
        turn += 1
        if tools and turn == 3 and len(messages) <= n_messages - 4:
            messages.append({"role": "user", "content": "What is the weather in Lyon? " + sentence(10)})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_12345",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                        }
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": "call_12345", "content": '{"temp_c": 18, "sky": "clear"}'}
            )
            continue
        role = "user" if messages[-1]["role"] != "user" else "assistant"
        messages.append({"role": role, "content": sentence(40 if role == "assistant" else 25)})
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": sentence(30)})
    messages.append({"role": "user", "content": "And what about Paris? " + sentence(12)})
    body: dict[str, Any] = {"messages": messages[:n_messages], "max_tokens": 128, "temperature": 0.7}
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather for a city.",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "description": "City name"}},
                        "required": ["city"],
                    },
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "search_docs",
                    "description": "Search the documentation.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string"},
                            "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
                        },
                        "required": ["query"],
                    },
                },
            },
        ]
    if stream:
        body["stream"] = True
    return body


TEXT_PROMPT = "### Instruction:\nWrite one short sentence about foxes.\n### Response:\n"


def offload_conversation(
    n_images: int, target_bytes: int, seed: int
) -> tuple[dict[str, Any], list[str], int]:
    """A chat request whose messages' compact JSON is about ``target_bytes`` with
    ``n_images`` JPEG images (structurally valid: SOI, JFIF, DQT, SOF0, DHT, SOS,
    incompressible entropy data, EOI) as base64 data URLs.

    Returns (body, image samples, compact JSON size). The samples are 48-character
    pieces from the middle of each image's base64, to look for in tokencount bodies.
    """
    import base64
    import struct

    rng = random.Random(seed)

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    def jpeg(size: int) -> bytes:
        head = b"\xff\xd8" + segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
        head += segment(0xDB, b"\x00" + bytes([16] * 64))
        head += segment(0xC0, struct.pack(">BHHB", 8, 1536, 2048, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00")
        head += segment(0xC4, b"\x00" + bytes([0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]) + bytes(range(12)))
        head += segment(0xC4, b"\x10" + bytes([0, 2, 1, 3, 3, 2, 4, 3, 5, 5, 4, 4, 0, 0, 1, 0x7D]) + bytes(range(162)))
        head += segment(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00")
        entropy = rng.randbytes(size - len(head) - 2).replace(b"\xff", b"\xfe")
        return head + entropy + b"\xff\xd9"

    text_messages: list[dict[str, Any]] = chat_body(20, tools=False)["messages"]
    text_bytes = len(json.dumps(text_messages, separators=(",", ":")))
    overhead = 120  # JSON around each image part
    per_image_b64 = (target_bytes - text_bytes - overhead * n_images) // n_images
    raw_size = per_image_b64 // 4 * 3 - 32
    samples = []
    messages = copy.deepcopy(text_messages)
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these pictures, please."}]
    for _ in range(n_images):
        b64 = base64.b64encode(jpeg(raw_size)).decode("ascii")
        samples.append(b64[len(b64) // 2 : len(b64) // 2 + 48])
        parts.append({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + b64}})
    messages[-1] = {"role": "user", "content": parts}
    body = {"messages": messages, "max_tokens": 128, "temperature": 0.7}
    decoded = len(json.dumps(messages, separators=(",", ":")).encode())
    return body, samples, decoded


# --------------------------------------------------------------------------------------
# timing analysis


def split_events(events: list[Event]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = {}
    for ev in events:
        out.setdefault(ev[0], []).append(ev)
    return out


def _jobs_by_pop(pops: list[tuple[str, float]], calls: list[Event]) -> dict[str, dict[str, Any]]:
    """Hand each backend call to the job of the last pop answered before the call began.

    ``pops``: (job id, when its answer was back). One slot serves one job at a
    time, and the next pop (sent beside a submit) is answered before that job's
    first backend call, so this holds with or without the overlap.
    """
    pops = sorted(pops, key=lambda p: p[1])
    jobs: dict[str, dict[str, Any]] = {jid: {"pop_done": t} for jid, t in pops}
    for name, t0, t1, _ in sorted(calls, key=lambda e: e[1]):
        owner = None
        for jid, t in pops:
            if t > t0:
                break
            owner = jid
        if owner is not None:
            jobs[owner].setdefault(name, (t0, t1))
    return jobs


def _overhead(
    job: dict[str, Any], submit_t0: float, submits_done: list[float]
) -> dict[str, float] | None:
    """pre/post/total (ms) of one job from its calls, or None (streamed or incomplete).

    The job's ``pre`` starts when its pop was answered, or when the previous
    job's submit was (``submits_done``), whichever came last: a pop sent beside
    a submit waits for that submit, which is the Horde's time, not the worker's.
    """
    gen = job.get("chat") or job.get("generate")
    if gen is None or "chat_stream" in job or job.get("progress"):
        return None
    ready = max([job["pop_done"], *(t for t in submits_done if t <= gen[0])])
    pre = gen[0] - ready
    if "tokencount" in job:
        pre -= job["tokencount"][1] - job["tokencount"][0]
    post = submit_t0 - gen[1]
    return {"pre_ms": pre * 1e3, "post_ms": post * 1e3, "total_ms": (pre + post) * 1e3}


def _per_job_overheads(horde: list[Event], calls: list[Event]) -> list[dict[str, float]]:
    """The rows of ``client_overheads``: ``horde`` holds pop, submit and progress
    calls with their job ids, ``calls`` the backend's tokencount, chat and generate."""
    pops = [(jid, t1) for name, _t0, t1, jid in horde if name == "pop" and jid]
    jobs = _jobs_by_pop(pops, calls)
    for name, _t0, _t1, jid in horde:
        if name == "progress" and jid in jobs:
            jobs[jid]["progress"] = True
    done = [t1 for name, _t0, t1, _jid in horde if name == "submit"]
    out: list[dict[str, float]] = []
    for name, t0, _t1, jid in sorted(horde, key=lambda e: e[1]):
        if name == "submit" and jid in jobs and not jobs[jid].get("submitted"):
            jobs[jid]["submitted"] = True
            row = _overhead(jobs[jid], t0, done)
            if row is not None:
                out.append(row)
    return out


def client_overheads(h_events: list[Event], k_events: list[Event]) -> list[dict[str, float]]:
    """Per served job, the worker's own time between the client calls (ms).

    Chat: (tokencount entered - pop returned) + (chat entered - tokencount
    returned) = ``pre``; (submit entered - chat returned) = ``post``. Text:
    (generate entered - pop returned) and (submit entered - generate returned).
    Calls are paired with their job by id (pop, submit, progress) and by time
    (backend calls), so a pop sent beside the previous submit is counted right.
    """
    return _per_job_overheads(h_events, k_events)


def server_overheads(servers_times: dict[str, Any]) -> list[dict[str, float]]:
    """Per served job, the gaps seen by the servers (ms): from the Horde's pop answer to
    koboldcpp's tokencount arrival, from tokencount's answer to the chat request's
    arrival, and from the chat answer to the submit's arrival at the Horde. Calls are
    paired with their job as in ``client_overheads``."""
    names = {
        "/api/extra/tokencount": "tokencount",
        "/v1/chat/completions": "chat",
        "/api/v1/generate": "generate",
    }
    calls: list[Event] = [
        (names[path], t0, t1, None) for path, t0, t1, _n in servers_times["kcpp"] if path in names
    ]
    horde = [(path.rsplit("/", 1)[-1], t0, t1, jid) for path, t0, t1, jid in servers_times["horde"]]
    return _per_job_overheads(horde, calls)


def idle_gaps(servers_times: dict[str, Any]) -> list[float]:
    """Gaps (ms) from the Horde finishing a submit's answer to the next pop's arrival.

    A pop that arrives before the previous submit was answered (the worker
    pops while its submit is in flight) counts as a gap of 0.
    """
    ev = sorted(
        ((p.rsplit("/", 1)[-1], t0, t1) for p, t0, t1, _ in servers_times["horde"]),
        key=lambda e: e[1],
    )
    gaps = []
    last_submit_done: float | None = None
    for name, t0, t1 in ev:
        if name == "submit":
            last_submit_done = t1
        elif name == "pop":
            if last_submit_done is not None:
                gaps.append(max(0.0, t0 - last_submit_done) * 1e3)
            last_submit_done = None
    return gaps


def client_idle_gaps(h_events: list[Event]) -> list[float]:
    """Gaps (ms) from a submit call returning to the next pop call, at the worker
    (0 when the pop was called before the submit returned)."""
    gaps = []
    last: float | None = None
    for name, _t0, t1, _ in sorted(h_events, key=lambda e: e[1]):
        if name == "submit":
            last = t1
        elif name == "pop":
            if last is not None:
                gaps.append(max(0.0, _t0 - last) * 1e3)
            last = None
    return gaps


# --------------------------------------------------------------------------------------
# koboldcpp's embedded worker loop, for scale


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
# the benchmark


def run(
    *, runs: int, n_jobs: int, embedded_jobs: int, manners: str = "standalone", profile: bool = False
) -> dict[str, Any]:
    """Throughput (text, chat, embedded-style) and idle gaps; returns the result dict."""
    configure_worker_logging()
    figures: list[dict[str, Any]] = []
    notes: list[str] = []
    with Servers() as servers:
        worker, horde, backend = build_worker(servers, manners=manners)
        rates: dict[str, list[float]] = {"text": [], "chat": []}
        cpu_per_job: dict[str, list[float]] = {"text": [], "chat": []}
        server_per_job: dict[str, list[float]] = {"text": [], "chat": []}
        gaps: list[float] = []
        gaps_client: list[float] = []
        gap_medians: list[float] = []
        outcomes: dict[str, int] = {}
        body = chat_body(20, tools=True)
        profiler = None
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
                if profile and r == 0 and kind == "chat":
                    import cProfile

                    profiler = cProfile.Profile()
                    profiler.enable()
                served, wall, cpu = run_jobs(worker, n_jobs)
                if profiler is not None and r == 0 and kind == "chat":
                    profiler.disable()
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
                g = idle_gaps(times)
                gaps.extend(g)
                if g:
                    gap_medians.append(statistics.median(g))
                gaps_client.extend(client_idle_gaps(horde.events))
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
        if profiler is not None:
            import io
            import pstats

            buf = io.StringIO()
            pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
            print(buf.getvalue())
    args = f"--runs {runs} --jobs {n_jobs} --embedded-jobs {embedded_jobs}"
    if manners != "standalone":
        args += f" --manners {manners}"
    return {
        "name": "throughput",
        "title": "jobs per second through the full loop, and the idle gap between jobs",
        "machine": machine_info(),
        "command": f"python bench/bench_throughput.py {args}",
        "figures": figures,
        "notes": notes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--serve":
        return _serve_main(argv[1:])
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None, help="jobs of each kind per run")
    ap.add_argument("--embedded-jobs", type=int, default=None)
    ap.add_argument("--manners", choices=("standalone", "none"), default="standalone")
    ap.add_argument("--quick", action="store_true", help="fewer runs and jobs (about 10 s)")
    ap.add_argument("--profile", action="store_true", help="cProfile the first chat run")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    n_jobs = args.jobs or (100 if args.quick else 400)
    emb = args.embedded_jobs or (10 if args.quick else 20)
    result = run(runs=runs, n_jobs=n_jobs, embedded_jobs=emb, manners=args.manners, profile=args.profile)
    print_result(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
