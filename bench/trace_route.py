"""Trace one chat job's route through the package's modules, from the pop to the submit.

Runs one pass of the real pop loop with ``sys.settrace`` on every thread and
records each entry into a function of the package (devkit excluded). By
default the worker uses its real HTTP clients against the dev Horde and the
scripted koboldcpp on 127.0.0.1; ``--fakes`` swaps them for the in-process
fakes of bench/harness/fakes.py (the route without the clients' own modules).

It prints the files in the order the job passes through them (consecutive
entries into one file merged), the functions and files entered, and three
counts of going back to a file, over the whole pass (the pop gate, the pop
body, the pop, the job, the submit) and from the pop's answer on:

- in sequence: a visit to a file the route had been in before, whatever lies
  between (a return to a waiting caller that then calls one of its own
  helpers counts);
- after leaving it: an entry into a file the route had been in before and
  that no function on the call path belongs to any more (a caller waiting
  for its callee has not been left);
- on the call path: an entry into a file still waiting for a callee in
  another file (a callback, or imports going both ways).

    python bench/trace_route.py            # real clients over HTTP
    python bench/trace_route.py --fakes    # in-process fakes
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from koboldcpp_horde_chat.service.loop import Worker  # noqa: E402
from koboldcpp_horde_chat.settings import WorkerSettings  # noqa: E402
from koboldcpp_horde_chat.state.shared import WorkerState  # noqa: E402

PACKAGE = ROOT / "koboldcpp_horde_chat"
KEY = "trace-key-0123456789"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
]

#: ``(file, function, files on the call path innermost first)``, files relative to the package.
Entry = tuple[str, str, tuple[str, ...]]


def chat_pop(job_id: str) -> dict[str, Any]:
    """A seed-shaped chat job (seed "One chat job in full")."""
    return {
        "payload": {
            "messages": MESSAGES,
            "temperature": 0.5, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "rep_pen": 1.0, "top_k": 0, "min_p": 0.0, "stop_sequence": ["\nuser:"],
            "max_length": 512, "max_context_length": 2048, "n": 1,
        },
        "id": job_id, "ids": [job_id], "messages": [], "ttl": 150,
        "extra_source_images": None, "skipped": {}, "softprompt": None,
        "model": "koboldcpp/fake", "chat": True,
    }


def trace_over_fakes() -> list[Entry]:
    """One pass of the loop serving one chat job on the in-process fakes."""
    from harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeStopEvent

    clock = FakeClock()
    horde = FakeHorde(clock, pops=[chat_pop("route-1")])
    settings = WorkerSettings(
        api_key=KEY, worker_name="trace", model_id="koboldcpp/fake",
        backend_max_context_length=4096, max_length=512,
    )
    worker = Worker(
        settings, horde=horde, backend=FakeBackend(),
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )
    entries = traced(worker.run_once)
    assert horde.jobs["route-1"].state == "submitted", "the traced job was not submitted"
    return entries


def trace_over_http() -> list[Entry]:
    """One pass of the loop serving one chat job with the worker's real HTTP
    clients against the dev Horde and the scripted koboldcpp on 127.0.0.1."""
    from koboldcpp_horde_chat.devkit.horde import DevHorde
    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
    from koboldcpp_horde_chat.hosts.hosting import horde_client, kcpp_client

    with DevHorde(api_keys=(KEY,)) as horde, ScriptedKoboldcpp(max_context_length=4096) as kcpp:
        settings = WorkerSettings(
            api_key=KEY, worker_name="trace", model_id="koboldcpp/scripted",
            backend_max_context_length=4096, max_length=512,
            horde_url=horde.url, kcpp_url=kcpp.url,
        )
        request_id = horde.send_chat({"messages": MESSAGES, "max_tokens": 64})
        worker = Worker(
            settings, horde=horde_client(settings), backend=kcpp_client(settings),
            abort_backend=kcpp_client(settings), state=WorkerState(settings),
        )
        entries = traced(worker.run_once)
        state = horde.status(request_id)["state"]
    assert state == "done", f"the traced job was not served ({state})"
    return entries


def traced(call: Callable[[], object]) -> list[Entry]:
    """Every entry into a package function (devkit excluded) while ``call()`` runs,
    on any thread."""
    entries: list[Entry] = []
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

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return entries


def _ours(filename: str) -> str | None:
    path = Path(filename)
    if PACKAGE in path.parents and "devkit" not in path.parts:
        return str(path.relative_to(PACKAGE))
    return None


def visits(entries: list[Entry]) -> list[str]:
    """The files in route order, consecutive entries into one file merged."""
    files: list[str] = []
    for file, _, _ in entries:
        if not files or files[-1] != file:
            files.append(file)
    return files


def back_in_sequence(entries: list[Entry]) -> int:
    """Visits to a file the route had been in before."""
    seen: set[str] = set()
    back = 0
    for file in visits(entries):
        back += file in seen
        seen.add(file)
    return back


def back_after_leaving(entries: list[Entry]) -> list[tuple[str, str]]:
    """``(file, function)`` of each entry into a file the route had been in before
    and has no function on the call path any more."""
    seen: set[str] = set()
    previous = None
    back = []
    for file, name, callers in entries:
        if file != previous and file in seen and file not in callers:
            back.append((file, name))
        seen.add(file)
        previous = file
    return back


def calls_back(entries: list[Entry]) -> int:
    """Entries into a file that is on the call path below a caller in another file."""
    return sum(
        1 for file, _, callers in entries if callers and callers[0] != file and file in callers[1:]
    )


def from_the_pop_answer(entries: list[Entry]) -> list[Entry]:
    """The entries from the loop's handling of the pop's answer on."""
    start = next(i for i, (_, name, _) in enumerate(entries) if name == "_after_pop")
    return entries[start:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fakes", action="store_true", help="in-process fakes, not HTTP")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list each entry that goes back after leaving its file")
    args = parser.parse_args()
    entries = trace_over_fakes() if args.fakes else trace_over_http()
    where = "in-process fakes" if args.fakes else "real clients over HTTP (dev Horde, scripted koboldcpp)"
    functions = {(file, name) for file, name, _ in entries}
    print(f"one chat job's route, one pass of the pop loop, {where} (files in order):")
    print("  " + " -> ".join(visits(entries)))
    print(f"functions entered: {len(functions)} in {len(set(visits(entries)))} files")
    print("back to a file the route had been in:   whole pass   from the pop's answer")
    after = from_the_pop_answer(entries)
    print(f"  in sequence                            {back_in_sequence(entries):10d}"
          f"   {back_in_sequence(after):21d}")
    print(f"  after leaving it                       {len(back_after_leaving(entries)):10d}"
          f"   {len(back_after_leaving(after)):21d}")
    print(f"  on the call path                       {calls_back(entries):10d}"
          f"   {calls_back(after):21d}")
    if args.verbose:
        print("entries after leaving the file, from the pop's answer:")
        for file, name in back_after_leaving(after):
            print(f"  {file}: {name}")
    print(f"reproduce: python bench/trace_route.py{' --fakes' if args.fakes else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
