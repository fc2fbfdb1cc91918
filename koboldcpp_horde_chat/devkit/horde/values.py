"""The contract's values the dev Horde applies: routes, feature names, lease times,
caps, the validated backends and the maintenance rule's numbers.
"""

from __future__ import annotations

from collections.abc import Callable

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
#: How often the Horde's sweep runs, seconds (the real Horde's horde/database/__init__.py
#: runs horde/database/threads.py ``check_waiting_prompts`` every 60 s): it aborts each
#: job whose ttl passed without a submit and marks faulted each request with more than
#: :data:`SWEEP_FAULTED_JOBS` faulted jobs.
SWEEP_S = 60.0
#: A request with more faulted jobs (faulted, or expired) than this is marked faulted
#: by the sweep (``check_waiting_prompts``: ``having(count > 2)``).
SWEEP_FAULTED_JOBS = 2
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
