"""``koboldcpp-horde-chat demo``: the whole path on this machine, in one command.

Starts the dev Horde on 127.0.0.1, uses the koboldcpp at ``--kcpp-url`` when
one answers and the devkit's scripted koboldcpp otherwise (said plainly),
runs the real standalone worker against them, sends requests as a client
would, prints each request's final status as the requester sees it, and exits
0 when every request reached its expected end. An image request is included
when the backend reports vision (the scripted koboldcpp does). The worker keeps
its job journal in a temporary directory removed at the end, never in the
user's state directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .backend import KoboldClient
from .errors import BackendError, ConfigError
from .settings import DEFAULT_KCPP_URL
from .standalone import (
    KCPP_URL_ENV,
    KCPP_URL_FLAG,
    configure_logging,
    resolve_url,
    run_standalone,
)

DEMO_KEY = "demo-key-0000"
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

Check = Callable[[dict[str, Any]], bool]


@dataclass
class DemoCase:
    """One client request and the end the requester should see."""

    name: str
    kind: str  # "chat" or "text"
    body: dict[str, Any]
    expect: str  # a short description printed beside the outcome
    check: Check
    max_attempts: int = 3
    request_id: str = ""


def _done(status: dict[str, Any]) -> bool:
    return bool(status.get("done")) and not status.get("faulted")


def _content(status: dict[str, Any]) -> str:
    message = status.get("message") or {}
    value = message.get("content") if isinstance(message, dict) else None
    return value if isinstance(value, str) else ""


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def demo_cases(context: int, *, scripted: bool, vision: bool = False) -> list[DemoCase]:
    """The requests the demo sends; ``context`` is the worker's chat context in tokens.

    With ``vision`` (koboldcpp's ``/api/extra/version`` reports it) an image
    request is included: the dev Horde stores the JPEG, the worker fetches it by
    its signed URL and hands it to koboldcpp as a data URL (seed 000 step 5).
    """
    strict = scripted  # a real small model may miss a strict rule; the scripted one must not
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
    cases = [
        DemoCase(
            "plain chat",
            "chat",
            {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 32},
            "done with a reply",
            lambda s: _done(s) and bool(_content(s).strip()),
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
            "done with a reply",
            lambda s: _done(s) and bool(_content(s).strip()),
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
            "done with a get_weather call",
            lambda s: _done(s)
            and any(
                c.get("function", {}).get("name") == "get_weather"
                for c in (s.get("message") or {}).get("tool_calls") or []
            ),
        ),
        DemoCase(
            "tool-history follow-up",
            "chat",
            {"messages": tool_history, "tools": [WEATHER_TOOL], "max_tokens": 64},
            "done with an answer" if scripted else "done",
            _done,
        ),
        DemoCase(
            "json_object",
            "chat",
            {
                "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
                "response_format": {"type": "json_object"},
                "max_tokens": 64,
            },
            "done with a JSON object",
            lambda s: _done(s) and (_is_json_object(_content(s)) or not strict),
        ),
        DemoCase(
            "reasoning reply",
            "chat",
            {
                "messages": [{"role": "user", "content": "Think first: what is 2 + 2?"}],
                "max_tokens": 128,
            },
            "done, reasoning apart from the answer" if scripted else "done",
            lambda s: _done(s)
            and (not strict or bool((s.get("message") or {}).get("reasoning_content"))),
        ),
        DemoCase(
            "does not fit",
            "chat",
            {"messages": [{"role": "user", "content": overflow_text}], "max_tokens": 64},
            "faulted with prompt_overflow",
            lambda s: bool(s.get("faulted"))
            and "prompt_overflow" in (s.get("fault_reasons") or []),
            max_attempts=1,
        ),
        DemoCase(
            "streamed reply",
            "chat",
            {
                "messages": [{"role": "user", "content": "Tell me a short story about a fox."}],
                "max_tokens": 96,
                "stream": True,
            },
            "done, streamed in pieces",
            lambda s: _done(s) and len(s.get("stream") or []) >= 1,
        ),
        DemoCase(
            "text job",
            "text",
            {"prompt": "The capital of France is", "max_length": 24},
            "done with a generation",
            lambda s: bool(s.get("done")) and isinstance(s.get("generation"), str),
        ),
    ]
    if vision:
        cases.append(
            DemoCase(
                "image",
                "chat",
                {
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
                },
                "done, the image seen" if scripted else "done with a reply",
                lambda s: _done(s) and (not strict or "1 image" in _content(s)),
            )
        )
    return cases


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
        "one answers, else a scripted one), send it requests as a client would, and print "
        "how each one ended.",
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


def main(argv: Sequence[str] = ()) -> int:
    """Run the demo; returns 0 when every request reached its expected end, 1 when
    one did not, 2 when the koboldcpp named by ``--kcpp-url`` (or a bad
    ``KCPP_URL``) cannot be used."""
    args = build_parser().parse_args(list(argv))
    from .devkit.horde import DevHorde
    from .devkit.kcpp import ScriptedKoboldcpp

    configure_logging(args.log_level)
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
    if real:
        print(f"Using the koboldcpp at {kcpp_url}.")
    else:
        scripted_kcpp = ScriptedKoboldcpp(token_delay_s=0.02, vision=True)
        scripted_kcpp.start()
        why = "--scripted" if args.scripted else f"No koboldcpp answers at {kcpp_url}"
        kcpp_url = scripted_kcpp.url
        print(
            f"{why}: using the devkit's SCRIPTED koboldcpp at {kcpp_url} "
            "(canned replies, real koboldcpp response shapes)."
        )
    horde = DevHorde(api_keys=(DEMO_KEY,))
    horde.start()
    print(f"Dev Horde at {horde.url}")
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
        cases = demo_cases(
            info.max_context_length, scripted=scripted_kcpp is not None, vision=info.vision
        )
        for case in cases:
            if case.kind == "chat":
                case.request_id = horde.send_chat(
                    case.body, best_effort=True, max_attempts=case.max_attempts
                )
            else:
                case.request_id = horde.send_text(
                    case.body["prompt"], max_length=case.body["max_length"]
                )
        print(f"Sent {len(cases)} requests; starting the worker.\n")
        thread.start()
        finished = horde.wait([c.request_id for c in cases], timeout_s=args.timeout)
        ok = finished
        for case in cases:
            status = horde.status(case.request_id)
            passed = case.check(status)
            ok = ok and passed
            mark = "ok  " if passed else "FAIL"
            print(
                f"[{mark}] {case.name:<24} expected: {case.expect:<36} "
                f"got: {_describe(case, status)}"
            )
        if not finished:
            print(f"\nNot every request finished within {args.timeout:.0f} s.")
        print("\nLedger (every job's terminal action):")
        for entry in horde.ledger:
            reason = f" ({entry.get('fault_reason')})" if entry.get("fault_reason") else ""
            print(f"  job {entry['job_id']}: {entry['kind']} {entry['action']}{reason}")
        print("\nDemo " + ("passed." if ok else "FAILED."))
        return 0 if ok else 1
    finally:
        stop.set()
        thread.join(timeout=10) if thread.is_alive() else None
        horde.stop()
        if scripted_kcpp is not None:
            scripted_kcpp.stop()
        journal.cleanup()
        time.sleep(0)


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig()
    raise SystemExit(main())
