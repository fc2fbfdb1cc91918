"""The demo's cases: what each request sends and hopes the model does, and readers
of the requester's status (the dev Horde's ``status()`` shape). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class DemoCase:
    """One client request, what the worker must do with it and what the model is hoped to do.

    ``hope(status)``: a sentence when the model did not do as hoped, else None.
    ``expect_fault``: the fault reason the worker must give instead of a reply.
    ``skip``: why the case is not sent. ``before``: printed before it is sent.
    ``max_attempts`` 2: the worker faults a request twice, then leaves its next
    job to expire, which the dev Horde would end only at its sweep.
    """

    name: str
    kind: str  # "chat" or "text"
    body: dict[str, Any]
    hope: Hope | None = None
    expect_fault: str | None = None
    max_attempts: int = 2
    skip: str = ""
    before: str = ""
    request_id: str = ""

    @property
    def offered(self) -> frozenset[str]:
        """The names of the functions the request's tools offer."""
        return frozenset(tool["function"]["name"] for tool in self.body.get("tools") or [])

    @property
    def features_needed(self) -> list[str]:
        """The chat features a chat case's request needs (``tools``, a JSON format)."""
        needed = ["tools"] if self.body.get("tools") else []
        if "response_format" in self.body:
            needed.append(self.body["response_format"]["type"])
        return needed


def _done(status: dict[str, Any]) -> bool:
    return bool(status.get("done")) and not status.get("faulted")


def _message(status: dict[str, Any]) -> dict[str, Any]:
    message = status.get("message")
    return message if isinstance(message, dict) else {}


def _content(status: dict[str, Any]) -> str:
    value = _message(status).get("content")
    return value if isinstance(value, str) else ""


def _calls(status: dict[str, Any]) -> list[str]:
    calls = _message(status).get("tool_calls") or []
    return [c.get("function", {}).get("name") for c in calls if isinstance(c, dict)]


def _cut(status: dict[str, Any], max_tokens: int) -> str:
    if status.get("finish_reason") == "length":
        return f"; its reply was cut at max_tokens {max_tokens} (finish_reason=length)"
    return ""


def _hope_reply(status: dict[str, Any]) -> str | None:
    ok = _content(status).strip() or _calls(status)
    return None if ok else "the model replied with empty text"


def _hope_tool_call(status: dict[str, Any]) -> str | None:
    if "get_weather" in _calls(status):
        return None
    return "the model did not call a tool (small models often don't)" + _cut(status, 128)


def _hope_json_object(status: dict[str, Any]) -> str | None:
    try:
        if isinstance(json.loads(_content(status)), dict):
            return None
    except ValueError:
        pass
    return "the model's reply is not a JSON object" + _cut(status, 64)


def _hope_reasoning(status: dict[str, Any]) -> str | None:
    ok = _message(status).get("reasoning_content")
    return None if ok else "the model wrote no reasoning block (only reasoning models think aloud)"


def _hope_text(status: dict[str, Any]) -> str | None:
    generation = status.get("generation")
    ok = isinstance(generation, str) and generation.strip()
    return None if ok else "the model generated empty text"


def _hope_image_seen(status: dict[str, Any]) -> str | None:
    ok = "1 image" in _content(status)
    return None if ok else "the scripted koboldcpp did not report the image it was sent"


#: Said before a case whose reply a real model may get wrong in a way the Horde refuses.
MODEL_REFUSAL_WARNINGS = (
    "Two WARNING lines may follow, and are expected if they do: when the model's reply "
    "breaks the request's rules, the Horde refuses it (reply refused) and the worker "
    "faults the job with reply_refused, as it must."
)


#: Said before the case that does not fit.
OVERFLOW_WARNING = (
    "The next WARNING is expected: this conversation is longer than the model's context, "
    "and the worker must fault it with prompt_overflow."
)
#: Why the image case is not sent.
NO_VISION = (
    "koboldcpp reports no vision (start it with --mmproj to load a vision projector and "
    "this case runs)"
)
PARIS = "What is the weather in Paris?"
PARIS_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
#: A conversation after a tool call and its result.
TOOL_HISTORY = [
    {"role": "user", "content": PARIS},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_12345", "type": "function", "function": PARIS_CALL}],
    },
    {"role": "tool", "tool_call_id": "call_12345", "content": '{"temp_c": 18, "sky": "clear"}'},
]
PICTURE = [
    {"type": "text", "text": "What is in this picture?"},
    {"type": "image_url", "image_url": {"url": DEMO_IMAGE_DATA_URL}},
]


def _asks(content: Any, max_tokens: int, *, system: str = "", **extra: Any) -> dict[str, Any]:
    """A chat body of one user message (``content``: text or parts), after ``system`` if given."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return {"messages": messages, **extra, "max_tokens": max_tokens}


def demo_cases(context: int, *, scripted: bool, vision: bool = False) -> list[DemoCase]:
    """The requests the demo sends; ``context``: the worker's chat context, tokens.

    Without ``vision`` the image case is skipped; ``scripted`` adds the hopes
    only the scripted koboldcpp can keep.
    """
    overflow_text = "Please summarise this. " + ("lorem ipsum dolor sit amet " * (context // 2))
    colour = [{"type": "text", "text": "Name one colour."}]
    terse = _asks(colour, 32, system="You are a terse assistant.", temperature=0.5)
    weather = _asks(PARIS, 128, tools=[WEATHER_TOOL], tool_choice="required")
    follow_up = {"messages": TOOL_HISTORY, "tools": [WEATHER_TOOL], "max_tokens": 64}
    as_json = _asks("Describe a cat as JSON.", 64, response_format={"type": "json_object"})
    think = _asks("Think first: what is 2 + 2?", 128)
    story = _asks("Tell me a short story about a fox.", 96, stream=True)
    text = {"prompt": "The capital of France is", "max_length": 24}
    overflow = _asks(overflow_text, 64)
    seen = _hope_image_seen if scripted else _hope_reply
    warned = "" if scripted else MODEL_REFUSAL_WARNINGS
    return [
        DemoCase("plain chat", "chat", _asks("Name one colour.", 32), _hope_reply),
        DemoCase("system prompt", "chat", terse, _hope_reply),
        DemoCase("tool call", "chat", weather, _hope_tool_call, before=warned),
        DemoCase("tool-history follow-up", "chat", follow_up, _hope_reply, before=warned),
        DemoCase("json_object", "chat", as_json, _hope_json_object),
        DemoCase("reasoning reply", "chat", think, _hope_reasoning),
        DemoCase(
            "does not fit", "chat", overflow, expect_fault="prompt_overflow", max_attempts=1,
            before=OVERFLOW_WARNING,
        ),
        DemoCase("streamed reply", "chat", story, _hope_reply),
        DemoCase("text job", "text", text, _hope_text),
        DemoCase("image", "chat", _asks(PICTURE, 64), seen, skip="" if vision else NO_VISION),
    ]
