"""The dev Horde's records (a worker's declaration and counts, moderator messages,
requests, jobs) and :class:`HordeCore`, the state its route families share.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from koboldcpp_horde_chat.devkit._http import JSONServer
from koboldcpp_horde_chat.devkit.horde.helpers import is_validated_backend
from koboldcpp_horde_chat.devkit.horde.values import DEFAULT_BRIDGE_AGENT, ImageConverter


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
    #: None: faulted by the sweep (the real Horde); n: faulted at once at the n-th
    #: faulted or expired job (a test hook).
    max_attempts: int | None
    chat: _ChatSpec | None = None
    validated_backends: bool = False
    # text
    prompt: str = ""
    max_length: int = 0
    max_context_length: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    # outcome
    state: str = "waiting"
    restarted: int = 0
    #: Faults for jobs that had already ended: each re-opened the request.
    reopened: int = 0
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


class HordeCore:
    """The state every route family of :class:`DevHorde` shares.

    :meth:`DevHorde.__init__` sets all of it. ``_lock`` guards the records below
    it, and ``_changed`` (on the same lock) is notified whenever a request or job
    changes, for :meth:`DevHorde.wait`.
    """

    api_keys: frozenset[str]
    aborted_jobs_window_s: float
    latency_s: float
    trusted: bool
    chat_routes: bool
    sweep_s: float
    offload_bytes: int | None
    offload_gzip: bool
    ttl_s: float
    lease_cap_s: float
    messages_url_s: float
    image_converter: ImageConverter | None
    image_url_s: float | None
    _lock: threading.Lock
    _changed: threading.Condition
    _secret: bytes
    _requests: dict[str, _Req]
    _jobs: dict[str, _Job]
    _workers: dict[str, _Worker]
    _worker_messages: list[_WorkerMessage]
    _objects: dict[str, tuple[bytes, dict[str, str]]]
    _ledger: list[dict[str, Any]]
    _late_faults: list[dict[str, Any]]
    _pops: list[dict[str, Any]]
    _requests_log: list[dict[str, Any]]
    _scripts: dict[str, deque[Any]]
    _order: int
    _next_sweep: float
    _horde: JSONServer
    _storage: JSONServer
