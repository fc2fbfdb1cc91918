"""The dev Horde and the scripted koboldcpp in a process of their own, timed at their side.

``Servers(*flags)`` starts ``python -m harness.servers`` (in ``bench/``) and
talks to it, one JSON command per line; the servers' Python then does not share
the worker's GIL. Both servers note when each request arrived and when its
answer was ready on the machine-wide monotonic clock, which the worker's
process reads too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from harness import BENCH
from harness.bodies import offload_conversation

API_KEY = "bench-key-0123456789"
MODEL = "koboldcpp/bench-model"


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

    from harness.devkit import Request, Response, TimedDevHorde, kcpp_module

    if args.max_request_mib:
        # koboldcpp started with --maxrequestsize <MiB> (its default is 32)
        kcpp_module.MAX_REQUEST_BYTES = args.max_request_mib * 1024 * 1024

    horde_events: list[tuple[str, float, float, bytes, bytes]] = []
    kcpp_events: list[tuple[str, float, float, int]] = []
    record = {"on": True}
    mono = time.monotonic

    class RecordedHorde(TimedDevHorde):
        def on_call(self, req: Request, resp: Response, t_in: float, t_out: float) -> None:
            if record["on"]:
                horde_events.append((req.path, t_in, t_out, req.body, resp.body))

    class TimedKcpp(kcpp_module.ScriptedKoboldcpp):
        def _handle(self, h: Any) -> None:
            t0 = mono()
            try:
                super()._handle(h)
            finally:
                if record["on"]:
                    path = h.path.split("?", 1)[0]
                    kcpp_events.append((path, t0, mono(), int(h.headers.get("content-length") or 0)))

    server_timing = TimedDevHorde.TIMED and hasattr(kcpp_module.ScriptedKoboldcpp, "_handle")
    horde = RecordedHorde(
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
    ``flags``: the server process's options (``--vision``, ``--ctx N``,
    ``--offload-bytes N``, ``--gzip``, ``--max-request-mib N``, ``--no-kcpp``,
    ``--trusted``).
    """

    def __init__(self, *flags: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "harness.servers", *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(BENCH),
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


if __name__ == "__main__":
    sys.exit(_serve_main(sys.argv[1:]))
