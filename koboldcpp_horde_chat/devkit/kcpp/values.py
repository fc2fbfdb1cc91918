"""What a scripted koboldcpp 1.116.1 says on the wire that does not change: versions,
defaults and limits, error bodies, thinking tags, stop reasons, routes, the
injectable faults.
"""

from __future__ import annotations

import re
from typing import Any, Literal

KAI_API_VERSION = "1.2.5"
"""What ``GET /api/v1/info/version`` reports: a fixed KoboldAI United API version."""

PROTECTED_MODEL_NAME = "koboldcpp/protected-model"
"""``/api/v1/model`` on a password-protected koboldcpp without the right bearer."""

HORDE_GENKEY_PREFIX = "HORDEREQ_"
DEFAULT_CHAT_GENLEN = 1536
"""koboldcpp's ``--defaultgenamt``: the chat budget when the body sets none."""
DEFAULT_KOBOLD_GENLEN = 200
"""The ``/api/v1/generate`` budget when the body sets no ``max_length`` (KoboldAI's default)."""
PROMPT_BATCH_TOKENS = 512
"""koboldcpp processes a prompt in batches of this many tokens (``--batchsize``,
default 512) and hears an abort only between two."""
MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""koboldcpp's ``--maxrequestsize`` default: larger bodies get 500 "Payload is too big"."""
IMAGE_TOKENS = 256
"""Tokens one data-URL image adds to ``prompt_tokens`` when ``vision`` is on (a toy value)."""
BOS_ID = 2
MAX_STOP_SEQUENCES = 256

UNAUTHORIZED_BODY: dict[str, Any] = {
    "detail": {
        "error": "Unauthorized",
        "msg": "Authentication key is missing or invalid.",
        "type": "unauthorized",
    }
}
BUSY_BODY: dict[str, Any] = {
    "detail": {"msg": "Server is busy; please try again later.", "type": "service_unavailable"}
}
BAD_INPUT_BODY: dict[str, Any] = {"detail": {"msg": "Error parsing input.", "type": "bad_input"}}


def too_big_body(max_request_bytes: int) -> dict[str, Any]:
    """koboldcpp's 500 answer to a body over ``--maxrequestsize`` (``koboldcpp.py`` L6422-6431):
    ``{"detail": {"msg": "Payload is too big. Max payload size is 32MB.", "type":
    "bad_input"}}`` (a limit that is not whole MB is given in bytes)."""
    mib = 1024 * 1024
    size = (
        f"{max_request_bytes // mib}MB"
        if max_request_bytes % mib == 0
        else f"{max_request_bytes} bytes"
    )
    message = f"Payload is too big. Max payload size is {size}."
    return {"detail": {"msg": message, "type": "bad_input"}}


TOO_BIG_BODY: dict[str, Any] = too_big_body(MAX_REQUEST_BYTES)

THINK_PAIRS: tuple[tuple[str, str], ...] = (
    ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>thought", "<channel|>"),
)
"""koboldcpp's ``thinkformats``, in its order (1.116.1 ``koboldcpp.py`` L182-186)."""

_CHAT_TAGS = ("<|im_start|>", "<|im_end|>")
_SPECIAL_TAGS = sorted(
    {tag for pair in THINK_PAIRS for tag in pair} | set(_CHAT_TAGS), key=len, reverse=True
)
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in _SPECIAL_TAGS) + ")")

_CORS_HEADERS = (
    ("access-control-allow-origin", "*"),
    ("access-control-allow-methods", "*"),
    (
        "access-control-allow-headers",
        "*, Accept, Content-Type, Content-Length, Cache-Control, Accept-Encoding, "
        "X-CSRF-Token, Client-Agent, X-Fields, Content-Type, Authorization, "
        "X-Requested-With, X-HTTP-Method-Override, apikey, genkey",
    ),
)

# koboldcpp's C++ stop reasons (1.116.1 expose.h L20-27)
STOP_ERROR = -2
STOP_INVALID = -1
STOP_OUT_OF_TOKENS = 0
STOP_EOS = 1
STOP_CUSTOM = 2

Finish = Literal["eos", "length", "stop_sequence", "error"]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The chat template ``/props`` reports by default: a short ChatML one (a model's
own is longer; koboldcpp reports whatever the model file carries)."""

GET_ROUTES: dict[str, str] = {
    "/props": "props",
    "/api/v1/info/version": "info_version",
    "/api/v1/model": "model",
    "/api/extra/version": "version",
    "/api/extra/true_max_context_length": "true_max_context_length",
    "/api/v1/config/max_context_length": "max_context_length",
    "/api/v1/config/max_length": "max_length",
    "/v1/models": "models",
    "/api/extra/perf": "perf",
    "/api/extra/generate/check": "generate_check",
}
"""GET path -> route name used by :meth:`ScriptedKoboldcpp.inject`."""

POST_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/api/v1/generate": "generate",
    "/api/latest/generate": "generate",
    "/api/extra/generate/stream": "generate_stream",
    "/api/extra/tokencount": "tokencount",
    "/api/extra/tokenize": "tokencount",
    "/api/extra/abort": "abort",
    "/api/extra/generate/check": "generate_check",
}
"""POST path -> route name used by :meth:`ScriptedKoboldcpp.inject`."""

ROUTE_NAMES = frozenset(GET_ROUTES.values()) | frozenset(POST_ROUTES.values())


Fault = tuple[int, Any] | str
"""An injected answer: ``(status, body)``, ``"reset"``, ``"hang:<s>"``, ``"truncate"``,
``"stream_cut"``, ``"stream_error"``, ``"no_finish"`` or ``"stall:<s>"`` (see
:meth:`ScriptedKoboldcpp.inject`)."""

STREAM_ERROR_EVENT: dict[str, Any] = {
    "error": {"message": "scripted in-band error", "type": "server_error", "code": 500}
}
"""The in-band error object a ``"stream_error"`` fault sends as one event's data."""
