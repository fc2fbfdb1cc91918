"""koboldcpp's request bodies for a popped job (pure; seed "2. Recognise a chat job",
"4. Serve tools and structured output", "8. Keep serving text jobs")."""

from __future__ import annotations

from typing import Any

from ..horde.pop import SAMPLER_KEYS, ChatJob, TextJob

PASSTHROUGH_KEYS = (
    "seed", "reasoning_effort", "tools", "tool_choice", "parallel_tool_calls", "response_format",
)

#: A llama.cpp GBNF grammar whose root is one JSON object, sent in place of
#: response_format json_object, which koboldcpp 1.116/1.117 roots at an array (1.116.1
#: L4193). Whitespace runs are bounded: a small model cannot loop on them.
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


def chat_request_body(job: ChatJob, messages: list[dict[str, Any]], *, genkey: str, stream: bool,
                      max_context_length: int | None = None) -> dict[str, Any]:
    """The body for ``/v1/chat/completions``: the samplers as sent, ``stop``, the
    optional fields present, ``genkey`` (``HORDEREQ_...``: not local use) and
    ``stream`` (with ``include_usage``); json_object becomes :data:`OBJECT_JSON_GRAMMAR`;
    unknown keys are dropped. ``max_context_length``: tokens (None: the job's).
    """
    payload = job.payload
    context = job.max_context_length if max_context_length is None else max_context_length
    body: dict[str, Any] = {
        "messages": messages, "max_tokens": job.max_length, "max_context_length": context,
    }
    body.update({key: payload[key] for key in SAMPLER_KEYS if key in payload})
    if payload.get("stop_sequence") is not None:
        body["stop"] = payload["stop_sequence"]
    body.update({key: payload[key] for key in PASSTHROUGH_KEYS if payload.get(key) is not None})
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        del body["response_format"]
        body["grammar"] = OBJECT_JSON_GRAMMAR
    body.update(genkey=genkey, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def text_request_body(job: TextJob, *, genkey: str) -> dict[str, Any]:
    """A copy of the payload with ``genkey`` set, as koboldcpp's own worker sends it."""
    return {**job.payload, "genkey": genkey}
