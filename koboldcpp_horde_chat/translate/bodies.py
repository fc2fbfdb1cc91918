"""koboldcpp's request bodies for a popped job (pure; no I/O).

A chat job goes to ``/v1/chat/completions`` with its samplers applied as
sent; a text job's payload goes to ``/api/v1/generate`` unchanged, as
koboldcpp's own worker sends it. Seed sections: "2. Recognise a chat job",
"4. Serve tools and structured output" and "8. Keep serving text jobs".
"""

from __future__ import annotations

from typing import Any

from ..horde.pop import SAMPLER_KEYS, ChatJob, TextJob

PASSTHROUGH_KEYS = (
    "seed",
    "reasoning_effort",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
)
"""Optional chat payload fields forwarded unchanged when present."""

OBJECT_JSON_GRAMMAR = r"""root ::= object
value ::= object | array | string | number | literal
object ::= "{" ws ( member ( "," ws member )* )? "}" ws
member ::= string ":" ws value
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
literal ::= ( "true" | "false" | "null" ) ws
string ::= "\"" char* "\"" ws
char ::= [^"\\\x00-\x1f] | "\\" escape
escape ::= ["\\/bfnrt] | "u" hex hex hex hex
hex ::= [0-9a-fA-F]
number ::= "-"? integer fraction? exponent? ws
integer ::= "0" | [1-9] [0-9]*
fraction ::= "." [0-9]+
exponent ::= [eE] [-+]? [0-9]+
ws ::= ( [ \t\n] [ \t]{0,16} )?
"""
"""A llama.cpp GBNF grammar whose root is one JSON object.

Sent as ``grammar`` in place of ``response_format: {"type": "json_object"}``,
which koboldcpp 1.116/1.117 roots at an array (1.116.1 ``koboldcpp.py`` L4193;
``tests/data/kcpp-samples/json_object_smollm.body``). Whitespace
runs are bounded so that a small model cannot loop on spaces.
"""


def _is_json_object_format(response_format: object) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "json_object"


def chat_request_body(
    job: ChatJob,
    messages: list[dict[str, Any]],
    *,
    genkey: str,
    stream: bool,
    max_context_length: int | None = None,
) -> dict[str, Any]:
    """The body for koboldcpp's ``POST /v1/chat/completions``.

    ``{"messages", "max_tokens": job.max_length, "max_context_length",
    <sampler fields as sent>, "stop": <stop_sequence>, "seed",
    "reasoning_effort", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "genkey", "stream"}`` (optional fields only when the
    payload has them), plus ``"stream_options": {"include_usage": true}`` when
    streaming. ``response_format: {"type": "json_object"}`` is replaced by
    ``"grammar": OBJECT_JSON_GRAMMAR``. Unknown payload keys (``n``...) are not
    forwarded.

    Args:
        job: the chat job.
        messages: the conversation (inline or fetched), image parts ready for koboldcpp.
        genkey: koboldcpp's generation key; starts with ``HORDEREQ_`` so that the
            request does not count as local use.
        stream: ask koboldcpp for Server-Sent Events.
        max_context_length: the context to send koboldcpp, tokens (None: the
            job's ``max_context_length``); see
            :func:`.settings.kcpp_context_keeping_budget`.

    Seed: "2. Recognise a chat job" (apply samplers as sent), "4. Serve tools
    and structured output".
    """
    payload = job.payload
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": job.max_length,
        "max_context_length": (
            job.max_context_length if max_context_length is None else max_context_length
        ),
    }
    for key in SAMPLER_KEYS:
        if key in payload:
            body[key] = payload[key]
    if payload.get("stop_sequence") is not None:
        body["stop"] = payload["stop_sequence"]
    for key in PASSTHROUGH_KEYS:
        if key in payload and payload[key] is not None:
            body[key] = payload[key]
    if _is_json_object_format(body.get("response_format")):
        del body["response_format"]
        body["grammar"] = OBJECT_JSON_GRAMMAR
    body["genkey"] = genkey
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def text_request_body(job: TextJob, *, genkey: str) -> dict[str, Any]:
    """The body for koboldcpp's ``POST /api/v1/generate``: the payload with ``genkey`` set.

    The payload is forwarded unchanged, as koboldcpp's own worker does; the
    job's payload itself is not modified.

    Seed: "8. Keep serving text jobs".
    """
    body = dict(job.payload)
    body["genkey"] = genkey
    return body
