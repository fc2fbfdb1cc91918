"""``koboldcpp-horde-chat demo``: the whole path on this machine, in one command.

Starts the dev Horde on 127.0.0.1, uses the koboldcpp at ``--kcpp-url`` when
one answers and the devkit's scripted koboldcpp otherwise (said plainly),
runs the real standalone worker against them, and sends requests one at a time
as a client would. Each case is a verdict about the worker: every job it popped
ended in exactly one accepted submit or fault of the seed's shape (seed 000,
steps 6 to 8). What the model did not do as the case hoped (no tool call, a
reply cut at max_tokens, JSON that is not an object) is printed apart as a
model note and fails nothing against a real koboldcpp; against the scripted one
every case must be as expected. The image case is sent when koboldcpp reports
vision and named as skipped otherwise. Exit 0 when every case passed. The
worker keeps its job journal in a temporary directory removed at the end, never
in the user's state directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import BackendError, ConfigError
from ..kcpp.client import KoboldClient
from ..service.standalone import (
    KCPP_URL_ENV,
    KCPP_URL_FLAG,
    configure_logging,
    resolve_url,
    run_standalone,
)
from ..settings import DEFAULT_KCPP_URL

DEMO_KEY = "demo-key-0000"
#: The logger the worker's lines reach (the package's), where :class:`FaultCauses` listens.
WORKER_LOGGER = __name__.partition(".")[0]
WEATHER_TOOL = {
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
}

#: An 8x8 baseline JPEG of a colour pattern (542 bytes), sent when the backend reports vision.
DEMO_IMAGE_DATA_URL = "data:image/jpeg;base64," + (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE"
    "BAQEBAQEBAQEBAQEBAQEBAQEBAQEBAT/wAARCAAIAAgDAREAAhEAAxEA/8QAHwAAAAAMAAAAAAAAAAAAAAAAAAEC"
    "AwQFBgcICQoL/8QAtRAAAAAAAAAAogAAAAAAAAAAAPABAgMEBQYHCAkKERITFBUWFxgZGiEiIyQlJicoKSoxMjM0"
    "NTY3ODk6QUJDREVGR0hJSlFSU1RVVldYWVphYmNkZWZnaGlqcXJzdHV2d3h5eoGCg4SFhoeIiYqRkpOUlZaXmJma"
    "oaKjpKWmp6ipqrGys7S1tre4ubrBwsPExcbHyMnK0dLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/9oADAMB"
    "AAIAAwAAPwBKBhAyQZgZB2gOA4FMHZAoJAKBAXQICAEAEB1QfICgaCMDQKHgL4HjEAgFDAZAgvAcLAOBKBwEDUDQ"
    "1A0DRhjA4DAaIGglBYBbBbBCDRBKDSBKCMEAGgwAYAGg2QYoHgqgzgVQPA4FgDQKC2C2BQNAwEYHgcCMDgPBGBAK"
    "CwCwBQICIFgGoCwCIPYFYPcFUFcCgUGceB1gXwXgwDjgaBoLINsCAYBAKDWDqCUQ8DuBsB4HDRxdA0XAKLRaLAIL"
    "QIBgEAoZAoZA4Ci//9k="
)

Hope = Callable[[dict[str, Any]], str | None]


def _hopes_nothing(status: dict[str, Any]) -> str | None:
    """A case's hope when it hopes nothing of the model (a fault is expected)."""
    return None


#: What a chat job's submitted ``finish_reason`` may be (seed 000, step 6).
FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})
#: The fault reasons the Horde knows (seed 000, step 7).
FAULT_REASONS = frozenset({"prompt_overflow", "reply_refused"})
#: What a submit, once accepted or faulted, ends a job with; anything else in the
#: dev Horde's ledger for a job is a refusal or a mistake.
TERMINAL_ACTIONS = ("submitted", "faulted")

#: The demo's opening: what it shows, in three lines.
OPENING = (
    "This demo shows the worker serving an AI Horde: the queue where clients leave "
    "requests and workers take them.",
    "Each request becomes a job: the worker asks koboldcpp for the reply and submits it "
    "to the Horde, once.",
    "A job it cannot serve it faults, telling the Horde why. Each case below judges the "
    "worker; the model is noted apart.",
)


@dataclass
class DemoCase:
    """One client request, what the worker must do with it and what the model is hoped to do.

    ``hope(status)`` returns a plain sentence when the model did not do what the
    case hoped (no tool call, cut at length...), else None: against a real
    koboldcpp that is a note, against the scripted one a failure.
    ``expect_fault`` names the fault reason the worker must give instead of a
    reply (``"prompt_overflow"``). A case with ``skip`` set is not sent; the
    text says why. ``before`` is printed before the case is sent.
    """

    name: str
    kind: str  # "chat" or "text"
    body: dict[str, Any]
    hope: Hope = _hopes_nothing
    expect_fault: str | None = None
    max_attempts: int = 3
    skip: str = ""
    before: str = ""
    request_id: str = ""

    @property
    def offered(self) -> frozenset[str]:
        """The names of the functions the request offers (``tools``)."""
        names = set()
        for tool in self.body.get("tools") or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.add(function["name"])
        return frozenset(names)


@dataclass
class Verdict:
    """How one case ended.

    ``worker_ok``: the worker did what it must (one terminal action of the right
    shape for each job). ``did``: what it did, in a few words. ``problems``:
    what it did wrong, one sentence each. ``model_notes``: what the model did
    not do as hoped, one sentence each (failures only against the scripted
    koboldcpp).
    """

    worker_ok: bool
    did: str
    problems: list[str]
    model_notes: list[str]

    def passed(self, *, scripted: bool) -> bool:
        """True when the case passes: the worker did right, and, against the
        scripted koboldcpp, the model did as hoped too."""
        return self.worker_ok and not (scripted and self.model_notes)


def _done(status: dict[str, Any]) -> bool:
    return bool(status.get("done")) and not status.get("faulted")


def _message(status: dict[str, Any]) -> dict[str, Any]:
    message = status.get("message")
    return message if isinstance(message, dict) else {}


def _content(status: dict[str, Any]) -> str:
    value = _message(status).get("content")
    return value if isinstance(value, str) else ""


def _calls(status: dict[str, Any]) -> list[str]:
    """The names of the functions a reply calls."""
    calls = _message(status).get("tool_calls") or []
    return [c.get("function", {}).get("name") for c in calls if isinstance(c, dict)]


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _cut(status: dict[str, Any], max_tokens: int) -> str:
    """``"; cut at max_tokens N (finish_reason=length)"`` when the reply was cut, else ``""``."""
    if status.get("finish_reason") == "length":
        return f"; its reply was cut at max_tokens {max_tokens} (finish_reason=length)"
    return ""


def _hope_reply(status: dict[str, Any]) -> str | None:
    if _content(status).strip() or _calls(status):
        return None
    return "the model replied with empty text"


def _hope_tool_call(status: dict[str, Any]) -> str | None:
    if "get_weather" in _calls(status):
        return None
    return "the model did not call a tool (small models often don't)" + _cut(status, 128)


def _hope_json_object(status: dict[str, Any]) -> str | None:
    if _is_json_object(_content(status)):
        return None
    return "the model's reply is not a JSON object" + _cut(status, 64)


def _hope_reasoning(status: dict[str, Any]) -> str | None:
    if _message(status).get("reasoning_content"):
        return None
    return "the model wrote no reasoning block (only reasoning models think aloud)"


def _hope_text(status: dict[str, Any]) -> str | None:
    generation = status.get("generation")
    if isinstance(generation, str) and generation.strip():
        return None
    return "the model generated empty text"


def _hope_image_seen(status: dict[str, Any]) -> str | None:
    if "1 image" in _content(status):
        return None
    return "the scripted koboldcpp did not report the image it was sent"


def demo_cases(context: int, *, scripted: bool, vision: bool = False) -> list[DemoCase]:
    """The requests the demo sends; ``context`` is the worker's chat context in tokens.

    The image case is sent only with ``vision`` (koboldcpp's
    ``/api/extra/version`` reports it); without it the case is returned with
    ``skip`` saying why. The dev Horde stores the JPEG, the worker fetches it by
    its signed URL and hands it to koboldcpp as a data URL (seed 000 step 5).
    ``scripted`` makes the hopes that only the scripted koboldcpp can keep
    (an answer quoting the tool result, the image counted).
    """
    overflow_text = "Please summarise this. " + ("lorem ipsum dolor sit amet " * (context // 2))
    tool_history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_12345",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_12345", "content": '{"temp_c": 18, "sky": "clear"}'},
    ]
    image_body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": DEMO_IMAGE_DATA_URL}},
                ],
            }
        ],
        "max_tokens": 64,
    }
    return [
        DemoCase(
            "plain chat",
            "chat",
            {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 32},
            _hope_reply,
        ),
        DemoCase(
            "system prompt",
            "chat",
            {
                "messages": [
                    {"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
                ],
                "temperature": 0.5,
                "max_tokens": 32,
            },
            _hope_reply,
        ),
        DemoCase(
            "tool call",
            "chat",
            {
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "max_tokens": 128,
            },
            _hope_tool_call,
        ),
        DemoCase(
            "tool-history follow-up",
            "chat",
            {"messages": tool_history, "tools": [WEATHER_TOOL], "max_tokens": 64},
            _hope_reply,
        ),
        DemoCase(
            "json_object",
            "chat",
            {
                "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
                "response_format": {"type": "json_object"},
                "max_tokens": 64,
            },
            _hope_json_object,
        ),
        DemoCase(
            "reasoning reply",
            "chat",
            {
                "messages": [{"role": "user", "content": "Think first: what is 2 + 2?"}],
                "max_tokens": 128,
            },
            _hope_reasoning,
        ),
        DemoCase(
            "does not fit",
            "chat",
            {"messages": [{"role": "user", "content": overflow_text}], "max_tokens": 64},
            expect_fault="prompt_overflow",
            max_attempts=1,
            before="The next WARNING is expected: this conversation is longer than the "
            "model's context, and the worker must fault it with prompt_overflow.",
        ),
        DemoCase(
            "streamed reply",
            "chat",
            {
                "messages": [{"role": "user", "content": "Tell me a short story about a fox."}],
                "max_tokens": 96,
                "stream": True,
            },
            _hope_reply,
        ),
        DemoCase(
            "text job",
            "text",
            {"prompt": "The capital of France is", "max_length": 24},
            _hope_text,
        ),
        DemoCase(
            "image",
            "chat",
            image_body,
            _hope_image_seen if scripted else _hope_reply,
            skip=""
            if vision
            else "koboldcpp reports no vision (start it with --mmproj to load a "
            "vision projector and this case runs)",
        ),
    ]


# ----------------------------------------------------------------- the verdict


def _submit_problems(
    kind: str, body: dict[str, Any], model: str | None, offered: frozenset[str]
) -> list[str]:
    """What is wrong with an accepted reply's submit body (seed 000, steps 6 and 8)."""
    if kind == "text":
        problems = []
        if not isinstance(body.get("generation"), str):
            problems.append("the text submit has no generation")
        if "message" in body:
            problems.append("the text submit carries a chat message")
        return problems
    problems = []
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
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            problems.append(f"{key} {value!r} is not a count of tokens")
    return problems


def _fault_problems(kind: str, body: dict[str, Any], model: str | None) -> list[str]:
    """What is wrong with a faulted submit body (seed 000, steps 7 and 8)."""
    if kind == "text":
        return (
            [] if isinstance(body.get("generation"), str) else ["the text fault has no generation"]
        )
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


def _model_refusal(entry: dict[str, Any]) -> bool:
    """True when a refused submit was refused for what the model generated, not for
    what the worker built: a reply not conforming to the request, or a call to a
    function the request does not offer (seed 000, "Submit refusals")."""
    rc = entry.get("rc")
    message = str(entry.get("message") or "")
    return rc == "ChatSubmitNonconformant" or (
        rc == "ChatSubmitInvalid" and "not a function of the request" in message
    )


def judge(
    case: DemoCase,
    status: dict[str, Any],
    ledger: Sequence[dict[str, Any]],
    models: dict[str, str | None],
    *,
    finished: bool,
    causes: dict[str, str] | None = None,
) -> Verdict:
    """Judge what the worker did with one case's request.

    Args:
        case: the case sent.
        status: the requester's view (:meth:`DevHorde.status`), with
            ``refusals`` ``[{"job_id", "rc", "message"}]``.
        ledger: the dev Horde's ledger entries of this request's jobs, in order.
        models: each job id's assigned model.
        finished: whether the request reached an end in time.
        causes: why the worker faulted each job it faulted, by job id, as its
            log line says (``"generation failed: tool_calls[0].function.name
            is missing"``).

    The worker must give each job exactly one terminal action (an accepted
    submit or a fault) of the seed's shape: a chat reply with ``message``,
    ``finish_reason`` and the assigned ``model_id``, tool calls only to the
    offered functions; a text reply with ``generation``; a fault with the
    assigned ``model_id`` and no reply. A refused reply must be followed by a
    ``reply_refused`` fault; when the refusal was about the model's output that
    fault is the worker doing right, and the refusal is a model note; so is a
    fault without a reason whose cause is a reply the model wrote that no
    submit can carry (:func:`unusable_model_output`). A case with
    ``expect_fault`` must end in one fault with that reason; any other fault is
    a problem. The case's ``hope`` gives the model notes.
    """
    problems: list[str] = []
    notes: list[str] = []
    refusal_text = {
        r.get("job_id"): str(r.get("message") or "") for r in status.get("refusals") or []
    }
    job_ids = list(dict.fromkeys(e["job_id"] for e in ledger))
    for job_id in status.get("job_ids") or []:
        if job_id not in job_ids and finished:
            job_ids.append(job_id)
    causes = causes or {}
    faults: list[str | None] = []
    excused: list[str] = []  # what the model did, for each fault it caused
    wrong_faults: list[str] = []
    submitted = 0
    for job_id in job_ids:
        entries = [e for e in ledger if e["job_id"] == job_id]
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
            if finished and not any(e["action"] == "expired" for e in entries):
                problems.append(f"job {short} was neither submitted nor faulted")
            continue
        end = terminal[0]
        body = end.get("body") or {}
        refused = [e for e in entries if e["action"] == "refused"]
        if len(refused) > 1:
            problems.append(f"job {short}'s reply was submitted again after a refusal")
        model_refused = False
        for e in refused:
            text = refusal_text.get(job_id, "")
            if _model_refusal({**e, "message": text}):
                model_refused = True
                excused.append(
                    f"the Horde refused the model's reply ({text.rstrip('.')})"
                    "; the worker faulted it with reply_refused, as it must"
                )
            else:
                problems.append(f"job {short}'s reply was refused ({e.get('rc')}: {text})")
            if end["action"] != "faulted" or end.get("fault_reason") != "reply_refused":
                problems.append(f"job {short} was not faulted with reply_refused after its refusal")
        if end["action"] == "submitted":
            submitted += 1
            problems += [
                f"job {short}: {p}"
                for p in _submit_problems(end["kind"], body, models.get(job_id), case.offered)
            ]
        else:
            reason = end.get("fault_reason")
            faults.append(reason)
            why = causes.get(job_id, "")
            if reason is None and unusable_model_output(why):
                excused.append(
                    f"the model wrote a reply no submit can carry ({why.split(': ', 1)[-1]})"
                    "; the worker faulted the job, as it must"
                )
            elif not (reason == "reply_refused" and model_refused):
                wrong_faults.append(f"{reason}: {why}" if reason and why else reason or why)
            problems += [
                f"job {short}: {p}" for p in _fault_problems(end["kind"], body, models.get(job_id))
            ]
    if not finished:
        problems.append("the request did not end in time")
    if case.expect_fault is not None:
        if faults != [case.expect_fault] or submitted:
            problems.append(f"one fault with {case.expect_fault} was expected")
        did = (
            f"faulted with {case.expect_fault}, as it must"
            if not problems
            else _did(faults, submitted)
        )
        return Verdict(not problems, did, problems, notes)
    for why in wrong_faults:
        problems.append(
            "a job was faulted instead of served"
            + (f" ({why})" if why else " (no reason given: see the WARNING line above)")
        )
    for text in dict.fromkeys(excused):
        times = excused.count(text)
        notes.append(text + (f" ({times} times)" if times > 1 else ""))
    if _done(status):
        note = case.hope(status)
        if note:
            notes.append(note)
        if status.get("stream") is not None and case.body.get("stream"):
            problems += _stream_problems(status)
    return Verdict(not problems, _did(faults, submitted), problems, notes)


def unusable_model_output(why: str) -> bool:
    """True when the worker's reason for a fault without ``fault_reason`` is a
    reply the model wrote that no submit can carry: a tool call koboldcpp
    returned without a function name, or not shaped as a function call
    (``"generation failed: tool_calls[0].function.name is missing"``). The Horde
    refuses such a call (seed 000, "Submit refusals"), so faulting the job is
    the worker doing right."""
    return why.startswith("generation failed: tool_calls")


def _stream_problems(status: dict[str, Any]) -> list[str]:
    """A streamed reply's progress posts, joined, are its submitted text (seed 000,
    "Streaming progress": everything the client reads as it arrives is the reply)."""
    posts = status.get("stream") or []
    posted = "".join(p.get("content") or "" for p in posts)
    content = _content(status)
    if posted == content:
        return []
    if not posts:
        return ["the streamed reply was submitted without a progress post"]
    return [f"the progress posts ({_clip(posted, 40)}) are not the submitted content"]


def _did(faults: list[str | None], submitted: int) -> str:
    """What the worker did, in a few words: ``"submitted"``,
    ``"faulted 3 times (reply_refused)"``, ``"faulted (no reason), then submitted"``."""
    parts = []
    if faults:
        reasons = sorted({r or "no reason" for r in faults})
        times = f" {len(faults)} times" if len(faults) > 1 else ""
        parts.append(f"faulted{times} ({', '.join(reasons)})")
    if submitted:
        parts.append("submitted" if submitted == 1 else f"submitted {submitted} times")
    return ", then ".join(parts) if parts else "nothing"


def _clip(value: object, limit: int) -> str:
    """``value`` as shown in a result line: ``null`` for None, else its text in
    quotes, cut to ``limit`` characters with an ellipsis when it is longer."""
    if value is None:
        return "null"
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return repr(text)


def _describe(case: DemoCase, status: dict[str, Any]) -> str:
    if case.kind == "text":
        return f"generation={_clip(status.get('generation'), 60)}"
    if status.get("faulted"):
        return f"faulted, fault_reasons={status.get('fault_reasons')}"
    message = status.get("message") or {}
    parts = [f"finish_reason={status.get('finish_reason')}"]
    if message.get("tool_calls"):
        calls = [c.get("function", {}).get("name") for c in message["tool_calls"]]
        parts.append(f"tool_calls={calls}")
    if message.get("reasoning_content"):
        parts.append(f"reasoning={_clip(message['reasoning_content'], 40)}")
    parts.append(f"content={_clip(message.get('content'), 60)}")
    if status.get("stream"):
        pieces = [_clip(d.get("content", ""), 24) for d in status["stream"]]
        parts.append(f"arrived in {len(pieces)} progress posts: [{', '.join(pieces)}]")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``koboldcpp-horde-chat demo``."""
    parser = argparse.ArgumentParser(
        prog="koboldcpp-horde-chat demo",
        description="Run the worker against a local dev Horde and a koboldcpp (yours when "
        "one answers, else a scripted one), send it requests as a client would, and judge "
        "what the worker did with each; what the model said is noted apart.",
    )
    parser.add_argument(
        "--kcpp-url",
        default=None,
        help=f"a running koboldcpp to use (default: KCPP_URL, else {DEFAULT_KCPP_URL}; "
        "when none answers at the default the scripted koboldcpp is used)",
    )
    parser.add_argument(
        "--scripted", action="store_true", help="use the scripted koboldcpp even if one runs"
    )
    parser.add_argument(
        "--kcpp-password",
        default=os.environ.get("KCPP_PASSWORD", ""),
        help="your koboldcpp's --password (or the KCPP_PASSWORD environment variable)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for every request to end, in all (default 300)",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log level of the worker's and the dev Horde's lines (default WARNING)",
    )
    return parser


#: The worker's line for a faulted job (``job=<id> kind=chat faulted (<reason>): <why>``).
FAULT_LINE = re.compile(r"job=(\S+) kind=\w+ faulted(?: \(\w+\))?: (.*)")


class FaultCauses(logging.Handler):
    """Keeps why the worker faulted each job (``causes``: job id -> why), read
    from its WARNING lines while the demo runs it in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.causes: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = FAULT_LINE.match(record.getMessage())
        if match:
            self.causes[match.group(1)] = match.group(2)


def _say(text: str = "") -> None:
    """Print a line of the demo's report at once (the worker's log lines go to
    stderr between them, in the order they happen)."""
    print(text, flush=True)


def _result_lines(
    case: DemoCase, status: dict[str, Any], verdict: Verdict, *, scripted: bool
) -> list[str]:
    """The case's lines: ``[ok  ]``/``[FAIL]``, its name, what the worker did and
    what the requester got; then one line per worker problem and per model note."""
    mark = "ok  " if verdict.passed(scripted=scripted) else "FAIL"
    line = f"[{mark}] {case.name:<24} {verdict.did}"
    if _done(status):
        line += ": " + _describe(case, status)
    elif status.get("faulted") and case.expect_fault is None:
        line += "; the request ended faulted"
    lines = [line]
    lines += [f"       worker: {p}" for p in verdict.problems]
    label = "not as expected" if scripted else "model"
    lines += [f"       {label}: {n}" for n in verdict.model_notes]
    return lines


def _wait(horde: Any, request_id: str, deadline: float, worker: threading.Thread) -> bool:
    """Wait for one request to end, until ``deadline`` (monotonic) or the worker stops."""
    while True:
        left = deadline - time.monotonic()
        if horde.wait([request_id], timeout_s=max(0.0, min(left, 0.5))):
            return True
        if left <= 0 or not worker.is_alive():
            return False


def main(argv: Sequence[str] = ()) -> int:
    """Run the demo; returns 0 when the worker did right in every case (and,
    against the scripted koboldcpp, every reply was as expected), 1 when not,
    2 when the koboldcpp named by ``--kcpp-url`` (or a bad ``KCPP_URL``) cannot
    be used."""
    args = build_parser().parse_args(list(argv))
    from ..devkit.horde import DevHorde
    from ..devkit.kcpp import ScriptedKoboldcpp

    configure_logging(args.log_level)
    fault_causes = FaultCauses()
    scripted_kcpp: ScriptedKoboldcpp | None = None
    explicit = args.kcpp_url is not None
    try:
        kcpp_url = resolve_url(args.kcpp_url, KCPP_URL_FLAG, KCPP_URL_ENV, DEFAULT_KCPP_URL)
    except ConfigError as exc:
        print(f"{exc}. Fix it, or run the demo with --scripted.")
        return 2
    real = False
    if not args.scripted:
        try:
            real = KoboldClient(kcpp_url, args.kcpp_password, connect_timeout_s=2.0).ready()
        except BackendError:
            real = False
        if not real and explicit:
            print(
                f"No koboldcpp answers at {kcpp_url}. Start it, or run the demo with "
                "--scripted to use the devkit's scripted koboldcpp."
            )
            return 2
    for line in OPENING:
        _say(line)
    _say()
    if real:
        _say(f"Using the koboldcpp at {kcpp_url}.")
    else:
        scripted_kcpp = ScriptedKoboldcpp(token_delay_s=0.02, vision=True)
        scripted_kcpp.start()
        why = "--scripted" if args.scripted else f"No koboldcpp answers at {kcpp_url}"
        kcpp_url = scripted_kcpp.url
        _say(
            f"{why}: using the devkit's SCRIPTED koboldcpp at {kcpp_url} "
            "(canned replies, real koboldcpp response shapes)."
        )
    scripted = scripted_kcpp is not None
    horde = DevHorde(api_keys=(DEMO_KEY,))
    horde.start()
    _say(f"Dev Horde at {horde.url}")
    stop = threading.Event()
    result: dict[str, int] = {}
    journal = tempfile.TemporaryDirectory(
        prefix="koboldcpp-horde-chat-demo-", ignore_cleanup_errors=True
    )
    worker_args = [
        "--hordekey",
        DEMO_KEY,
        "--hordeworkername",
        "demo-worker",
        "--horde-url",
        horde.url,
        "--kcpp-url",
        kcpp_url,
        "--hordegenlen",
        "256",
        "--journal-dir",
        journal.name,
        "--log-level",
        args.log_level,
    ]
    if args.kcpp_password:
        worker_args += ["--kcpp-password", args.kcpp_password]
    thread = threading.Thread(
        target=lambda: result.setdefault("code", run_standalone(worker_args, stop_event=stop)),
        name="demo-worker",
        daemon=True,
    )
    try:
        info = KoboldClient(kcpp_url, args.kcpp_password).info()
        cases = demo_cases(info.max_context_length, scripted=scripted, vision=info.vision)
        sent = [c for c in cases if not c.skip]
        if scripted:
            _say(
                "Each case passes when the worker did right and the scripted reply is as expected."
            )
        else:
            _say(
                "Each case passes when the worker did right; what your model did not do "
                '("model:") does not fail it.'
            )
        _say(f"Starting the worker; {len(sent)} requests follow, one at a time.\n")
        logging.getLogger(WORKER_LOGGER).addHandler(fault_causes)
        thread.start()
        deadline = time.monotonic() + args.timeout
        failed: list[str] = []
        notes = 0
        for case in cases:
            if case.skip:
                _say(f"[skip] {case.name:<24} {case.skip}")
                continue
            if case.before:
                _say(f"       {case.before}")
            if case.kind == "chat":
                case.request_id = horde.send_chat(
                    case.body, best_effort=True, max_attempts=case.max_attempts
                )
            else:
                case.request_id = horde.send_text(
                    case.body["prompt"], max_length=case.body["max_length"]
                )
            finished = _wait(horde, case.request_id, deadline, thread)
            status = horde.status(case.request_id)
            ledger = [e for e in horde.ledger if e["request_id"] == case.request_id]
            models = {e["job_id"]: (horde.job(e["job_id"]) or {}).get("model") for e in ledger}
            verdict = judge(
                case, status, ledger, models, finished=finished, causes=fault_causes.causes
            )
            for line in _result_lines(case, status, verdict, scripted=scripted):
                _say(line)
            notes += len(verdict.model_notes)
            if not verdict.passed(scripted=scripted):
                failed.append(case.name)
        if not thread.is_alive() and "code" in result:
            _say(f"\nThe worker stopped with exit code {result['code']}; see its lines above.")
        _say("\nLedger (what the dev Horde recorded for each job):")
        for entry in horde.ledger:
            reason = f" ({entry.get('fault_reason')})" if entry.get("fault_reason") else ""
            rc = f" ({entry.get('rc')})" if entry.get("rc") else ""
            _say(f"  job {entry['job_id']}: {entry['kind']} {entry['action']}{reason}{rc}")
        skipped = [c.name for c in cases if c.skip]
        extra = []
        if notes and not scripted:
            extra.append(
                f"{notes} model note{'s' if notes > 1 else ''}: what the model did, not the worker"
            )
        if skipped:
            extra.append(f"skipped: {', '.join(skipped)}")
        tail = f" ({'; '.join(extra)})" if extra else ""
        if failed:
            _say(f"\nDemo FAILED: {', '.join(failed)}.{tail}")
            return 1
        _say(f"\nDemo passed: the worker did right in all {len(sent)} cases.{tail}")
        return 0
    finally:
        stop.set()
        thread.join(timeout=10) if thread.is_alive() else None
        logging.getLogger(WORKER_LOGGER).removeHandler(fault_causes)
        horde.stop()
        if scripted_kcpp is not None:
            scripted_kcpp.stop()
        journal.cleanup()
        time.sleep(0)
