"""The worker's own time and the idle gap, from timed calls.

An :data:`Event` is ``(call, entered, returned, job id)`` on the monotonic
clock: the worker's side notes them in ``timed_worker``'s clients, the servers'
side in ``Servers.call("times")`` (turned into events by :func:`server_calls`).
"""

from __future__ import annotations

from typing import Any

Event = tuple[str, float, float, str | None]
"""(call, entered, returned, job id) on the monotonic clock."""

#: The scripted koboldcpp's paths, by the name of the client call that asks them.
KCPP_CALLS = {
    "/api/extra/tokencount": "tokencount",
    "/v1/chat/completions": "chat",
    "/api/v1/generate": "generate",
}


def server_calls(times: dict[str, Any]) -> tuple[list[Event], list[Event]]:
    """The servers' record (``Servers.call("times")``) as events named like the
    clients' calls: (the Horde's pop, submit, progress..., koboldcpp's tokencount,
    chat and generate)."""
    horde = [(path.rsplit("/", 1)[-1], t0, t1, jid) for path, t0, t1, jid in times["horde"]]
    kcpp: list[Event] = [
        (KCPP_CALLS[path], t0, t1, None) for path, t0, t1, _n in times["kcpp"] if path in KCPP_CALLS
    ]
    return horde, kcpp


def first_spans(events: list[Event]) -> dict[str, tuple[float, float]]:
    """``{call: (entered, returned)}`` of each call's first event."""
    spans: dict[str, tuple[float, float]] = {}
    for name, t0, t1, _ in sorted(events, key=lambda e: e[1]):
        spans.setdefault(name, (t0, t1))
    return spans


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


def client_overheads(horde: list[Event], calls: list[Event]) -> list[dict[str, float]]:
    """Per served job, the worker's own time between the client calls (ms).

    ``horde`` holds the pop, submit and progress calls with their job ids,
    ``calls`` the backend's tokencount, chat and generate. Chat: (tokencount
    entered - pop returned) + (chat entered - tokencount returned) = ``pre``;
    (submit entered - chat returned) = ``post``. Text: (generate entered - pop
    returned) and (submit entered - generate returned). Calls are paired with
    their job by id (pop, submit, progress) and by time (backend calls), so a
    pop sent beside the previous submit is counted right.
    """
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


def server_overheads(times: dict[str, Any]) -> list[dict[str, float]]:
    """Per served job, the gaps seen by the servers (ms): from the Horde's pop answer to
    koboldcpp's tokencount arrival, from tokencount's answer to the chat request's
    arrival, and from the chat answer to the submit's arrival at the Horde. Calls are
    paired with their job as in :func:`client_overheads`."""
    return client_overheads(*server_calls(times))


def idle_gaps(horde: list[Event]) -> list[float]:
    """Gaps (ms) from a submit's end to the next pop's start: at the servers, the Horde
    finishing a submit's answer to the next pop arriving; at the worker, a submit call
    returning to the next pop call.

    A pop that starts before the previous submit ended (the worker pops while its
    submit is in flight) counts as a gap of 0.
    """
    gaps = []
    last_submit_done: float | None = None
    for name, t0, t1, _ in sorted(horde, key=lambda e: e[1]):
        if name == "submit":
            last_submit_done = t1
        elif name == "pop":
            if last_submit_done is not None:
                gaps.append(max(0.0, t0 - last_submit_done) * 1e3)
            last_submit_done = None
    return gaps
