"""Soak: 10,000 jobs through the real pop loop with 10% injected faults, on a fake clock.

The worker against the in-process fakes of bench/harness/fakes.py; it prints the jobs'
ends, the faults by reason, double submits and lost jobs (the exit code is 1
when either is not 0) and the RSS. The faults and the job mix: bench/README.md.
"""

from __future__ import annotations

import gc
import logging
import random
import resource
import time
from collections import Counter
from typing import Any, cast

from harness.fakes import (
    FakeBackend,
    FakeClock,
    FakeHorde,
    FakeStopEvent,
    backend_error,
    sse_chunks,
)
from harness.product import BackendBusy, Worker, WorkerSettings, WorkerState
from harness.report import parser, reproduce, rss_bytes

MODEL = "koboldcpp/soak"
BACKEND_FAULTS = (
    "chat_error", "chat_reset", "chat_500", "chat_busy_forever", "chat_malformed",
    "stream_cut", "tokencount_error", "overflow",
)
HORDE_FAULTS = (
    "lost_before", "lost_after", "unavailable", "rate_limited", "ChatSubmitInvalid",
    "ChatSubmitNonconformant", "AbortedGen", "not_found",
)
PROGRESS_FAULTS = ("cancel", "ChatJobAborted", "lost")
POP_FAULTS = ("unavailable", "rate_limited", "lost")


class SoakBackend(FakeBackend):
    """A FakeBackend on which each generation takes fake time."""

    def __init__(self, clock: FakeClock, rng: random.Random) -> None:
        super().__init__()
        self.clock = clock
        self.rng = rng

    def chat_completion(self, body: dict[str, Any], *, timeout_s: float, cancel: Any = None) -> Any:
        self.clock.advance(self.rng.uniform(2.0, 20.0))
        return super().chat_completion(body, timeout_s=timeout_s)

    def generate(self, payload: dict[str, Any], *, timeout_s: float, cancel: Any = None) -> Any:
        self.clock.advance(self.rng.uniform(2.0, 20.0))
        return super().generate(payload, timeout_s=timeout_s)

    def open_chat_stream(self, body: dict[str, Any], *, read_timeout_s: float) -> Any:
        self.clock.advance(self.rng.uniform(2.0, 20.0))
        return super().open_chat_stream(body, read_timeout_s=read_timeout_s)


class SoakHorde(FakeHorde):
    """A FakeHorde that hands out the next job of the kind the pop's declaration allows."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.keep_pop_bodies = False
        self.next_job: dict[str, Any] | None = None
        self.pop_fault: str | None = None
        self.text_instead = 0

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        job = self.next_job
        if job is not None and job.get("chat") and body.get("chat_jobs") is not True:
            job = text_pop(job["id"])  # chat withdrawn: the Horde sends a text job
            self.text_instead += 1
        if self.pop_fault is not None:
            self.pops.append(self.pop_fault)
            self.pop_fault = None
        elif job is not None:
            self.pops.append(job)
        self.next_job = None
        return super().pop(body, timeout_s=timeout_s)


def chat_pop(job_id: str, *, stream: bool, long: bool) -> dict[str, Any]:
    text = "Name one colour." + (" and more" * 5000 if long else "")
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "temperature": 0.7, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "rep_pen": 1.0, "top_k": 0, "min_p": 0.0, "max_length": 128, "max_context_length": 4096,
        "n": 1,
    }
    if stream:
        payload["stream_progress"] = True
    return {
        "payload": payload, "id": job_id, "ids": [job_id], "messages": [], "ttl": 150,
        "skipped": {}, "model": MODEL, "chat": True,
    }


def text_pop(job_id: str) -> dict[str, Any]:
    return {
        "payload": {"prompt": "Once upon a time", "max_length": 80, "max_context_length": 1024},
        "id": job_id, "ids": [job_id], "ttl": 150, "model": MODEL,
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--fault-rate", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1000, help="jobs before the RSS baseline")
    args = ap.parse_args(argv)
    logging.disable(logging.CRITICAL)  # 10,000 jobs of log lines would measure logging

    rng = random.Random(args.seed)
    clock = FakeClock()
    horde = SoakHorde(clock)
    backend = SoakBackend(clock, rng)
    settings = WorkerSettings(
        api_key="soak-key", worker_name="soak", model_id=MODEL,
        backend_max_context_length=4096, max_length=512,
    )
    worker = Worker(
        settings,
        horde=cast(Any, horde), backend=cast(Any, backend),
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )

    verdicts: Counter[str] = Counter()
    fault_reasons: Counter[str] = Counter()
    injected: Counter[str] = Counter()
    doubles = late = 0
    withdrawals = 0
    was_enabled = True
    base_rss = 0
    started = time.perf_counter()

    def tally(final: bool = False) -> None:
        nonlocal doubles, late
        for job_id in list(horde.jobs):
            job = horde.jobs[job_id]
            if job.state is None and not final:
                continue
            verdict = horde.verdict(job)
            verdicts[verdict] += 1
            late += job.late_submits
            if verdict == "double":
                doubles += 1
            if verdict == "faulted":
                reason = job.bodies[-1].get("fault_reason") or "none"
                fault_reasons[f"{reason} ({'chat' if job.chat else 'text'})"] += 1
            del horde.jobs[job_id]

    for i in range(args.jobs):
        for queue in (horde.submit_script, horde.progress_script, backend.chats,
                      backend.streams, backend.tokencounts, backend.generates):
            queue.clear()
        job_id = f"soak-{i}"
        roll = rng.random()
        kind = "chat" if roll < 0.6 else ("stream" if roll < 0.8 else "text")
        fault: str | None = None
        group: str | None = None
        if rng.random() < args.fault_rate:
            group = rng.choice(("backend", "horde", "progress" if kind == "stream" else "horde", "pop"))
            fault = rng.choice(
                {"backend": BACKEND_FAULTS, "horde": HORDE_FAULTS,
                 "progress": PROGRESS_FAULTS, "pop": POP_FAULTS}[group]
            )
            injected[f"{group}:{fault}"] += 1
        if kind == "text":
            horde.next_job = text_pop(job_id)
        else:
            horde.next_job = chat_pop(job_id, stream=kind == "stream", long=fault == "overflow")
            if kind == "stream":
                backend.streams.append(sse_chunks("The sky is blue and wide today."))
        if group == "pop":
            horde.pop_fault = fault  # this pass's pop fails; the job is not handed out
        elif group == "horde" and fault is not None:
            horde.submit_script.extend([fault] * (3 if fault in ("unavailable", "rate_limited") else 1))
        elif group == "progress" and fault is not None:
            horde.progress_script.append(fault)
        elif fault == "chat_busy_forever":
            backend.chats.extend(BackendBusy("busy", status=503) for _ in range(200))
        elif fault in ("chat_error", "chat_reset", "chat_500"):
            err = backend_error({"chat_error": "error", "chat_reset": "reset", "chat_500": "server_error"}[fault])
            backend.chats.append(err)
            backend.streams.appendleft(err)
            backend.generates.append(err)
        elif fault == "chat_malformed":
            backend.chats.append({"choices": [{"message": "not an object"}]})
            backend.generates.append({"results": "nope"})
        elif fault == "stream_cut":
            backend.streams.clear()
            backend.streams.append(sse_chunks("The sky is blue and wide today.")[:3])
            backend.chats.append({"choices": []})
        elif fault == "tokencount_error":
            backend.tokencounts.append(backend_error("error"))
        worker.run_once()
        backend.open_streams.clear()
        if worker.state.chat_enabled != was_enabled:
            withdrawals += 0 if worker.state.chat_enabled else 1
            was_enabled = worker.state.chat_enabled
        tally()
        if i + 1 == args.warmup:
            gc.collect()
            base_rss = rss_bytes() // 1024
    tally(final=True)
    gc.collect()
    end_rss = rss_bytes() // 1024
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    popped = sum(verdicts.values())
    print(f"soak: {args.jobs} pop passes, fault rate {args.fault_rate:.0%}, seed {args.seed}")
    print(f"  wall time                 {seconds:.1f} s ({args.jobs / seconds:.0f} jobs/s); "
          f"fake time {(clock() - 1_000_000.0) / 3600:.1f} h")
    print(f"  jobs popped               {popped}")
    print(f"  submitted ok              {verdicts['submitted']}")
    print(f"  faulted                   {verdicts['faulted']}")
    for reason, count in sorted(fault_reasons.items()):
        print(f"    fault_reason {reason:<24} {count}")
    print(f"  not submitted (cancel)    {verdicts['cancelled']}")
    print(f"  not submitted (ended)     {verdicts['ended']}  (404, AbortedGen: the Horde ended it)")
    print(f"  expired (Horde down)      {verdicts['expired']}")
    print(f"  double submits            {doubles + late}  (must be 0)")
    print(f"  lost jobs                 {verdicts['lost']}  (must be 0)")
    print(f"  chat withdrawals          {withdrawals}  (text jobs sent instead of chat: "
          f"{horde.text_instead})")
    print(f"  worker stats              jobs={worker.state.stats.jobs} faults={worker.state.stats.faults} "
          f"dropped={worker.state.stats.dropped}")
    print(f"  peak RSS                  {peak_kib / 1024:.1f} MiB")
    print(f"  RSS growth after warm-up  {(end_rss - base_rss) / 1024:+.2f} MiB "
          f"({base_rss / 1024:.1f} -> {end_rss / 1024:.1f} MiB over {args.jobs - args.warmup} jobs)")
    print("  injected faults:")
    for name, count in sorted(injected.items()):
        print(f"    {name:<34} {count}")
    print("reproduce: " + reproduce(
        "soak.py", f"--jobs {args.jobs} --fault-rate {args.fault_rate} --seed {args.seed}"
    ))
    return 1 if doubles or late or verdicts["lost"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
