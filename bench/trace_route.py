"""Trace one chat job's route through the package's modules, from the pop to the submit.

Runs the real pop loop once (in-process fakes of the Horde and koboldcpp from
tests/fakes.py) with ``sys.settrace`` on every thread, records each entry into
a function of the package (devkit excluded), and prints the files in the
order the job passes through them, the number of functions and files entered,
and two counts of going back: in sequence (an entry into a file the route had
left, caller or callee), and on the call path (a function calling, through
other files, back into a file that is still waiting for it: a callback or an
import going both ways).

    python bench/trace_route.py
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from koboldcpp_horde_chat.service.loop import Worker  # noqa: E402
from koboldcpp_horde_chat.settings import WorkerSettings  # noqa: E402
from tests.fakes import FakeBackend, FakeClock, FakeHorde, FakeStopEvent  # noqa: E402

PACKAGE = ROOT / "koboldcpp_horde_chat"


def chat_pop(job_id: str) -> dict[str, Any]:
    """A seed-shaped chat job (seed "One chat job in full")."""
    return {
        "payload": {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
            ],
            "temperature": 0.5, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "rep_pen": 1.0, "top_k": 0, "min_p": 0.0, "stop_sequence": ["\nuser:"],
            "max_length": 512, "max_context_length": 2048, "n": 1,
        },
        "id": job_id, "ids": [job_id], "messages": [], "ttl": 150,
        "extra_source_images": None, "skipped": {}, "softprompt": None,
        "model": "koboldcpp/fake", "chat": True,
    }


def trace_one_chat_job() -> list[tuple[str, str, tuple[str, ...]]]:
    """``(file, function, caller files)`` for every entry into a package function
    while the loop pops, serves and submits one chat job (files relative to the
    package; caller files innermost first)."""
    clock = FakeClock()
    horde = FakeHorde(clock, pops=[chat_pop("route-1")])
    worker = Worker(
        WorkerSettings(
            api_key="trace-key-0123456789", worker_name="trace", model_id="koboldcpp/fake",
            backend_max_context_length=4096, max_length=512,
        ),
        horde=horde, backend=FakeBackend(), stop_event=FakeStopEvent(clock),
        clock=clock, wall=clock,
    )
    entries: list[tuple[str, str, tuple[str, ...]]] = []
    lock = threading.Lock()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return None
        file = _ours(frame.f_code.co_filename)
        if file is not None:
            callers = []
            outer = frame.f_back
            while outer is not None:
                caller = _ours(outer.f_code.co_filename)
                if caller is not None:
                    callers.append(caller)
                outer = outer.f_back
            with lock:
                entries.append((file, frame.f_code.co_name, tuple(callers)))
        return None

    threading.settrace(tracer)  # type: ignore[arg-type]
    sys.settrace(tracer)  # type: ignore[arg-type]
    try:
        worker.run_once()
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    assert horde.jobs["route-1"].state == "submitted", "the traced job was not submitted"
    return entries


def _ours(filename: str) -> str | None:
    path = Path(filename)
    if PACKAGE in path.parents and "devkit" not in path.parts:
        return str(path.relative_to(PACKAGE))
    return None


def calls_back(entries: list[tuple[str, str, tuple[str, ...]]]) -> int:
    """Entries into a file that is on the call path below a caller in another file."""
    return sum(
        1 for file, _, callers in entries if callers and callers[0] != file and file in callers[1:]
    )


def returns_to_left_files(
    entries: list[tuple[str, str, tuple[str, ...]]],
) -> tuple[list[str], int]:
    """The files in route order (consecutive entries in one file merged) and how
    many of those visits go back to a file the route had already left."""
    visits: list[str] = []
    for file, _, _ in entries:
        if not visits or visits[-1] != file:
            visits.append(file)
    seen: set[str] = set()
    back = 0
    for file in visits:
        if file in seen:
            back += 1
        seen.add(file)
    return visits, back


def main() -> int:
    entries = trace_one_chat_job()
    visits, back = returns_to_left_files(entries)
    functions = {(file, name) for file, name, _ in entries}
    print("one chat job's route, pop to submit (files in order):")
    print("  " + " -> ".join(visits))
    print(f"functions entered: {len(functions)} in {len(set(visits))} files")
    print(f"back to a file the route had left, in sequence: {back}")
    print(f"back into a file still on the call path: {calls_back(entries)}")
    print("reproduce: python bench/trace_route.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
