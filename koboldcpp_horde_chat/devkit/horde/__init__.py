"""The dev Horde: a local Horde serving the chat worker protocol over real HTTP.

A development Horde on 127.0.0.1 for the worker's integration tests, the demo
and other worker authors. It implements the Horde's side of "Serve chat jobs
from a text worker" (seed 000) and the image and messages transports of seed
004, independently of the worker's modules (it imports none of them), so a
test run checks the worker against the contract and not against itself.

Python API (in process)::

    with DevHorde(api_keys=("devkey",)) as h:
        rid = h.send_chat({"messages": [{"role": "user", "content": "Hi"}]})
        ...  # a worker pops from h.url with apikey "devkey"
        h.wait([rid], timeout_s=10)
        h.status(rid)["message"]  # {"role": "assistant", "content": "..."}

Worker routes (``apikey`` header checked; a missing or unknown key answers 401
``InvalidAPIKey``; each key is one owner, and a call for a worker name or a job
of another key's worker answers 403 ``WrongCredentials``):

* ``POST /api/v2/generate/text/pop``: step 1 "Declaration checks and
  withdrawal" (400 ``ChatDeclarationInvalid``; a worker ``name`` over 100
  characters is 400 ``TooLongWorkerName``), the eligibility rules of steps 1,
  4 and 5, the job shapes of step 2 ("One chat job in full") and step 8. As on
  the public AI Horde: a request keeps ``validated_backends: true`` unless its
  client opts out and then goes only to a worker whose ``bridge_agent`` names a
  validated backend (:func:`is_validated_backend`); every answer lists the
  moderator messages for the worker (``messages``, :meth:`DevHorde.add_worker_message`),
  and an answer without a job counts the requests it passed over in
  ``skipped`` (``models``, ``max_context_length``, ``max_length``,
  ``bridge_version``). A worker in maintenance is answered 403
  ``WorkerMaintenance`` (see "Aborted jobs and maintenance" below).
* ``POST /api/v2/generate/text/submit``: steps 6 and 7, "Submit refusals"
  (``ChatSubmitInvalid``, ``ChatModelMismatch``, ``ChatSubmitNonconformant``),
  ``DuplicateGen`` and ``AbortedGen`` (a fault for a job that already ended
  without a reply is answered 200 ``{"reward": 0}``, as on the real Horde); 400
  ``NulByteInPayload`` for a body with
  U+0000 anywhere; 400 input validation (no ``rc``) for a ``state`` outside
  ok, censored, faulted, csam and for a text submit (a text job's, or a chat
  job's fault without ``model_id``) without ``generation``. A worker whose
  backend is not validated earns 0.3 x the reward.
* ``POST /api/v2/generate/text/progress``: "Streaming progress"; a ``delta``
  without ``content`` or ``reasoning_content`` is 400 ``ChatProgressInvalid``.

``latency_s`` delays every answer on these three routes, as a network would.

Client routes (no key needed): ``POST /api/v2/generate/chat/async`` (an OpenAI
chat-completions body plus ``"horde": {"best_effort": bool, "validated_backends":
bool}``) and ``POST /api/v2/generate/text/async`` (``prompt``, ``params``,
``models``, ``validated_backends``) answer 202 ``{"id"}``;
``GET /api/v2/generate/{chat,text}/status/<id>``; ``DELETE
/api/v2/generate/chat/status/<id>`` cancels; ``GET /api/v2/workers/name/<name>``;
``GET /api/v2/dev/ledger``.

A second port (``storage_url``) plays object storage: signed URLs for offloaded
messages (valid 120 s, optionally gzipped) and for images (valid max(ttl, 600)
s; an expired URL or a bad signature answers 403). Both ports log every request
to :attr:`DevHorde.requests_log`.

Images (seed 004): at :meth:`DevHorde.send_chat` each ``image_url`` part, a
base64 data URL or an http(s) URL on 127.0.0.1 (fetched then, at most 3
redirects), is checked against the caps (10 MiB per image, 27 MiB per request,
as sent and as stored) and stored as JPEG on the storage port; the request keeps
only a key. The real Horde re-encodes every image as JPEG (longest side at most
2048); without an image library the dev Horde cannot, so it stores a JPEG whose
longest side is at most 2048 as sent and hands anything else to the
``image_converter`` hook, refusing the request (``ValueError``; 400
``ChatRequestInvalid`` over HTTP) when there is none. At pop a worker declaring
``url`` receives signed URLs, one declaring only ``base64`` receives
``data:image/jpeg;base64,`` URLs, and offloaded messages carry data URLs inline.
A request with images goes only to a worker declaring ``vision`` and ``url`` or
``base64``.

Leases are checked lazily: a job whose lease passed is expired at the next call
that looks at state (any HTTP route, :meth:`status`, :meth:`wait`,
:meth:`worker`, :meth:`job`, :attr:`ledger`).

Aborted jobs and maintenance, as on the real AI Horde: every job of a worker
that ends without a reply is an aborted job of that worker, whether the worker
faulted it (except a fault after a ``ChatSubmitNonconformant`` refusal, counted
apart under ``nonconformant_replies``) or its lease ran out without a submit. A
worker that aborts more than 20 jobs within an hour (a window that starts at
its first pop and starts again at the first aborted job more than an hour
later) is put into maintenance and its count starts again from 0; from then on
every pop it sends is answered 403 ``WorkerMaintenance`` until
:meth:`DevHorde.set_maintenance` ends it. :meth:`DevHorde.worker` shows
``aborted_jobs`` (this window's count), ``uncompleted_jobs`` (every aborted
job) and ``maintenance_mode``.
"""

from __future__ import annotations

import base64
import binascii
import copy
import email.utils
import gzip
import hashlib
import hmac
import http.client
import importlib
import json
import logging
import math
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeGuard
from urllib.parse import urljoin, urlsplit

from koboldcpp_horde_chat.devkit._http import JSONServer, Request, Response

log = logging.getLogger(__name__)

try:  # optional: a test extra; without it the strict json_schema check is skipped
    _jsonschema: Any = importlib.import_module("jsonschema")
except ImportError:  # pragma: no cover - depends on the environment
    _jsonschema = None

__all__ = [
    "CHAT_FEATURES",
    "DevHorde",
    "FAULT_REASON_SENTENCES",
    "FINISH_REASONS",
    "LLM_VALIDATED_BACKENDS",
    "ROUTES",
    "is_validated_backend",
    "parse_bridge_agent",
]

# --- the contract's values ------------------------------------------------------------

#: Routes by the names :meth:`DevHorde.inject` takes ("storage" is any storage GET).
ROUTES: dict[str, str] = {
    "pop": "/api/v2/generate/text/pop",
    "submit": "/api/v2/generate/text/submit",
    "progress": "/api/v2/generate/text/progress",
}
#: Feature and guarantee names the Horde knows (others are ignored, step 1).
CHAT_FEATURES: frozenset[str] = frozenset(
    {
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "tools",
        "json_object",
        "json_schema",
        "vision",
        "reasoning_effort",
        "tools_with_response_format",
        "prompt_overflow_refused",
        "tool_choice_enforced",
        "structured_output_enforced",
    }
)
IMAGE_TRANSPORTS: frozenset[str] = frozenset({"url", "base64", "messages_url"})
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "content_filter", "tool_calls")
#: The fixed sentence the Horde stores for each worker fault reason (step 7).
FAULT_REASON_SENTENCES: dict[str, str] = {
    "prompt_overflow": (
        "The worker could not fit the conversation and the requested reply "
        "into its context."
    ),
    "reply_refused": "The horde refused the reply the worker submitted.",
}
DEFAULT_TTL_S = 150.0
LEASE_CAP_TRUSTED_S = 600.0
LEASE_CAP_UNTRUSTED_S = 200.0
MESSAGES_URL_S = 120.0
MIN_IMAGE_URL_S = 600.0
#: The longest image side the Horde stores, pixels (seed 004: "longest side at most 2048").
MAX_IMAGE_SIDE = 2048
#: Per-image cap, bytes, on the image as sent and as stored (the worker's cap too).
MAX_IMAGE_BYTES = 10 * 1024 * 1024
#: Per-request cap on all images together, bytes, as sent and as stored.
MAX_REQUEST_IMAGE_BYTES = 27 * 1024 * 1024
#: Redirects followed when fetching an http(s) image URL at submit (seed 004).
IMAGE_FETCH_REDIRECTS = 3
IMAGE_FETCH_TIMEOUT_S = 10.0
PROGRESS_MAX_POSTS = 1000
PROGRESS_BYTES_PER_TOKEN = 16
MAX_TOKEN_COUNT = 10_000_000
NATIVE_FINISH_REASON_MAX_CHARS = 32
REASONING_MAX_BYTES = 1024 * 1024
TEXT_DEFAULT_MAX_LENGTH = 512
TEXT_DEFAULT_MAX_CONTEXT = 2048
#: Bridge agent names whose text backends the Horde validates (the set
#: ``LLM_VALIDATED_BACKENDS`` in ``horde/bridge_reference.py`` of Haidra-Org/AI-Horde).
#: A request with ``validated_backends`` (the default) goes only to a worker whose
#: bridge agent name is in this set; every other worker earns 0.3 x the kudos.
LLM_VALIDATED_BACKENDS: frozenset[str] = frozenset(
    {
        "AI Horde Worker",
        "AI Horde Worker~aphrodite~oai",
        "AI Horde Worker~aphrodite~kai",
        "KoboldCppEmbedWorker",
        "TabbyAPI",
    }
)
#: The reward factor of a worker whose backend is not validated.
UNVALIDATED_KUDOS_FACTOR = 0.3
#: The bridge agent of a pop that sends none.
DEFAULT_BRIDGE_AGENT = "unknown:0:unknown"
#: The longest bridge agent a pop may send, characters.
BRIDGE_AGENT_MAX_CHARS = 1000
#: The values a submit's ``state`` may take (the Horde's submit model).
SUBMIT_STATES: tuple[str, ...] = ("ok", "censored", "faulted", "csam")
#: How long a moderator message to a worker stays active by default, seconds (12 h).
WORKER_MESSAGE_S = 12 * 3600.0
#: The longest worker name a pop may send, characters. The real Horde stores at most
#: 100 (the real Horde's horde/classes/base/worker.py: the ``name`` column, and
#: ``check_for_bad_actor``, which cuts a new worker's longer name to 100 and raises
#: its suspicion). Its pop has no check of its own: the worker is registered under
#: the cut name, so later pops under the name as sent find no worker of that name.
#: The dev Horde refuses such a pop outright, with the return code the real Horde
#: gives for the same limit when a worker is renamed (horde/apis/v2/base.py
#: ``WorkerSingle.put``: 400 ``TooLongWorkerName``).
WORKER_NAME_MAX_CHARS = 100
#: A worker that aborts more than this many jobs within one window is put into
#: maintenance (the real Horde's horde/classes/base/worker.py ``log_aborted_job``,
#: outside raid mode).
MAX_ABORTED_JOBS = 20
#: The window of that count, seconds (one hour in ``log_aborted_job``).
ABORTED_JOBS_WINDOW_S = 3600.0
#: What a pop of a worker the dev Horde put into maintenance is told (403 ``WorkerMaintenance``).
MAINTENANCE_MESSAGE = (
    f"This worker is in maintenance: it aborted more than {MAX_ABORTED_JOBS} jobs "
    "within an hour (faulted, or left to expire without a submit). Find out why "
    "before taking jobs again."
)
#: What a pop is told when :meth:`DevHorde.set_maintenance` put its worker into maintenance.
OWNER_MAINTENANCE_MESSAGE = "This worker was put into maintenance by its owner."
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_FINAL_STATES = frozenset({"done", "faulted", "cancelled"})
_IMAGE_MARK = "devhorde-image:"

ImageConverter = Callable[[bytes, str], bytes]
"""``hook(data, declared_media_type) -> JPEG bytes``: the Horde's re-encoding step.

``declared_media_type`` is the data URL's label (``""`` for a fetched URL); the
result must be a JPEG whose longest side is at most :data:`MAX_IMAGE_SIDE`.
"""

_JPEG_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` in pixels from a JPEG's frame header, or None when ``data``
    is not a JPEG (no ``FF D8 FF`` start) or no frame header precedes the first scan."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length field
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or a scan before any frame header
            return None
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if length < 2:
            return None
        if marker in _JPEG_SOF_MARKERS:
            if pos + 9 > len(data) or length < 7:
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            return width, height
        pos += 2 + length
    return None


def _storable_jpeg(data: bytes) -> bool:
    size = jpeg_size(data)
    return size is not None and 0 < max(size) <= MAX_IMAGE_SIDE and min(size) > 0


def _fetch_local_image(url: str, cap: int) -> bytes:
    """GET an http(s) image URL on 127.0.0.1 (at most 3 redirects, at most ``cap``
    bytes). Raises ``ValueError`` for another host, a failure or an oversized body."""
    for _ in range(IMAGE_FETCH_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname != "127.0.0.1":
            raise ValueError("the dev Horde fetches image URLs from 127.0.0.1 only")
        conn_cls = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        conn = conn_cls("127.0.0.1", parts.port, timeout=IMAGE_FETCH_TIMEOUT_S)
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"Accept": "image/*"})
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308):
                location = resp.getheader("Location")
                if not location:
                    raise ValueError(f"image URL redirect {resp.status} without Location")
                url = urljoin(url, location)
                continue
            if resp.status != 200:
                raise ValueError(f"image URL answered HTTP {resp.status}")
            data = resp.read(cap + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise ValueError(f"image URL could not be fetched: {exc}") from None
        finally:
            conn.close()
        if len(data) > cap:
            raise ValueError(f"an image is over the cap of {cap} bytes")
        return data
    raise ValueError(f"image URL redirected more than {IMAGE_FETCH_REDIRECTS} times")


class _ApiError(Exception):
    """An HTTP error answer: ``{"message": ..., "rc": ...}`` plus ``extra`` keys.

    ``rc`` None leaves the key out, as the Horde's input validation answers do.
    """

    def __init__(
        self, status: int, rc: str | None, message: str, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.rc = rc
        self.message = message
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"message": self.message}
        if self.rc is not None:
            out["rc"] = self.rc
        out.update(self.extra)
        return out


def _invalid_input(field_name: str, reason: str) -> _ApiError:
    """The Horde's answer to a body that fails its input model: 400 with
    ``{"message": "Input payload validation failed", "errors": {field: reason}}``
    and no ``rc``."""
    return _ApiError(400, None, "Input payload validation failed", {"errors": {field_name: reason}})


# --- state ----------------------------------------------------------------------------


@dataclass
class _Declaration:
    """A worker's stored pop: text fields and the chat declaration."""

    name: str
    models: list[str]
    max_length: int
    max_context_length: int
    prompt_jobs: bool
    chat_jobs: bool
    features: list[str] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)
    model_id: str | None = None
    image_transports: list[str] = field(default_factory=list)
    bridge_agent: str = DEFAULT_BRIDGE_AGENT

    @property
    def validated(self) -> bool:
        """Whether the Horde validates this worker's backend (its bridge agent's name)."""
        return is_validated_backend(self.bridge_agent)


@dataclass
class _Worker:
    """A worker's record: its last declaration and its counts.

    ``aborted_jobs`` counts this window's aborted jobs (the window starts at
    ``aborted_since``, time.monotonic()); ``uncompleted_jobs`` every aborted job.
    """

    name: str
    decl: _Declaration
    owner_key: str = ""
    nonconformant_replies: int = 0
    aborted_jobs: int = 0
    last_pop: float = 0.0
    aborted_since: float = 0.0
    uncompleted_jobs: int = 0
    maintenance: bool = False
    maintenance_msg: str = ""


@dataclass
class _WorkerMessage:
    """A moderator message shown in the pop answers of one worker, or of all."""

    id: str
    worker: str | None
    message: str
    origin: str | None
    expiry: float  # time.time()


@dataclass
class _ChatSpec:
    """What a chat request needs and how its payload is built (derived at send time)."""

    messages: list[dict[str, Any]]  # developer -> system, images as _IMAGE_MARK keys
    tools: list[dict[str, Any]]
    tool_names: set[str]
    tool_choice: Any
    named_function: str | None
    forwards_tools: bool
    rf_type: str | None  # "json_object" | "json_schema" | None
    schema: dict[str, Any] | None
    schema_strict: bool
    features: set[str]
    guarantees: set[str]
    has_images: bool
    temperature: float
    max_tokens: int | None
    max_context_length: int | None
    model: str | None
    stream: bool
    offload_key: str | None = None


@dataclass
class _Req:
    id: str
    kind: str  # "chat" | "text"
    order: int
    body: dict[str, Any]
    best_effort: bool
    max_attempts: int
    chat: _ChatSpec | None = None
    validated_backends: bool = True
    # text
    prompt: str = ""
    max_length: int = 0
    max_context_length: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    # outcome
    state: str = "waiting"
    restarted: int = 0
    job_ids: list[str] = field(default_factory=list)
    message: dict[str, Any] | None = None
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    generation: str | None = None
    reward: float | None = None
    fault_reasons: list[str] = field(default_factory=list)
    return_code: str | None = None
    return_message: str | None = None
    refusals: list[dict[str, Any]] = field(default_factory=list)
    stream: list[dict[str, Any]] = field(default_factory=list)
    worker: str | None = None
    model: str | None = None


@dataclass
class _Job:
    id: str
    request_id: str
    kind: str
    worker: str
    model: str | None
    limits: dict[str, Any]
    popped_at: float
    lease_until: float
    max_length: int
    stream_progress: bool = False
    action: str | None = None  # terminal: submitted | faulted | cancelled | expired
    last_refusal: tuple[str | None, str] | None = None  # (rc, message)
    last_seq: int = 0
    last_delta: tuple[str, str] = ("", "")
    progress_posts: int = 0
    progress_bytes: int = 0


# --- helpers ----------------------------------------------------------------------------


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# A semantic version whose minor and patch parts may be left out ("2", "2.1", "2.1.3",
# each with an optional -prerelease and +build): how the Horde reads the second
# field of a bridge agent. Numbers have no leading zero.
_NUM = r"(?:0|[1-9][0-9]*)"
_IDENT = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_VERSION = re.compile(
    rf"{_NUM}(?:\.{_NUM}(?:\.{_NUM})?)?"
    rf"(?:-{_IDENT}(?:\.{_IDENT})*)?"
    r"(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)


def _sanitize(text: str) -> str:
    """What the Horde stores of a free-text field: HTML-escaped ``&<>``, stripped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").strip()


def parse_bridge_agent(agent: str) -> tuple[str, str]:
    """``(name, version)`` of a bridge agent ``"<name>:<version>:<anything>"``, as the
    Horde reads it: the stored (sanitized) agent split at its first two colons.

    An agent without two colons, or whose version is not a semantic version
    (minor and patch optional), reads as ``("unknown", "0")``.
    """
    parts = _sanitize(agent).split(":", 2)
    if len(parts) != 3 or not _VERSION.fullmatch(parts[1]):
        return "unknown", "0"
    return parts[0], parts[1]


def is_validated_backend(agent: str) -> bool:
    """True when the bridge agent's name is in :data:`LLM_VALIDATED_BACKENDS`."""
    return parse_bridge_agent(agent)[0] in LLM_VALIDATED_BACKENDS


def _nul_path(obj: Any, path: str = "") -> str | None:
    """Where the first U+0000 sits in a JSON value (a dotted path, ``<root>`` for
    the value itself), or None when there is none. Keys count too."""
    if isinstance(obj, str):
        return (path or "<root>") if "\x00" in obj else None
    if isinstance(obj, dict):
        for key, value in obj.items():
            where = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return where
            found = _nul_path(value, where)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found = _nul_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _rfc822(epoch_s: float) -> str:
    """An absolute time as the Horde writes dates in its answers (RFC 822, UTC)."""
    return email.utils.formatdate(epoch_s)


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _output_kudos(nbytes: int) -> float:
    """The dev Horde's reward: 0.1 kudos per estimated token (4 bytes), floor 20 tokens."""
    tokens = max(20, math.ceil(nbytes / 4))
    return round(tokens / 10, 2)


def _parse_data_url(url: str) -> tuple[str, bytes] | None:
    """``data:<type>;base64,<data>`` -> (media type, bytes), or None when not one."""
    if not url.startswith("data:") or "," not in url:
        return None
    head, _, data = url[5:].partition(",")
    if not head.endswith(";base64"):
        return None
    try:
        return head[: -len(";base64")] or "application/octet-stream", base64.b64decode(
            data, validate=True
        )
    except (binascii.Error, ValueError):
        return None


def _image_parts(messages: list[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield part


def _part_url(part: dict[str, Any]) -> str:
    image = part.get("image_url")
    if isinstance(image, dict):
        return str(image.get("url", ""))
    return str(image or "")


def _set_part_url(part: dict[str, Any], url: str) -> None:
    image = part.get("image_url")
    if isinstance(image, dict):
        image["url"] = url
    else:
        part["image_url"] = {"url": url}


def _validate_chat_body(body: Any) -> None:
    """Check a client's chat request; raises ``ValueError`` naming the field."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}].function.name is required")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        names = {t["function"]["name"] for t in tools or []}
        if name not in names:
            raise ValueError("tool_choice.function.name must name one of the tools")
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be none, auto, required or a function")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format.type must be text, json_object or json_schema")
        if rf.get("type") == "json_schema" and not isinstance(rf.get("json_schema"), dict):
            raise ValueError("response_format.json_schema must be an object")
    for key in ("max_tokens", "max_completion_tokens", "max_context_length"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{key} must be a positive integer")
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        value = body.get(key)
        if value is not None and not _is_number(value):
            raise ValueError(f"{key} must be a number")


# --- the server ------------------------------------------------------------------------


class DevHorde:
    """A local Horde with the chat worker routes, on 127.0.0.1 (see the module docstring).

    Args:
        api_keys: the worker API keys accepted in the ``apikey`` header.
        trusted: whether workers count as trusted (lease cap 600 s, else 200 s).
        offload_bytes: offload a request's messages when their compact JSON (UTF-8
            bytes, images inline) is larger than this; None turns offload off.
        offload_gzip: store offloaded messages gzipped (``Content-Encoding: gzip``)
            when that is smaller.
        host, port: where the Horde port binds (port 0: ephemeral). The storage
            port always binds an ephemeral port on ``host``.
        ttl_s: the job lease in seconds (the pop's ``ttl``), 150 by default.
        lease_cap_s: the longest lease counted from the pop, in seconds; None
            uses 600 (trusted) or 200 (untrusted).
        messages_url_s: how long a ``messages_url`` stays valid, 120 s.
        image_converter: ``hook(data: bytes, media_type: str) -> bytes`` turning an
            image that is not a JPEG of longest side at most 2048 into one (see
            :data:`ImageConverter`). The real Horde converts every image; without
            a hook the dev Horde refuses such an image (``send_chat`` raises
            ``ValueError``, HTTP 400 ``ChatRequestInvalid``).
        image_url_s: how long a signed image URL stays valid, seconds; None (the
            contract) is max(``ttl_s``, 600). A test hook: a negative value signs
            URLs that have already expired.
        latency_s: seconds added to every answer on the worker routes (pop,
            submit, progress), half before the call is processed and half after,
            as a network round trip would (e.g. 0.15 for benchmarks that compare
            workers at a 150 ms round trip). The attribute of that name can be
            changed at any time; the next call uses the new value.
        aborted_jobs_window_s: the window in which more than 20 aborted jobs put
            a worker into maintenance, seconds: one hour, as on the real Horde (a
            test hook: a short window shows the count starting again).
    """

    def __init__(
        self,
        api_keys: Iterable[str] = ("devkey",),
        *,
        trusted: bool = False,
        offload_bytes: int | None = None,
        offload_gzip: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        lease_cap_s: float | None = None,
        messages_url_s: float = MESSAGES_URL_S,
        image_converter: ImageConverter | None = None,
        image_url_s: float | None = None,
        latency_s: float = 0.0,
        aborted_jobs_window_s: float = ABORTED_JOBS_WINDOW_S,
    ) -> None:
        self.api_keys = frozenset(api_keys)
        self.aborted_jobs_window_s = float(aborted_jobs_window_s)
        self.latency_s = float(latency_s)
        self.trusted = trusted
        self.offload_bytes = offload_bytes
        self.offload_gzip = offload_gzip
        self.ttl_s = float(ttl_s)
        self.lease_cap_s = (
            float(lease_cap_s)
            if lease_cap_s is not None
            else (LEASE_CAP_TRUSTED_S if trusted else LEASE_CAP_UNTRUSTED_S)
        )
        self.messages_url_s = float(messages_url_s)
        self.image_converter: ImageConverter | None = image_converter
        self.image_url_s = None if image_url_s is None else float(image_url_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._secret = secrets.token_bytes(32)
        self._requests: dict[str, _Req] = {}
        self._jobs: dict[str, _Job] = {}
        self._workers: dict[str, _Worker] = {}
        self._worker_messages: list[_WorkerMessage] = []
        self._objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self._ledger: list[dict[str, Any]] = []
        self._pops: list[dict[str, Any]] = []
        self._requests_log: list[dict[str, Any]] = []
        self._scripts: dict[str, deque[Any]] = {name: deque() for name in (*ROUTES, "storage")}
        self._order = 0
        self._horde = JSONServer(self._serve_horde, host=host, port=port, name="dev-horde")
        self._storage = JSONServer(self._serve_storage, host=host, port=0, name="dev-storage")

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Bind both ports and serve. Raises ``OSError`` when a bind fails."""
        self._storage.start()
        self._horde.start()
        # Keep the ports: refuse_connections() / accept_connections() rebind them.
        self._storage._port = self._storage.port
        self._horde._port = self._horde.port

    def expire_leases(self) -> list[str]:
        """End the lease of every job still open now, as if its ttl had passed.

        Returns their ids. Each is recorded ``expired`` in the ledger, counts as
        an aborted job of its worker, and its request goes back to the queue (or
        faults after ``max_attempts``), so a test of a lost job need not wait out
        a real lease.
        """
        with self._lock:
            now = time.monotonic()
            ids = [job.id for job in self._jobs.values() if job.action is None]
            for job_id in ids:
                self._jobs[job_id].lease_until = now - 1e-3
            self._expire_locked()
        return ids

    def refuse_connections(self, port: str = "horde") -> None:
        """Close the ``"horde"`` or ``"storage"`` port: connections are refused.

        State (requests, jobs, leases, ledger) is kept; :meth:`accept_connections`
        opens the same port again. Fault injection for a Horde or object store
        that is down.
        """
        (self._horde if port == "horde" else self._storage).stop()

    def accept_connections(self, port: str = "horde") -> None:
        """Open the port closed by :meth:`refuse_connections` again, on the same number."""
        (self._horde if port == "horde" else self._storage).start()

    def stop(self) -> None:
        """Stop both servers and close their connections."""
        self._horde.stop()
        self._storage.stop()

    def __enter__(self) -> DevHorde:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The Horde's base URL, ``http://127.0.0.1:<port>`` (no ``/api``)."""
        if not self._horde.running and self._horde._port:  # during refuse_connections()
            return f"http://{self._horde._host}:{self._horde._port}"
        return self._horde.url

    @property
    def storage_url(self) -> str:
        """The storage port's base URL."""
        if not self._storage.running and self._storage._port:  # during refuse_connections()
            return f"http://{self._storage._host}:{self._storage._port}"
        return self._storage.url

    # -- recorded history ------------------------------------------------------------

    @property
    def ledger(self) -> list[dict[str, Any]]:
        """Every job's terminal or refused action, in order (deep copies).

        Each entry: ``{"job_id", "request_id", "kind": "chat"|"text", "worker",
        "action": "submitted"|"faulted"|"refused"|"duplicate"|"aborted_gen"|
        "late_fault"|"cancelled"|"expired", "status": HTTP status answered (None
        for cancelled and expired), "rc": return code or None, "fault_reason":
        kept reason or None, "body": the submit body or None}``. ``late_fault``
        is a fault for a job that had already ended without a reply (expired,
        faulted or cancelled): answered 200 ``{"reward": 0}``, counted nowhere.
        """
        with self._lock:
            self._expire_locked()
            return copy.deepcopy(self._ledger)

    @property
    def pops(self) -> list[dict[str, Any]]:
        """Every pop received: ``{"worker", "body", "status", "response"}`` (deep copies).

        ``response`` is the JSON answered (None when the connection was reset).
        """
        with self._lock:
            return copy.deepcopy(self._pops)

    @property
    def requests_log(self) -> list[dict[str, Any]]:
        """Every HTTP request on both ports: ``{"port": "horde"|"storage", "method",
        "path", "query", "headers" (lower-case names), "body": bytes, "at":
        time.monotonic() when the request was read}``."""
        with self._lock:
            return copy.deepcopy(self._requests_log)

    def worker(self, name: str) -> dict[str, Any] | None:
        """The worker details the Horde shows (``GET /api/v2/workers/name/<name>``).

        ``{"name", "models", "max_length", "max_context_length",
        "accepts_chat_jobs", "accepts_prompt_jobs", "nonconformant_replies",
        "aborted_jobs" (this window's aborted jobs; 0 again after the window or
        once they put the worker into maintenance), "uncompleted_jobs" (every
        aborted job), "maintenance_mode", "bridge_agent", "chat"?}``; None for a
        worker that never popped. Leases that passed are expired first.
        """
        with self._lock:
            self._expire_locked()
            w = self._workers.get(name)
            return None if w is None else self._worker_details(w)

    def set_maintenance(self, name: str, active: bool, message: str | None = None) -> None:
        """Put worker ``name`` into maintenance or take it out, as its owner can.

        In maintenance every pop of the worker is answered 403 ``WorkerMaintenance``
        with ``message`` (:data:`OWNER_MAINTENANCE_MESSAGE` when None). Taking it out leaves the
        aborted-job count as it is. Raises ``KeyError`` for a worker that never popped.
        """
        with self._lock:
            w = self._workers[name]
            w.maintenance = bool(active)
            w.maintenance_msg = (message or OWNER_MAINTENANCE_MESSAGE) if active else ""
        log.info("worker %s maintenance %s", name, "on" if active else "off")

    def job(self, job_id: str) -> dict[str, Any] | None:
        """A job's state for tests: ``{"id", "request_id", "kind", "worker", "model",
        "action", "lease_remaining_s", "last_seq", "stream_progress"}``."""
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
            if job is None:
                return None
            return {
                "id": job.id,
                "request_id": job.request_id,
                "kind": job.kind,
                "worker": job.worker,
                "model": job.model,
                "action": job.action,
                "lease_remaining_s": job.lease_until - time.monotonic(),
                "last_seq": job.last_seq,
                "stream_progress": job.stream_progress,
            }

    # -- fault injection -------------------------------------------------------------

    def inject(self, route: str, *responses: Any) -> None:
        """Queue scripted answers for the next calls of ``route``.

        ``route`` is ``"pop"``, ``"submit"``, ``"progress"`` or ``"storage"``. Each
        response is used once, in order, then normal service resumes:

        * ``(status, json_body)`` or ``(status, json_body, headers)``: answered as
          is (with those extra headers, e.g. ``{"Retry-After": "2"}``); the call
          is not processed;
        * ``"reset"``: the connection is closed without an answer; not processed;
        * ``"hang:<seconds>"``: sleep, then process and answer normally;
        * ``"truncate"``: process normally, send half the JSON body;
        * ``"drop"``: process normally, close without answering (a lost response);
        * ``"ok"``: process and answer normally.

        Raises ``ValueError`` for an unknown route or response.
        """
        if route not in self._scripts:
            raise ValueError(f"unknown route {route!r}; use one of {sorted(self._scripts)}")
        for item in responses:
            if isinstance(item, tuple):
                if (
                    len(item) not in (2, 3)
                    or not _is_int(item[0])
                    or (len(item) == 3 and not isinstance(item[2], dict))
                ):
                    raise ValueError(
                        f"a scripted answer is (status, json_body[, headers]), not {item!r}"
                    )
            elif isinstance(item, str):
                if item.startswith("hang:"):
                    float(item[5:])
                elif item not in ("reset", "truncate", "drop", "ok"):
                    raise ValueError(f"unknown scripted response {item!r}")
            else:
                raise ValueError(f"unknown scripted response {item!r}")
        with self._lock:
            self._scripts[route].extend(responses)

    # -- client side -----------------------------------------------------------------

    def send_chat(
        self,
        body: dict[str, Any],
        *,
        best_effort: bool = False,
        max_attempts: int = 3,
        validated_backends: bool = True,
    ) -> str:
        """Queue a client's chat request; returns its request id.

        ``body`` holds OpenAI chat-completions fields: ``messages``, ``tools``,
        ``tool_choice``, ``parallel_tool_calls``, ``response_format``,
        ``temperature``, ``top_p``, ``frequency_penalty``, ``presence_penalty``,
        ``seed``, ``stop``, ``max_tokens`` (tokens), ``reasoning_effort``,
        ``stream``, ``model`` (a ``model_id`` to require), plus the Horde's
        optional ``max_context_length`` (tokens). ``best_effort`` opts out of
        strict conformance. ``validated_backends`` (true by default, the Horde's
        documented default) sends the request only to workers whose bridge agent names a
        validated backend (:data:`LLM_VALIDATED_BACKENDS`). The request faults
        for good after ``max_attempts`` faulted or expired jobs. Raises
        ``ValueError`` naming an invalid field, or an image the dev Horde cannot
        store (see the module docstring: a data URL or an http(s) URL on
        127.0.0.1, within the caps, a JPEG of longest side at most 2048 or
        converted by ``image_converter``).
        """
        _validate_chat_body(body)
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        body = copy.deepcopy(body)
        spec = self._chat_spec(body, best_effort=best_effort)
        with self._lock:
            self._order += 1
            req = _Req(
                id=str(uuid.uuid4()),
                kind="chat",
                order=self._order,
                body=body,
                best_effort=best_effort,
                max_attempts=max_attempts,
                chat=spec,
                validated_backends=bool(validated_backends),
            )
            self._requests[req.id] = req
            self._changed.notify_all()
        log.info(
            "chat request %s queued (features=%s, guarantees=%s, offloaded=%s)",
            req.id,
            sorted(spec.features),
            sorted(spec.guarantees),
            spec.offload_key is not None,
        )
        return req.id

    def send_text(
        self,
        prompt: str,
        *,
        max_length: int = 80,
        max_context_length: int = 1024,
        params: dict[str, Any] | None = None,
        models: Iterable[str] | None = None,
        max_attempts: int = 3,
        validated_backends: bool = True,
    ) -> str:
        """Queue a client's text request; returns its request id.

        ``max_length`` and ``max_context_length`` are tokens; ``params`` are extra
        generation parameters copied into the payload; ``models`` restricts the
        workers (empty: any model); ``validated_backends`` as for
        :meth:`send_chat`.
        """
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        with self._lock:
            self._order += 1
            req = _Req(
                id=str(uuid.uuid4()),
                kind="text",
                order=self._order,
                body={"prompt": prompt},
                best_effort=True,
                max_attempts=max_attempts,
                prompt=prompt,
                max_length=int(max_length),
                max_context_length=int(max_context_length),
                params=copy.deepcopy(dict(params or {})),
                models=list(models or []),
                validated_backends=bool(validated_backends),
            )
            self._requests[req.id] = req
            self._changed.notify_all()
        log.info("text request %s queued", req.id)
        return req.id

    def add_worker_message(
        self,
        message: str,
        *,
        worker: str | None = None,
        origin: str | None = "moderator",
        expiry_s: float = WORKER_MESSAGE_S,
    ) -> str:
        """Leave a moderator message for a worker's owner; returns its id.

        Every pop answer of worker ``worker`` (of every worker when None) lists
        it under ``messages`` as ``{"id", "message", "origin", "expiry"}`` until
        ``expiry_s`` seconds from now (``expiry`` is an RFC 822 date; ``origin``
        None leaves the key out).
        """
        item = _WorkerMessage(
            id=str(uuid.uuid4()),
            worker=worker,
            message=str(message),
            origin=origin,
            expiry=time.time() + float(expiry_s),
        )
        with self._lock:
            self._worker_messages.append(item)
        return item.id

    def _messages_for(self, worker: str) -> list[dict[str, Any]]:
        now = time.time()
        out: list[dict[str, Any]] = []
        for m in self._worker_messages:
            if m.expiry <= now or m.worker not in (None, worker):
                continue
            entry: dict[str, Any] = {"id": m.id, "message": m.message}
            if m.origin is not None:
                entry["origin"] = m.origin
            entry["expiry"] = _rfc822(m.expiry)
            out.append(entry)
        return out

    def status(self, request_id: str) -> dict[str, Any]:
        """What the requester sees. Raises ``KeyError`` for an unknown id.

        Chat: ``{"id", "kind": "chat", "done", "faulted", "state":
        "waiting"|"processing"|"done"|"faulted"|"cancelled", "message",
        "finish_reason", "native_finish_reason", "prompt_tokens",
        "completion_tokens", "reasoning_tokens" (null when not sent), "restarted",
        "fault_reasons", "return_code" ("ChatWorkerFault" after a fault with a
        reason), "return_message", "refusals": [{"job_id", "rc", "message"}],
        "stream": [{"seq", "content", "reasoning_content"?}], "worker", "model",
        "reward", "job_ids", "best_effort"}``. Text: ``{"id", "kind": "text", "done",
        "faulted", "state", "generation", "restarted", "worker", "model", "reward",
        "job_ids"}``.
        """
        with self._lock:
            self._expire_locked()
            return self._status_locked(self._requests[request_id])

    def wait(self, request_ids: Iterable[str] | str, timeout_s: float) -> bool:
        """Block until every request is final (done, faulted or cancelled).

        Returns False when ``timeout_s`` seconds passed first. Raises ``KeyError``
        for an unknown id.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for rid in ids:
                if rid not in self._requests:
                    raise KeyError(rid)
            while True:
                self._expire_locked()
                if all(self._requests[r].state in _FINAL_STATES for r in ids):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, 0.05))

    def cancel(self, request_id: str) -> None:
        """The client cancels. Raises ``KeyError`` for an unknown id.

        A waiting request ends cancelled. A streamed job in flight is settled on
        the content posted so far (ledger ``cancelled``); its next progress post
        answers ``cancelled: true`` and a later submit ``AbortedGen``. A job that
        does not stream is not settled: its submit is accepted as usual.
        """
        with self._lock:
            self._expire_locked()
            req = self._requests[request_id]
            if req.state in _FINAL_STATES:
                return
            if req.state == "processing" and req.job_ids:
                job = self._jobs[req.job_ids[-1]]
                if job.action is None and job.stream_progress:
                    job.action = "cancelled"
                    nbytes = sum(
                        len((d.get("content") or "").encode())
                        + len((d.get("reasoning_content") or "").encode())
                        for d in req.stream
                    )
                    req.reward = self._reward(job, nbytes)
                    self._record(job, "cancelled", None, None, None, None)
            req.state = "cancelled"
            self._changed.notify_all()
        log.info("request %s cancelled by the client", request_id)

    # -- derived request data --------------------------------------------------------

    def _chat_spec(self, body: dict[str, Any], *, best_effort: bool) -> _ChatSpec:
        messages: list[dict[str, Any]] = []
        for message in body["messages"]:
            m = copy.deepcopy(message)
            if m.get("role") == "developer":
                m["role"] = "system"  # ADR 0033: a developer message arrives as system
            messages.append(m)
        tools = list(body.get("tools") or [])
        tool_names = {t["function"]["name"] for t in tools}
        choice = body.get("tool_choice")
        named = None
        if isinstance(choice, dict):
            named = choice["function"]["name"]
        forwards_tools = bool(tools) and choice != "none"
        history_tools = any(
            m.get("role") == "tool" or m.get("tool_calls") for m in messages
        )
        rf = body.get("response_format")
        rf_type = rf.get("type") if isinstance(rf, dict) else None
        if rf_type not in ("json_object", "json_schema"):
            rf_type = None
        schema = None
        schema_strict = False
        if rf_type == "json_schema":
            js = rf["json_schema"] if isinstance(rf, dict) else {}
            schema = js.get("schema") if isinstance(js.get("schema"), dict) else None
            schema_strict = js.get("strict") is True
        features: set[str] = set()
        guarantees: set[str] = set()
        if forwards_tools or history_tools:
            features.add("tools")
        if rf_type:
            features.add(rf_type)
        if body.get("seed") is not None:
            features.add("seed")
        for penalty in ("presence_penalty", "frequency_penalty"):
            if body.get(penalty) not in (None, 0, 0.0):  # not OpenAI's default
                features.add(penalty)
        if forwards_tools and rf_type:
            features.add("tools_with_response_format")
        has_images = any(True for _ in _image_parts(messages))
        if has_images:
            features.add("vision")
        if not best_effort:
            guarantees.add("prompt_overflow_refused")
            if forwards_tools and (choice == "required" or named):
                guarantees.add("tool_choice_enforced")
            if rf_type:
                guarantees.add("structured_output_enforced")
        temperature = body.get("temperature")
        spec = _ChatSpec(
            messages=messages,
            tools=tools,
            tool_names=tool_names,
            tool_choice=choice,
            named_function=named,
            forwards_tools=forwards_tools,
            rf_type=rf_type,
            schema=schema,
            schema_strict=schema_strict,
            features=features,
            guarantees=guarantees,
            has_images=has_images,
            temperature=1.0 if temperature is None else float(temperature),
            max_tokens=body.get("max_tokens") or body.get("max_completion_tokens"),
            max_context_length=body.get("max_context_length"),
            model=body.get("model") if isinstance(body.get("model"), str) else None,
            stream=body.get("stream") is True,
        )
        self._store_images(spec)
        self._maybe_offload(spec)
        return spec

    def _store_images(self, spec: _ChatSpec) -> None:
        """Seed 004 at submit: check, convert to JPEG, store each image and mark its part.

        Every image is checked before any is stored. Raises ``ValueError`` for a
        URL that is neither a base64 data URL nor http(s) on 127.0.0.1, a failed
        fetch, an image over the caps, or one that is not a JPEG of longest side
        at most 2048 when no ``image_converter`` is set (or the converter does not
        return one).
        """
        parts = list(_image_parts(spec.messages))
        sent: list[bytes] = []
        stored: list[bytes] = []
        for k, part in enumerate(parts):
            url = _part_url(part)
            scheme = url.split(":", 1)[0].lower()
            if scheme == "data":
                parsed = _parse_data_url(url)
                if parsed is None:
                    raise ValueError(f"image {k + 1}: not a base64 data URL")
                media_type, data = parsed
            elif scheme in ("http", "https"):
                media_type, data = "", _fetch_local_image(url, MAX_IMAGE_BYTES)
            else:
                raise ValueError(f"image {k + 1}: the url must be a data URL or http(s)")
            sent.append(data)
            if _storable_jpeg(data):
                jpeg = data
            elif self.image_converter is None:
                raise ValueError(
                    f"image {k + 1}: the dev Horde stores JPEGs of longest side at most "
                    f"{MAX_IMAGE_SIDE} as sent and needs an image_converter for the rest"
                )
            else:
                jpeg = self.image_converter(data, media_type)
                if not _storable_jpeg(jpeg):
                    raise ValueError(
                        f"image {k + 1}: the image_converter did not return a JPEG of "
                        f"longest side at most {MAX_IMAGE_SIDE}"
                    )
            stored.append(jpeg)
        for what, images in (("sent", sent), ("stored", stored)):
            for k, data in enumerate(images):
                if len(data) > MAX_IMAGE_BYTES:
                    raise ValueError(
                        f"image {k + 1} ({what}) is over the cap of {MAX_IMAGE_BYTES} bytes"
                    )
            if sum(len(d) for d in images) > MAX_REQUEST_IMAGE_BYTES:
                raise ValueError(
                    f"the images ({what}) are over the cap of {MAX_REQUEST_IMAGE_BYTES} "
                    "bytes per request"
                )
        for part, jpeg in zip(parts, stored, strict=True):
            key = f"img-{uuid.uuid4().hex}"
            with self._lock:
                self._objects[key] = (jpeg, {"Content-Type": "application/octet-stream"})
            _set_part_url(part, _IMAGE_MARK + key)

    def _image_keys(self, request_id: str) -> list[str]:
        spec = self._requests[request_id].chat
        if spec is None:
            return []
        return [
            _part_url(part)[len(_IMAGE_MARK) :]
            for part in _image_parts(spec.messages)
            if _part_url(part).startswith(_IMAGE_MARK)
        ]

    def stored_images(self, request_id: str) -> list[bytes]:
        """The JPEG bytes stored for a chat request's images, in message order.

        Raises ``KeyError`` for an unknown request id.
        """
        with self._lock:
            return [self._objects[key][0] for key in self._image_keys(request_id)]

    def replace_stored_image(self, request_id: str, index: int, data: bytes) -> None:
        """A test hook: swap the stored bytes of a request's ``index``-th image (from 0).

        Simulates a storage object that is not what the Horde stored (a WebP, an
        object over the caps, a damaged file). Later signed URLs and base64
        payloads serve ``data``; messages already offloaded keep their copy.
        Raises ``KeyError`` for an unknown request and ``IndexError`` for an
        unknown image.
        """
        with self._lock:
            key = self._image_keys(request_id)[index]
            self._objects[key] = (bytes(data), dict(self._objects[key][1]))

    def _inline_images(
        self, messages: list[dict[str, Any]], transport: str
    ) -> list[dict[str, Any]]:
        """A copy of ``messages`` with each stored image as a data URL or a signed URL."""
        out = copy.deepcopy(messages)
        for part in _image_parts(out):
            url = _part_url(part)
            if not url.startswith(_IMAGE_MARK):
                continue
            key = url[len(_IMAGE_MARK) :]
            if transport == "url":
                lifetime = self.image_url_s
                if lifetime is None:
                    lifetime = max(self.ttl_s, MIN_IMAGE_URL_S)
                _set_part_url(part, self._sign(key, lifetime))
            else:
                data = self._objects[key][0]
                _set_part_url(
                    part, "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")
                )
        return out

    def _maybe_offload(self, spec: _ChatSpec) -> None:
        if self.offload_bytes is None:
            return
        inline = self._inline_images(spec.messages, "base64")
        raw = _compact(inline)
        if len(raw) <= self.offload_bytes:
            return
        headers = {"Content-Type": "application/json"}
        data = raw
        if self.offload_gzip:
            packed = gzip.compress(raw)
            if len(packed) < len(raw):
                data = packed
                headers["Content-Encoding"] = "gzip"
        key = f"msg-{uuid.uuid4().hex}"
        with self._lock:
            self._objects[key] = (data, headers)
        spec.offload_key = key

    def _sign(self, key: str, lifetime_s: float) -> str:
        exp = f"{time.time() + lifetime_s:.3f}"
        sig = hmac.new(self._secret, f"{key}:{exp}".encode(), hashlib.sha256).hexdigest()
        return f"{self.storage_url}/o/{key}?exp={exp}&sig={sig}"

    # -- HTTP dispatch ---------------------------------------------------------------

    def _log_request(self, port: str, req: Request) -> None:
        with self._lock:
            self._requests_log.append(
                {
                    "port": port,
                    "method": req.method,
                    "path": req.path,
                    "query": req.raw_query,
                    "headers": dict(req.headers),
                    "body": req.body,
                    "at": time.monotonic(),
                }
            )

    def _next_script(self, route: str | None) -> Any:
        if route is None:
            return None
        with self._lock:
            queue = self._scripts[route]
            return queue.popleft() if queue else None

    def _scripted(
        self, route: str | None, serve: Callable[[], Response], on_scripted: Callable[[Any], None]
    ) -> Response:
        script = self._next_script(route)
        if script is None or script == "ok":
            return serve()
        on_scripted(script)
        if isinstance(script, tuple):
            headers = script[2] if len(script) == 3 else None
            return Response.json(script[0], script[1], headers)
        if script == "reset":
            return Response.close_without_answer()
        if script.startswith("hang:"):
            time.sleep(float(script[5:]))
            return serve()
        resp = serve()
        if script == "truncate":
            resp.truncate = True
        elif script == "drop":
            resp.reset = True
        return resp

    def _serve_horde(self, req: Request) -> Response:
        self._log_request("horde", req)
        route = next((name for name, path in ROUTES.items() if path == req.path), None)
        if route is not None and req.method != "POST":
            return Response.json(405, {"message": "Use POST.", "rc": "MethodNotAllowed"})

        def serve() -> Response:
            return self._route(req, route)

        def on_scripted(script: Any) -> None:
            log.info("dev horde: scripted answer %r on %s", script, req.path)
            if route == "pop" and (isinstance(script, tuple) or script == "reset"):
                with self._lock:
                    self._pops.append(
                        {
                            "worker": None,
                            "body": self._json_or_none(req),
                            "status": script[0] if isinstance(script, tuple) else None,
                            "response": copy.deepcopy(script[1])
                            if isinstance(script, tuple)
                            else None,
                        }
                    )

        if route is None:
            return self._scripted(route, serve, on_scripted)
        half = max(0.0, self.latency_s) / 2
        if half:
            time.sleep(half)
        resp = self._scripted(route, serve, on_scripted)
        if half:
            time.sleep(half)
        return resp

    @staticmethod
    def _json_or_none(req: Request) -> Any:
        try:
            return req.json()
        except ValueError:
            return None

    def _route(self, req: Request, route: str | None) -> Response:
        try:
            if route is not None:
                key = self._check_key(req)
                body = self._body_object(req)
                if route == "pop":
                    return self._pop(body, key)
                if route == "submit":
                    return self._submit(body, key)
                return self._progress(body, key)
            return self._client_route(req)
        except _ApiError as err:
            if route == "pop":
                with self._lock:
                    self._pops.append(
                        {
                            "worker": None,
                            "body": self._json_or_none(req),
                            "status": err.status,
                            "response": err.body(),
                        }
                    )
            return Response.json(err.status, err.body())

    @staticmethod
    def _body_object(req: Request) -> dict[str, Any]:
        """The request body as a JSON object; raises 400 ``BadRequest`` otherwise."""
        try:
            body = req.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise _ApiError(400, "BadRequest", "The body must be a JSON object.")
        return body

    def _check_key(self, req: Request) -> str:
        """The request's ``apikey``; raises 401 ``InvalidAPIKey`` for a missing or
        unknown one. Each key stands for one user, who owns the workers it pops."""
        key = req.headers.get("apikey")
        if not key or key not in self.api_keys:
            raise _ApiError(401, "InvalidAPIKey", "No user matching sent API Key.")
        return key

    def _check_owner(self, job: _Job, key: str) -> None:
        """Raise 403 ``WrongCredentials`` when ``key`` does not own the job's worker."""
        worker = self._workers.get(job.worker)
        if worker is not None and worker.owner_key != key:
            log.info("call for job %s under another owner's key refused", job.id)
            raise _ApiError(
                403, "WrongCredentials", "This job's worker belongs to another API key."
            )

    def _client_route(self, req: Request) -> Response:
        parts = [p for p in req.path.split("/") if p]
        method = req.method
        if parts[:4] == ["api", "v2", "generate", "chat"] and parts[4:] == ["async"]:
            if method != "POST":
                raise _ApiError(405, "MethodNotAllowed", "Use POST.")
            body = self._body_object(req)
            horde = body.pop("horde", None) or {}
            if not isinstance(horde, dict):
                raise _ApiError(400, "ChatRequestInvalid", "horde must be an object.")
            if horde.get("max_context_length") is not None:
                body["max_context_length"] = horde["max_context_length"]
            try:
                rid = self.send_chat(
                    body,
                    best_effort=bool(horde.get("best_effort", False)),
                    max_attempts=int(horde.get("max_attempts", 3)),
                    validated_backends=horde.get("validated_backends", True) is not False,
                )
            except (ValueError, TypeError) as exc:
                raise _ApiError(400, "ChatRequestInvalid", str(exc)) from exc
            return Response.json(202, {"id": rid})
        if parts[:4] == ["api", "v2", "generate", "text"] and parts[4:] == ["async"]:
            if method != "POST":
                raise _ApiError(405, "MethodNotAllowed", "Use POST.")
            body = self._body_object(req)
            params = body.get("params") or {}
            if not isinstance(body.get("prompt"), str) or not isinstance(params, dict):
                raise _ApiError(400, "BadRequest", "prompt (a string) is required.")
            params = dict(params)
            max_length = params.pop("max_length", 80)
            max_context_length = params.pop("max_context_length", 1024)
            if not _is_int(max_length) or not _is_int(max_context_length):
                raise _ApiError(
                    400, "BadRequest", "max_length and max_context_length are integers."
                )
            rid = self.send_text(
                body["prompt"],
                max_length=max_length,
                max_context_length=max_context_length,
                params=params,
                models=body.get("models") or [],
                validated_backends=body.get("validated_backends", True) is not False,
            )
            return Response.json(202, {"id": rid})
        if (
            parts[:3] == ["api", "v2", "generate"]
            and len(parts) == 6
            and parts[3] in ("chat", "text")
            and parts[4] == "status"
        ):
            rid = parts[5]
            with self._lock:
                known = self._requests.get(rid)
            if known is None or known.kind != parts[3]:
                raise _ApiError(404, "RequestNotFound", "No request with this id.")
            if method == "DELETE":
                self.cancel(rid)
            elif method != "GET":
                raise _ApiError(405, "MethodNotAllowed", "Use GET or DELETE.")
            return Response.json(200, self.status(rid))
        if parts[:4] == ["api", "v2", "workers", "name"] and len(parts) == 5:
            details = self.worker(parts[4])
            if details is None:
                raise _ApiError(404, "WorkerNotFound", "No worker with this name.")
            return Response.json(200, details)
        if parts == ["api", "v2", "dev", "ledger"]:
            return Response.json(200, self.ledger)
        raise _ApiError(404, "NotFound", f"No route {req.method} {req.path}.")

    def _serve_storage(self, req: Request) -> Response:
        self._log_request("storage", req)

        def serve() -> Response:
            return self._storage_get(req)

        def on_scripted(script: Any) -> None:
            log.info("dev storage: scripted answer %r on %s", script, req.path)

        return self._scripted("storage", serve, on_scripted)

    def _storage_get(self, req: Request) -> Response:
        if req.method not in ("GET", "HEAD"):
            return Response.json(405, {"message": "Use GET.", "rc": "MethodNotAllowed"})
        parts = [p for p in req.path.split("/") if p]
        if len(parts) != 2 or parts[0] != "o":
            return Response.json(404, {"message": "No such object.", "rc": "NoSuchKey"})
        key = parts[1]
        exp = req.query_value("exp") or ""
        sig = req.query_value("sig") or ""
        want = hmac.new(self._secret, f"{key}:{exp}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            return Response.json(403, {"message": "Bad signature.", "rc": "SignatureDoesNotMatch"})
        try:
            expired = float(exp) < time.time()
        except ValueError:
            expired = True
        if expired:
            return Response.json(403, {"message": "The URL has expired.", "rc": "AccessDenied"})
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            return Response.json(404, {"message": "No such object.", "rc": "NoSuchKey"})
        data, headers = obj
        return Response(200, data, dict(headers))

    # -- the pop ---------------------------------------------------------------------

    def _declaration(self, body: dict[str, Any]) -> _Declaration:
        """Step 1 "Declaration checks and withdrawal"; raises 400 ChatDeclarationInvalid."""

        def invalid(message: str) -> _ApiError:
            return _ApiError(400, "ChatDeclarationInvalid", message)

        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise _ApiError(400, "BadRequest", "name is required.")
        if len(name) > WORKER_NAME_MAX_CHARS:
            raise _ApiError(
                400,
                "TooLongWorkerName",
                f"The worker name is {len(name)} characters long; the Horde takes at "
                f"most {WORKER_NAME_MAX_CHARS}.",
            )
        models = body.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise _ApiError(400, "BadRequest", "models must be a list of model names.")
        for key in ("max_length", "max_context_length"):
            value = body.get(key)
            if value is not None and (not _is_int(value) or value < 1):
                raise _ApiError(400, "BadRequest", f"{key} must be a positive integer.")
        agent = body.get("bridge_agent")
        if agent is None:
            agent = DEFAULT_BRIDGE_AGENT
        if not isinstance(agent, str):
            raise _invalid_input("bridge_agent", f"{agent!r} is not of type 'string'")
        if len(agent) > BRIDGE_AGENT_MAX_CHARS:
            raise _invalid_input(
                "bridge_agent", f"longer than {BRIDGE_AGENT_MAX_CHARS} characters"
            )
        chat_jobs = body.get("chat_jobs") is True
        prompt_jobs = body.get("prompt_jobs", True) is not False
        if not prompt_jobs and not chat_jobs:
            raise invalid("prompt_jobs: false needs chat_jobs: true.")
        decl = _Declaration(
            name=name,
            models=list(models),
            max_length=int(body.get("max_length") or TEXT_DEFAULT_MAX_LENGTH),
            max_context_length=int(body.get("max_context_length") or TEXT_DEFAULT_MAX_CONTEXT),
            prompt_jobs=prompt_jobs,
            chat_jobs=chat_jobs,
            bridge_agent=_sanitize(agent),
        )
        if not chat_jobs:
            return decl
        limits = body.get("chat_limits")
        if not isinstance(limits, dict):
            raise invalid("chat_limits is required when chat_jobs is true.")
        for key in ("max_context_length", "max_length"):
            value = limits.get(key)
            if not _is_int(value) or value < 1:
                raise invalid(f"chat_limits.{key} must be a positive integer.")
        tmax = limits.get("tools_max_temperature")
        if tmax is not None and (not _is_number(tmax) or tmax < 0):
            raise invalid("chat_limits.tools_max_temperature must not be negative.")
        model_id = body.get("model_id")
        if not isinstance(model_id, str) or not model_id:
            raise invalid("model_id is required when chat_jobs is true.")
        if model_id not in models:
            raise invalid(f"model_id {model_id!r} must be one of models.")
        features = body.get("chat_features") or []
        transports = body.get("image_transports") or []
        if not isinstance(features, list) or not isinstance(transports, list):
            raise invalid("chat_features and image_transports must be lists.")
        decl.features = [f for f in features if f in CHAT_FEATURES]
        decl.limits = {
            k: limits[k]
            for k in ("max_context_length", "max_length", "tools_max_temperature")
            if k in limits
        }
        decl.model_id = model_id
        decl.image_transports = [t for t in transports if t in IMAGE_TRANSPORTS]
        return decl

    # Skip reasons, by the names of the Horde's pop answer (``skipped``): the first
    # rule a request fails is counted. Rules without such a name are not counted.

    def _text_eligible(self, req: _Req, decl: _Declaration) -> tuple[str | None, str | None]:
        """``(model, None)`` when this worker can take the text request, else
        ``(None, skip reason or None)``."""
        if not decl.prompt_jobs:
            return None, None
        if req.models:
            model = next((m for m in decl.models if m in req.models), None)
        else:
            model = decl.models[0] if decl.models else None
        if model is None:
            return None, "models"
        if req.max_context_length > decl.max_context_length:
            return None, "max_context_length"
        if req.max_length > decl.max_length:
            return None, "max_length"
        if req.validated_backends and not decl.validated:
            return None, "bridge_version"
        return model, None

    def _chat_eligible(self, req: _Req, decl: _Declaration) -> tuple[bool, str | None]:
        """``(True, None)`` when this worker can take the chat request, else
        ``(False, skip reason or None)``."""
        spec = req.chat
        assert spec is not None
        if not decl.chat_jobs or decl.model_id is None:
            return False, None
        if spec.model is not None and spec.model != decl.model_id:
            return False, "models"
        if (
            spec.max_context_length is not None
            and spec.max_context_length > decl.limits["max_context_length"]
        ):
            return False, "max_context_length"
        if spec.max_tokens is not None and spec.max_tokens > decl.limits["max_length"]:
            return False, "max_length"
        if req.validated_backends and not decl.validated:
            return False, "bridge_version"
        declared = set(decl.features)
        if not spec.features <= declared:
            return False, None
        if not req.best_effort and not spec.guarantees <= declared:
            return False, None
        if spec.has_images and not ({"url", "base64"} & set(decl.image_transports)):
            return False, None
        tmax = decl.limits.get("tools_max_temperature")
        if spec.forwards_tools and tmax is not None and spec.temperature > tmax:
            return False, None
        return True, None

    def _pop(self, body: dict[str, Any], key: str) -> Response:
        decl = self._declaration(body)
        now = time.monotonic()
        with self._lock:
            self._expire_locked()
            worker = self._workers.get(decl.name)
            if worker is not None and worker.owner_key != key:
                raise _ApiError(
                    403, "WrongCredentials", "This worker name belongs to another API key."
                )
            if worker is None:
                worker = self._workers[decl.name] = _Worker(
                    decl.name, decl, owner_key=key, aborted_since=now
                )
            worker.decl = decl
            worker.last_pop = now
            if worker.maintenance:
                # The real Horde's horde/apis/v2/base.py JobPopTemplate: a worker in
                # maintenance is offered only its owner's own requests, and a pop that
                # finds none is answered 403 WorkerMaintenance with the worker's
                # maintenance message. Every dev Horde request is a client's.
                refusal = {"message": worker.maintenance_msg, "rc": "WorkerMaintenance"}
                self._pops.append(
                    {
                        "worker": decl.name,
                        "body": copy.deepcopy(body),
                        "status": 403,
                        "response": copy.deepcopy(refusal),
                    }
                )
                log.info("pop by %s refused: the worker is in maintenance", decl.name)
                return Response.json(403, refusal)
            chosen: _Req | None = None
            text_model: str | None = None
            skipped: dict[str, int] = {}
            for req in sorted(self._requests.values(), key=lambda r: r.order):
                if req.state != "waiting":
                    continue
                reason: str | None
                if req.kind == "text":
                    text_model, reason = self._text_eligible(req, decl)
                    if text_model is not None:
                        chosen = req
                        break
                else:
                    ok, reason = self._chat_eligible(req, decl)
                    if ok:
                        chosen = req
                        break
                if reason is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
            if chosen is None:
                # Only an answer without a job reports what the pop passed over.
                answer: dict[str, Any] = {"id": None, "ids": [], "skipped": skipped}
            elif chosen.kind == "text":
                answer = self._assign_text(chosen, decl, text_model, now)
            else:
                answer = self._assign_chat(chosen, decl, now)
            answer["messages"] = self._messages_for(decl.name)
            self._pops.append(
                {
                    "worker": decl.name,
                    "body": copy.deepcopy(body),
                    "status": 200,
                    "response": copy.deepcopy(answer),
                }
            )
            self._changed.notify_all()
        if chosen is not None:
            log.info("pop by %s: %s job %s", decl.name, chosen.kind, answer["id"])
        return Response.json(200, answer)

    def _new_job(
        self, req: _Req, decl: _Declaration, model: str | None, max_length: int, now: float
    ) -> _Job:
        job = _Job(
            id=str(uuid.uuid4()),
            request_id=req.id,
            kind=req.kind,
            worker=decl.name,
            model=model,
            limits=dict(decl.limits),
            popped_at=now,
            lease_until=now + self.ttl_s,
            max_length=max_length,
        )
        self._jobs[job.id] = job
        req.job_ids.append(job.id)
        req.state = "processing"
        req.worker = decl.name
        req.model = model
        return job

    def _ttl_value(self) -> float | int:
        return int(self.ttl_s) if self.ttl_s == int(self.ttl_s) else self.ttl_s

    def _assign_text(
        self, req: _Req, decl: _Declaration, model: str | None, now: float
    ) -> dict[str, Any]:
        job = self._new_job(req, decl, model, req.max_length, now)
        payload = copy.deepcopy(req.params)
        payload.update(
            {
                "prompt": req.prompt,
                "max_length": req.max_length,
                "max_context_length": req.max_context_length,
            }
        )
        return {
            "payload": payload,
            "id": job.id,
            "ids": [job.id],
            "messages": [],
            "ttl": self._ttl_value(),
            "extra_source_images": None,
            "skipped": {},
            "softprompt": None,
            "model": model,
        }

    def _assign_chat(self, req: _Req, decl: _Declaration, now: float) -> dict[str, Any]:
        spec = req.chat
        assert spec is not None
        body = req.body
        max_length = spec.max_tokens or int(decl.limits["max_length"])
        max_context = spec.max_context_length or int(decl.limits["max_context_length"])
        job = self._new_job(req, decl, decl.model_id, max_length, now)
        job.stream_progress = spec.stream
        transports = set(decl.image_transports)
        image_transport = "url" if "url" in transports else "base64"
        payload: dict[str, Any] = {}
        if spec.offload_key is not None and "messages_url" in transports:
            payload["messages_url"] = self._sign(spec.offload_key, self.messages_url_s)
        else:
            payload["messages"] = self._inline_images(spec.messages, image_transport)

        def pick(key: str, default: Any) -> Any:
            value = body.get(key)
            return default if value is None else value

        payload["temperature"] = pick("temperature", 1.0)
        payload["top_p"] = pick("top_p", 1.0)
        payload["frequency_penalty"] = pick("frequency_penalty", 0.0)
        payload["presence_penalty"] = pick("presence_penalty", 0.0)
        payload["rep_pen"] = pick("rep_pen", 1.0)
        payload["top_k"] = pick("top_k", 0)
        payload["min_p"] = pick("min_p", 0.0)
        stop = body.get("stop")
        if isinstance(stop, str):
            payload["stop_sequence"] = [stop]
        elif isinstance(stop, list) and stop:
            payload["stop_sequence"] = list(stop)
        if body.get("seed") is not None:
            payload["seed"] = body["seed"]
        if "reasoning_effort" in decl.features:
            payload["reasoning_effort"] = pick("reasoning_effort", "medium")
        payload["max_length"] = max_length
        payload["max_context_length"] = max_context
        payload["n"] = 1
        if spec.forwards_tools:
            if spec.named_function is not None:
                payload["tools"] = [
                    copy.deepcopy(t)
                    for t in spec.tools
                    if t["function"]["name"] == spec.named_function
                ]
                payload["tool_choice"] = "required"
            else:
                payload["tools"] = copy.deepcopy(spec.tools)
                if spec.tool_choice is not None:
                    payload["tool_choice"] = spec.tool_choice
            if body.get("parallel_tool_calls") is not None:
                payload["parallel_tool_calls"] = body["parallel_tool_calls"]
        if spec.rf_type is not None:
            payload["response_format"] = copy.deepcopy(body["response_format"])
        if spec.stream:
            payload["stream_progress"] = True
        return {
            "payload": payload,
            "id": job.id,
            "ids": [job.id],
            "messages": [],
            "ttl": self._ttl_value(),
            "extra_source_images": None,
            "skipped": {},
            "softprompt": None,
            "model": decl.model_id,
            "chat": True,
        }

    def _reward(self, job: _Job, nbytes: int) -> float:
        """The kudos for ``nbytes`` of output: 0.3 x for a worker whose backend the
        Horde does not validate (its bridge agent at the time of the reward)."""
        reward = _output_kudos(nbytes)
        worker = self._workers.get(job.worker)
        if worker is not None and not worker.decl.validated:
            reward = round(reward * UNVALIDATED_KUDOS_FACTOR, 2)
        return reward

    # -- leases ----------------------------------------------------------------------

    def _expire_locked(self) -> None:
        """Expire every open job whose lease passed: an aborted job of its worker (the
        real Horde's horde/database/threads.py ``check_waiting_prompts`` calls
        ``abort()`` on each stale job, horde/classes/base/processing_generation.py
        ``abort`` calls the worker's ``log_aborted_job``)."""
        now = time.monotonic()
        for job in self._jobs.values():
            if job.action is None and now > job.lease_until:
                job.action = "expired"
                self._record(job, "expired", None, None, None, None)
                log.info("job %s expired (lease passed)", job.id)
                self._log_aborted_job(job.worker, now)
                req = self._requests[job.request_id]
                if req.state == "processing" and req.job_ids[-1] == job.id:
                    self._restart(req)
                self._changed.notify_all()

    def _log_aborted_job(self, name: str, now: float) -> None:
        """Count an aborted job of worker ``name``; more than 20 in the window put it
        into maintenance and start the count again (the real Horde's
        horde/classes/base/worker.py ``log_aborted_job``: the count starts again when
        an aborted job comes more than an hour after the window began, which is
        when the worker was created or the count last started again)."""
        worker = self._workers.get(name)
        if worker is None:
            return
        if now - worker.aborted_since > self.aborted_jobs_window_s:
            worker.aborted_jobs = 0
            worker.aborted_since = now
        worker.aborted_jobs += 1
        worker.uncompleted_jobs += 1
        if worker.aborted_jobs > MAX_ABORTED_JOBS:
            worker.maintenance = True
            worker.maintenance_msg = MAINTENANCE_MESSAGE
            worker.aborted_jobs = 0
            log.warning(
                "worker %s put into maintenance: more than %d aborted jobs within %g s",
                name, MAX_ABORTED_JOBS, self.aborted_jobs_window_s,
            )

    def _restart(self, req: _Req) -> None:
        req.restarted += 1
        req.state = "faulted" if req.restarted >= req.max_attempts else "waiting"

    def _record(
        self,
        job: _Job,
        action: str,
        status: int | None,
        rc: str | None,
        fault_reason: str | None,
        body: dict[str, Any] | None,
    ) -> None:
        self._ledger.append(
            {
                "job_id": job.id,
                "request_id": job.request_id,
                "kind": job.kind,
                "worker": job.worker,
                "action": action,
                "status": status,
                "rc": rc,
                "fault_reason": fault_reason,
                "body": copy.deepcopy(body),
            }
        )

    # -- the submit ------------------------------------------------------------------

    def _submit(self, body: dict[str, Any], key: str) -> Response:
        job_id = body.get("id")
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id) if isinstance(job_id, str) else None
            if job is None:
                raise _ApiError(404, "InvalidJobID", "No job with this id.")
            self._check_owner(job, key)
            req = self._requests[job.request_id]
            try:
                state = body.get("state", "ok")
                if state not in SUBMIT_STATES:
                    raise _invalid_input(
                        "state", f"{state!r} is not one of {list(SUBMIT_STATES)}"
                    )
                if state == "faulted":
                    self._check_fault_shape(job, body)
                if job.action is not None:
                    answer = self._ended(job, body, state)
                    self._changed.notify_all()
                    return Response.json(200, answer)
                where = _nul_path(body)
                if where is not None:
                    raise _ApiError(
                        400,
                        "NulByteInPayload",
                        f"The submit holds a NUL character (U+0000) at {where}; "
                        "nothing was stored.",
                    )
                if state == "faulted":
                    answer = self._fault(job, req, body)
                elif job.kind == "text":
                    answer = self._text_reply(job, req, body)
                else:
                    answer = self._chat_reply(job, req, body)
                if state != "faulted":
                    log.info(
                        "job %s submitted (%s kudos); request %s is %s",
                        job.id, answer.get("reward"), req.id, req.state,
                    )
            except _ApiError as err:
                action = {"DuplicateGen": "duplicate", "AbortedGen": "aborted_gen"}.get(
                    err.rc or "", "refused"
                )
                self._record(job, action, err.status, err.rc, None, body)
                if action == "refused" and job.action is None:
                    job.last_refusal = (err.rc, err.message)
                    req.refusals.append({"job_id": job.id, "rc": err.rc, "message": err.message})
                log.info("submit of job %s refused: %s %s", job.id, err.rc, err.message)
                raise
            self._changed.notify_all()
        return Response.json(200, answer)

    def _ended(self, job: _Job, body: dict[str, Any], state: str) -> dict[str, Any]:
        """A submit for a job that already ended; raises its refusal as an ``_ApiError``.

        As the real Horde's horde/apis/v2/base.py ``JobSubmitTemplate.validate``
        answers what horde/classes/kobold/processing_generation.py ``set_generation``
        returns: a job with a stored reply answers 400 ``DuplicateGen`` to any
        submit; a job that ended without one (expired, faulted, or cancelled: the
        real Horde marks each faulted) answers a fault 200 ``{"reward": 0}`` (the
        ``kudos == -1`` branch for ``state == "faulted"``), counted nowhere since the
        job was counted when it ended, and anything else 400 ``AbortedGen``.
        """
        if job.action == "submitted":
            raise _ApiError(400, "DuplicateGen", "This job was already submitted.")
        if state != "faulted":
            raise _ApiError(400, "AbortedGen", "This job has ended; it was not stored.")
        self._record(job, "late_fault", 200, None, None, body)
        log.info("job %s faulted after it ended (%s): nothing counted", job.id, job.action)
        return {"reward": 0}

    def _check_fault_shape(self, job: _Job, body: dict[str, Any]) -> None:
        """The input check of a faulted submit (before any state is looked at).

        ``model_id`` marks a chat submit, which needs no ``generation``; any other
        faulted submit (a text job's, or a chat job's without ``model_id``) is a
        text submit and needs ``generation`` (400 input validation otherwise).
        """
        if job.kind == "text" or body.get("model_id") is None:
            if not isinstance(body.get("generation"), str):
                raise _invalid_input(
                    "generation",
                    "a text submit needs generation (a chat submit is marked by model_id)",
                )
        elif "message" in body or "generation" in body:
            raise _ApiError(
                400,
                "ChatSubmitInvalid",
                "A faulted chat submit has neither generation nor message.",
            )

    def _fault(self, job: _Job, req: _Req, body: dict[str, Any]) -> dict[str, Any]:
        """Step 7: accept a faulted submit, reward 0, give the request back to the queue.

        The fault counts as an aborted job of the worker (the real Horde's
        horde/classes/kobold/processing_generation.py ``set_generation`` calls
        ``abort()`` for ``state == "faulted"``), except a fault after a
        ``ChatSubmitNonconformant`` refusal, counted under ``nonconformant_replies``.
        """
        reason = body.get("fault_reason")
        kept = reason if reason in FAULT_REASON_SENTENCES else None
        job.action = "faulted"
        self._record(job, "faulted", 200, None, kept, body)
        worker = self._workers.get(job.worker)
        refusal = job.last_refusal
        if refusal is not None and refusal[0] == "ChatSubmitNonconformant":
            if worker is not None:
                worker.nonconformant_replies += 1
        else:
            self._log_aborted_job(job.worker, time.monotonic())
        if kept is not None:
            req.fault_reasons.append(kept)
            req.return_code = "ChatWorkerFault"
            if refusal is not None and kept == "reply_refused":
                req.return_message = refusal[1]
            else:
                req.return_message = FAULT_REASON_SENTENCES[kept]
        elif refusal is not None and refusal[0] == "ChatSubmitNonconformant":
            req.return_code = "ChatWorkerFault"
            req.return_message = refusal[1]
        if req.state == "processing" and req.job_ids[-1] == job.id:
            self._restart(req)
        log.info("job %s faulted (reason=%s); request %s is %s", job.id, kept, req.id, req.state)
        return {"reward": 0}

    def _text_reply(self, job: _Job, req: _Req, body: dict[str, Any]) -> dict[str, Any]:
        if "message" in body:
            raise _ApiError(
                400, "ChatSubmitInvalid", "A text job is submitted with generation, not message."
            )
        generation = body.get("generation")
        if not isinstance(generation, str):
            raise _invalid_input("generation", "a text job is submitted with generation")
        reward = self._reward(job, len(generation.encode()))
        job.action = "submitted"
        self._record(job, "submitted", 200, None, None, body)
        if req.state == "processing":
            req.state = "done"
        req.generation = generation
        req.reward = reward
        return {"reward": reward}

    def _chat_reply(self, job: _Job, req: _Req, body: dict[str, Any]) -> dict[str, Any]:
        """Step 6 and "Submit refusals"; raises the refusal as an ``_ApiError``."""
        spec = req.chat
        assert spec is not None

        def invalid(message: str) -> _ApiError:
            return _ApiError(400, "ChatSubmitInvalid", message)

        def nonconformant(message: str) -> _ApiError:
            return _ApiError(400, "ChatSubmitNonconformant", message)

        if "generation" in body and "message" in body:
            raise invalid("A chat submit has message or generation, not both.")
        message = body.get("message")
        if not isinstance(message, dict):
            raise invalid("A chat submit needs message, an assistant message.")
        if message.get("role", "assistant") != "assistant":
            raise invalid("message.role must be assistant.")
        calls = message.get("tool_calls")
        if calls is None:
            calls = []
        if not isinstance(calls, list):
            raise invalid("message.tool_calls must be a list.")
        content = message.get("content")
        if content is None:
            if not calls:
                raise invalid("message.content may be null only beside tool_calls.")
        elif not isinstance(content, str):
            raise invalid("message.content must be a string or null.")
        reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise invalid("message.reasoning_content must be a string.")
            if len(reasoning.encode("utf-8")) > REASONING_MAX_BYTES:
                raise invalid("message.reasoning_content is over 1 MiB.")
        finish = body.get("finish_reason")
        if finish not in FINISH_REASONS:
            raise invalid(f"finish_reason must be one of {', '.join(FINISH_REASONS)}.")
        if finish == "tool_calls" and not calls:
            raise invalid("finish_reason tool_calls needs message.tool_calls.")
        native = body.get("native_finish_reason")
        if native is not None and (
            not isinstance(native, str) or len(native) > NATIVE_FINISH_REASON_MAX_CHARS
        ):
            raise invalid("native_finish_reason must be a string of at most 32 characters.")
        seen: set[str] = set()
        names: list[str] = []
        for i, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(call, dict)
                or not isinstance(call.get("id"), str)
                or not call["id"]
                or call.get("type", "function") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
            ):
                raise invalid(f"message.tool_calls[{i}] needs id, type function and function.name.")
            if not isinstance(fn.get("arguments"), str):
                raise invalid(f"message.tool_calls[{i}].function.arguments must be a string.")
            if fn["name"] not in spec.tool_names:
                raise invalid(
                    f"message.tool_calls[{i}] calls {fn['name']!r}, not a function of the request."
                )
            if call["id"] in seen:
                raise invalid(f"message.tool_calls[{i}].id {call['id']!r} is used twice.")
            seen.add(call["id"])
            names.append(fn["name"])
        if body.get("model_id") != job.model:
            raise _ApiError(
                400,
                "ChatModelMismatch",
                f"model_id {body.get('model_id')!r} is not the assigned model {job.model!r}.",
            )
        counts: dict[str, int | None] = {}
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            value = body.get(key)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOKEN_COUNT):
                raise invalid(f"{key} must be an integer from 0 to {MAX_TOKEN_COUNT}.")
            counts[key] = value
        if not req.best_effort:
            choice = spec.tool_choice
            if calls and choice == "none":
                raise nonconformant("The reply calls a tool under tool_choice none.")
            if not calls and spec.forwards_tools and (
                choice == "required" or spec.named_function
            ):
                raise nonconformant("The reply calls no tool under a required tool_choice.")
            if spec.named_function is not None and any(
                n != spec.named_function for n in names
            ):
                raise nonconformant(
                    f"The reply calls another function than {spec.named_function!r}."
                )
            only_calls = bool(calls) and not content
            if spec.rf_type is not None and not only_calls:
                self._check_format(spec, content or "", nonconformant)
        stored = copy.deepcopy(message)
        stored["role"] = "assistant"
        if not req.best_effort and _parallel_off(req.body) and len(calls) > 1:
            stored["tool_calls"] = stored["tool_calls"][:1]
        stored_finish = "stop" if spec.named_function and finish == "tool_calls" else finish
        nbytes = len((content or "").encode()) + len((reasoning or "").encode())
        nbytes += sum(len(c["function"]["arguments"].encode()) for c in calls)
        reward = self._reward(job, nbytes)
        job.action = "submitted"
        self._record(job, "submitted", 200, None, None, body)
        if req.state == "processing":
            req.state = "done"
        req.message = stored
        req.finish_reason = stored_finish
        req.native_finish_reason = native
        req.prompt_tokens = counts["prompt_tokens"]
        req.completion_tokens = counts["completion_tokens"]
        req.reasoning_tokens = counts["reasoning_tokens"]
        req.reward = reward
        return {"reward": reward}

    @staticmethod
    def _check_format(
        spec: _ChatSpec, content: str, nonconformant: Callable[[str], _ApiError]
    ) -> None:
        if spec.rf_type == "json_schema" and spec.schema_strict:
            if _jsonschema is None or spec.schema is None:
                return
            try:
                value = json.loads(content)
            except ValueError as exc:
                raise nonconformant("The content is not JSON, as the json_schema needs.") from exc
            try:
                _jsonschema.validate(value, spec.schema)
            except _jsonschema.ValidationError as exc:
                raise nonconformant(
                    f"The content does not match the json_schema: {exc.message}"
                ) from exc
            except _jsonschema.SchemaError:
                return
            return
        try:
            value = json.loads(content)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise nonconformant(f"The content is not a JSON object, as {spec.rf_type} needs.")

    # -- progress --------------------------------------------------------------------

    def _progress(self, body: dict[str, Any], key: str) -> Response:
        """"Streaming progress": sequencing, retries, caps, cancel and lease extension."""
        job_id = body.get("id")
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id) if isinstance(job_id, str) else None
            if job is None:
                raise _ApiError(404, "InvalidJobID", "No job with this id.")
            self._check_owner(job, key)
            if not job.stream_progress:
                raise _ApiError(
                    404, "ChatProgressNotStreaming", "This job does not stream progress."
                )
            seq = body.get("seq")
            delta = body.get("delta")
            if job.action == "cancelled":
                accepted = seq if _is_int(seq) and seq == job.last_seq + 1 else job.last_seq
                return Response.json(200, {"accepted_seq": accepted, "cancelled": True})
            if job.action is not None:
                raise _ApiError(404, "ChatJobAborted", "This job has ended.")
            if not _is_int(seq) or seq < 1:
                raise _ApiError(400, "ChatProgressInvalid", "seq must be a positive integer.")
            if not isinstance(delta, dict):
                raise _ApiError(400, "ChatProgressInvalid", "delta must be an object.")
            if delta.get("content") is None and delta.get("reasoning_content") is None:
                raise _ApiError(
                    400,
                    "ChatProgressInvalid",
                    "delta must include content, reasoning_content or both.",
                )
            content = delta.get("content", "")
            reasoning = delta.get("reasoning_content", "")
            if content is None:
                content = ""
            if reasoning is None:
                reasoning = ""
            if not isinstance(content, str) or not isinstance(reasoning, str):
                raise _ApiError(
                    400, "ChatProgressInvalid", "delta content and reasoning must be strings."
                )
            expected = job.last_seq + 1
            if job.last_seq and seq == job.last_seq:
                if (content, reasoning) == job.last_delta:
                    return Response.json(200, {"accepted_seq": seq, "cancelled": False})
                raise _ApiError(
                    409,
                    "ChatProgressOutOfSequence",
                    "The content under an accepted seq cannot change.",
                    {"expected_seq": expected},
                )
            if seq != expected:
                raise _ApiError(
                    409,
                    "ChatProgressOutOfSequence",
                    f"seq {seq} is out of sequence; expected {expected}.",
                    {"expected_seq": expected},
                )
            nbytes = len(content.encode("utf-8")) + len(reasoning.encode("utf-8"))
            if (
                job.progress_posts >= PROGRESS_MAX_POSTS
                or job.progress_bytes + nbytes > PROGRESS_BYTES_PER_TOKEN * job.max_length
            ):
                raise _ApiError(413, "ChatProgressCapReached", "The progress cap is reached.")
            job.progress_posts += 1
            job.progress_bytes += nbytes
            job.last_seq = seq
            job.last_delta = (content, reasoning)
            entry: dict[str, Any] = {"seq": seq, "content": content}
            if "reasoning_content" in delta:
                entry["reasoning_content"] = reasoning
            req = self._requests[job.request_id]
            req.stream.append(entry)
            if nbytes:
                now = time.monotonic()
                job.lease_until = max(
                    job.lease_until, min(now + self.ttl_s, job.popped_at + self.lease_cap_s)
                )
            self._changed.notify_all()
        return Response.json(200, {"accepted_seq": seq, "cancelled": False})

    # -- views -----------------------------------------------------------------------

    def _status_locked(self, req: _Req) -> dict[str, Any]:
        base: dict[str, Any] = {
            "id": req.id,
            "kind": req.kind,
            "done": req.state == "done",
            "faulted": req.state == "faulted",
            "state": req.state,
            "restarted": req.restarted,
            "worker": req.worker,
            "model": req.model,
            "reward": req.reward,
            "job_ids": list(req.job_ids),
        }
        if req.kind == "text":
            base["generation"] = req.generation
            return base
        base.update(
            {
                "best_effort": req.best_effort,
                "message": copy.deepcopy(req.message),
                "finish_reason": req.finish_reason,
                "native_finish_reason": req.native_finish_reason,
                "prompt_tokens": req.prompt_tokens,
                "completion_tokens": req.completion_tokens,
                "reasoning_tokens": req.reasoning_tokens,
                "fault_reasons": list(req.fault_reasons),
                "return_code": req.return_code,
                "return_message": req.return_message,
                "refusals": copy.deepcopy(req.refusals),
                "stream": copy.deepcopy(req.stream),
            }
        )
        return base

    @staticmethod
    def _worker_details(w: _Worker) -> dict[str, Any]:
        decl = w.decl
        out: dict[str, Any] = {
            "name": w.name,
            "models": list(decl.models),
            "max_length": decl.max_length,
            "max_context_length": decl.max_context_length,
            "accepts_chat_jobs": decl.chat_jobs,
            "accepts_prompt_jobs": decl.prompt_jobs,
            "nonconformant_replies": w.nonconformant_replies,
            "aborted_jobs": w.aborted_jobs,
            "uncompleted_jobs": w.uncompleted_jobs,
            "maintenance_mode": w.maintenance,
            "bridge_agent": decl.bridge_agent,
        }
        if decl.chat_jobs:
            out["chat"] = {
                "model_id": decl.model_id,
                "features": list(decl.features),
                "limits": dict(decl.limits),
                "image_transports": list(decl.image_transports),
            }
        return out


def _parallel_off(body: dict[str, Any]) -> bool:
    """True when the client set ``parallel_tool_calls: false``."""
    return body.get("parallel_tool_calls") is False
