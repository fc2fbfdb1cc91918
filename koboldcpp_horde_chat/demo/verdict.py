"""The demo's verdict on what the worker did with a case's request, from the dev
Horde's ledger (seed 000, steps 6 to 8), and the case's printed lines. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..horde.codes import CHAT_SUBMIT_INVALID, CHAT_SUBMIT_NONCONFORMANT
from ..translate.submits import FINISH_REASONS
from .cases import DemoCase, _calls, _content, _done

#: The fault reasons the Horde knows (seed 000, step 7).
FAULT_REASONS = frozenset({"prompt_overflow", "reply_refused"})
#: What a submit, once accepted or faulted, ends a job with; anything else in the
#: dev Horde's ledger for a job is a refusal or a mistake.
TERMINAL_ACTIONS = ("submitted", "faulted")


@dataclass
class Verdict:
    """How one case ended: whether the worker did right, what it did, what it did
    wrong and what the model did not do as hoped (one sentence each)."""

    worker_ok: bool
    did: str
    problems: list[str]
    model_notes: list[str]

    def passed(self, *, scripted: bool) -> bool:
        return self.worker_ok and not (scripted and self.model_notes)


def _submit_problems(
    kind: str, body: dict[str, Any], model: str | None, offered: frozenset[str]
) -> list[str]:
    """Seed 000, steps 6 and 8."""
    problems = []
    if kind == "text":
        if not isinstance(body.get("generation"), str):
            problems.append("the text submit has no generation")
        if "message" in body:
            problems.append("the text submit carries a chat message")
        return problems
    message = body.get("message")
    if not isinstance(message, dict):
        return ["the chat submit has no message"]
    if "generation" in body:
        problems.append("the chat submit carries generation beside message")
    if message.get("role", "assistant") != "assistant":
        problems.append(f"message.role is {message.get('role')!r}, not 'assistant'")
    finish = body.get("finish_reason")
    if finish not in FINISH_REASONS:
        problems.append(
            f"finish_reason {finish!r} is not one of stop, length, content_filter, tool_calls"
        )
    if body.get("model_id") != model:
        problems.append(f"model_id {body.get('model_id')!r} is not the assigned model {model!r}")
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is None and not calls:
        problems.append("message.content is null without tool_calls")
    elif content is not None and not isinstance(content, str):
        problems.append("message.content is not a string")
    if finish == "tool_calls" and not calls:
        problems.append("finish_reason tool_calls without tool_calls")
    ids: set[str] = set()
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
            problems.append("a tool call without a function name and string arguments")
            continue
        if name not in offered:
            problems.append(f"a tool call to {name!r}, not a function of the request")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id or call_id in ids:
            problems.append(f"tool call id {call_id!r} is missing or used twice")
        else:
            ids.add(call_id)
    for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 0):
            problems.append(f"{key} {value!r} is not a count of tokens")
    return problems


def _fault_problems(kind: str, body: dict[str, Any], model: str | None) -> list[str]:
    """Seed 000, steps 7 and 8."""
    if kind == "text":
        ok = isinstance(body.get("generation"), str)
        return [] if ok else ["the text fault has no generation"]
    problems = []
    if body.get("model_id") != model:
        problems.append(
            f"the fault's model_id {body.get('model_id')!r} is not the assigned model {model!r}"
        )
    if "message" in body or "generation" in body:
        problems.append("the fault carries a reply")
    reason = body.get("fault_reason")
    if reason is not None and reason not in FAULT_REASONS:
        problems.append(f"fault_reason {reason!r} is not one the Horde knows")
    return problems


def _model_refusal(rc: str | None, message: str) -> bool:
    """The submit was refused for what the model generated, not for what the worker
    built (seed 000, "Submit refusals")."""
    return rc == CHAT_SUBMIT_NONCONFORMANT or (
        rc == CHAT_SUBMIT_INVALID and "not a function of the request" in message
    )


@dataclass
class _Findings:
    """What :func:`judge` found job by job; ``refusals``: the Horde's refusal message
    by job id, ``causes``: the worker's reason for faulting each job, by job id."""

    case: DemoCase
    models: dict[str, str | None]
    refusals: dict[str, str]
    causes: dict[str, str]
    finished: bool
    problems: list[str] = field(default_factory=list)
    excused: list[str] = field(default_factory=list)  # what the model did, per fault it caused
    faults: list[str | None] = field(default_factory=list)
    wrong_faults: list[str] = field(default_factory=list)
    submitted: int = 0

    def job(self, job_id: str, entries: list[dict[str, Any]]) -> None:
        """One job's ledger ``entries``. A fault without a reason for a tool call the
        model wrote, which the Horde would refuse, is the model's doing (seed 000,
        "Submit refusals")."""
        problems, model = self.problems, self.models.get(job_id)
        refusal, why = self.refusals.get(job_id, ""), self.causes.get(job_id, "")
        terminal = [e for e in entries if e["action"] in TERMINAL_ACTIONS]
        short = job_id[:8]
        for e in entries:
            if e["action"] == "expired":
                problems.append(
                    f"job {short} was neither submitted nor faulted before its lease ran out"
                )
            elif e["action"] in ("duplicate", "aborted_gen"):
                problems.append(f"job {short} was submitted again after it ended ({e.get('rc')})")
        if len(terminal) > 1:
            problems.append(f"job {short} has {len(terminal)} terminal actions, not one")
        if not terminal:
            if self.finished and not any(e["action"] == "expired" for e in entries):
                problems.append(f"job {short} was neither submitted nor faulted")
            return
        end = terminal[0]
        body = end.get("body") or {}
        refused = [e for e in entries if e["action"] == "refused"]
        if len(refused) > 1:
            problems.append(f"job {short}'s reply was submitted again after a refusal")
        model_refused = False
        for e in refused:
            if _model_refusal(e.get("rc"), refusal):
                model_refused = True
                self.excused.append(
                    f"the Horde refused the model's reply ({refusal.rstrip('.')})"
                    "; the worker faulted it with reply_refused, as it must"
                )
            else:
                problems.append(f"job {short}'s reply was refused ({e.get('rc')}: {refusal})")
            if end["action"] != "faulted" or end.get("fault_reason") != "reply_refused":
                problems.append(f"job {short} was not faulted with reply_refused after its refusal")
        if end["action"] == "submitted":
            self.submitted += 1
            problems += [
                f"job {short}: {p}"
                for p in _submit_problems(end["kind"], body, model, self.case.offered)
            ]
            return
        reason = end.get("fault_reason")
        self.faults.append(reason)
        if reason is None and why.startswith("generation failed: tool_calls"):
            self.excused.append(
                f"the model wrote a reply no submit can carry ({why.split(': ', 1)[-1]})"
                "; the worker faulted the job, as it must"
            )
        elif not (reason == "reply_refused" and model_refused):
            self.wrong_faults.append(f"{reason}: {why}" if reason and why else reason or why)
        problems += [f"job {short}: {p}" for p in _fault_problems(end["kind"], body, model)]


def judge(
    case: DemoCase, status: dict[str, Any], ledger: Sequence[dict[str, Any]],
    models: dict[str, str | None], *, finished: bool, causes: dict[str, str] | None = None,
) -> Verdict:
    """Judge what the worker did with one case's request.

    ``status``: the requester's view (``DevHorde.status``); ``ledger``: the dev
    Horde's entries for the request's jobs, in order; ``models``: each job's
    assigned model; ``causes``: why the worker faulted each job, by job id.

    Each job needs exactly one terminal action of the seed's shape; a refused
    reply needs a ``reply_refused`` fault after it. A refusal of the model's
    output, or a fault for a reply no submit can carry, is a model note.
    """
    refusals = {r.get("job_id"): str(r.get("message") or "") for r in status.get("refusals") or []}
    found = _Findings(case, models, refusals, causes or {}, finished)
    job_ids = dict.fromkeys(e["job_id"] for e in ledger)
    if finished:  # a job the ledger has no entry for was neither submitted nor faulted
        job_ids.update(dict.fromkeys(status.get("job_ids") or []))
    for job_id in job_ids:
        found.job(job_id, [e for e in ledger if e["job_id"] == job_id])
    problems, faults, submitted = found.problems, found.faults, found.submitted
    if not finished:
        problems.append("the request did not end in time")
    if case.expect_fault is not None:
        if faults != [case.expect_fault] or submitted:
            problems.append(f"one fault with {case.expect_fault} was expected")
        did = (
            _did(faults, submitted) if problems else f"faulted with {case.expect_fault}, as it must"
        )
        return Verdict(not problems, did, problems, [])
    for why in found.wrong_faults:
        problems.append(
            "a job was faulted instead of served"
            + (f" ({why})" if why else " (no reason given: see the WARNING line above)")
        )
    counted = Counter(found.excused).items()
    notes = [text + (f" ({times} times)" if times > 1 else "") for text, times in counted]
    if _done(status):
        note = case.hope(status) if case.hope else None
        if note:
            notes.append(note)
        if status.get("stream") is not None and case.body.get("stream"):
            problems += _stream_problems(status)
    return Verdict(not problems, _did(faults, submitted), problems, notes)


def _stream_problems(status: dict[str, Any]) -> list[str]:
    """The progress posts, joined, must be the submitted text (seed 000, "Streaming
    progress")."""
    posts = status.get("stream") or []
    posted = "".join(p.get("content") or "" for p in posts)
    if posted == _content(status):
        return []
    if not posts:
        return ["the streamed reply was submitted without a progress post"]
    return [f"the progress posts ({_clip(posted, 40)}) are not the submitted content"]


def _did(faults: list[str | None], submitted: int) -> str:
    """E.g. ``"faulted (no reason), then submitted"``."""
    parts = []
    if faults:
        reasons = sorted({r or "no reason" for r in faults})
        times = f" {len(faults)} times" if len(faults) > 1 else ""
        parts.append(f"faulted{times} ({', '.join(reasons)})")
    if submitted:
        parts.append("submitted" if submitted == 1 else f"submitted {submitted} times")
    return ", then ".join(parts) if parts else "nothing"


def _clip(value: object, limit: int) -> str:
    """``null`` for None, else the text quoted, cut to ``limit`` characters with an ellipsis."""
    if value is None:
        return "null"
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return repr(text)


def _describe(case: DemoCase, status: dict[str, Any]) -> str:
    if case.kind == "text":
        return f"generation={_clip(status.get('generation'), 60)}"
    message = status.get("message") or {}
    parts = [f"finish_reason={status.get('finish_reason')}"]
    if message.get("tool_calls"):
        parts.append(f"tool_calls={_calls(status)}")
    if message.get("reasoning_content"):
        parts.append(f"reasoning={_clip(message['reasoning_content'], 40)}")
    parts.append(f"content={_clip(message.get('content'), 60)}")
    if status.get("stream"):
        pieces = [_clip(d.get("content", ""), 24) for d in status["stream"]]
        parts.append(f"arrived in {len(pieces)} progress posts: [{', '.join(pieces)}]")
    return ", ".join(parts)


def _result_lines(
    case: DemoCase, status: dict[str, Any], verdict: Verdict, warnings: int, *, scripted: bool
) -> list[str]:
    """``[ok  ]``/``[FAIL]``, the name, what the worker did and what the requester
    got; then one line per worker problem and per model note; then, when the case
    passed after ``warnings`` WARNING lines, what they were."""
    passed = verdict.passed(scripted=scripted)
    line = f"[{'ok  ' if passed else 'FAIL'}] {case.name:<24} {verdict.did}"
    if _done(status):
        line += ": " + _describe(case, status)
    elif status.get("faulted") and case.expect_fault is None:
        line += "; the request ended faulted"
    lines = [line]
    lines += [f"       worker: {p}" for p in verdict.problems]
    label = "not as expected" if scripted else "model"
    lines += [f"       {label}: {n}" for n in verdict.model_notes]
    if not warnings or not passed:
        return lines
    above = f"       the {warnings} WARNING line{'s' if warnings > 1 else ''} above"
    if case.expect_fault is not None:
        return [*lines, f"{above}: the expected {case.expect_fault} fault"]
    if verdict.model_notes:
        return [*lines, f"{above}: expected, from what the model did (model: above)"]
    return [*lines, f"{above}: said by the worker while it did right"]
