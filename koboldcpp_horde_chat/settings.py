"""Every knob of the worker, in one frozen dataclass.

Built by ``hosts.standalone.settings_from_args`` (standalone, from flags and
the running koboldcpp) or by ``hosts.inside_kcpp.settings_from_kcpp`` (inside
koboldcpp, from its ``args`` and globals). Units are in
the field names. The API key and the koboldcpp password are kept out of
``repr`` so that a settings object can be logged.

Also koboldcpp's own cut of a request's ``max_length`` (1.116.1 ``koboldcpp.py`` L2168-2180) and its
``--genlimit``, which decide both the declared ``max_length`` and the budget a
reply was generated under, and the context to send koboldcpp so that it cuts
none of a job's budget.

Seed sections: "1. Declare chat on pop" and "Worked example: koboldcpp's
embedded worker".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import BRIDGE_AGENT

DEFAULT_HORDE_URL = "https://aihorde.net"
DEFAULT_KCPP_URL = "http://127.0.0.1:5001"
MIB = 1024 * 1024

WORKER_NAME_MAX_CHARS = 100
"""The longest worker name the Horde stores, in characters.

From the AI Horde's source (Haidra-Org/AI-Horde): the ``name`` column of its
worker table is ``db.String(100)`` (``horde/classes/base/worker.py``), and its
rename check refuses a name over 100 characters (``TooLongWorkerName``). The
Horde strips the name it is sent (``sanitize_string`` in ``horde/utils.py``).
"""


def worker_name_problem(name: str) -> str | None:
    """Why the Horde would refuse ``name`` as a worker name, or None when it takes it.

    The Horde strips leading and trailing whitespace, so an empty or
    whitespace-only name is refused, and a stripped name longer than
    :data:`WORKER_NAME_MAX_CHARS` characters is refused with the limit named.
    Example: ``worker_name_problem("  ")`` -> ``"a worker name is required (not empty
    or only spaces)"``.
    """
    stripped = name.strip()
    if not stripped:
        return "a worker name is required (not empty or only spaces)"
    if len(stripped) > WORKER_NAME_MAX_CHARS:
        return (
            f"the name is {len(stripped)} characters long; the Horde takes at most "
            f"{WORKER_NAME_MAX_CHARS}"
        )
    return None


def kcpp_reserved_tokens(context: int) -> int:
    """Tokens koboldcpp keeps free for the prompt when it cuts a ``max_length``.

    koboldcpp 1.116.1 ``generate()`` (``koboldcpp.py`` L2173): ``max(min(ctx - 4, 16),
    int(ctx * 0.2))``, e.g. 819 for a 4096-token context, 200 for 1000.

    Args:
        context: the context koboldcpp generates within, tokens.
    """
    return max(min(context - 4, 16), int(context * 0.2))


def kcpp_max_uncut_length(context: int) -> int:
    """The largest ``max_length`` koboldcpp generates in full within ``context``.

    koboldcpp cuts a ``max_length`` of at least ``context - reserved`` down to
    ``context - reserved`` (:func:`kcpp_reserved_tokens`), so this is that
    value: 3277 for a 4096-token context, 800 for 1000. It leaves about 20 %
    of the context to the prompt.
    """
    return context - kcpp_reserved_tokens(context)


def kcpp_effective_max_length(
    max_length: int, max_context_length: int, kcpp_max_context: int, genlimit: int = 0
) -> int:
    """The budget koboldcpp really generates under for one request, tokens.

    koboldcpp 1.116.1 ``generate()`` (``koboldcpp.py`` L2168-2180)
    caps the request's ``max_context_length`` at its own context size
    (``--contextsize``), caps ``max_length`` at ``--genlimit`` when that is
    above 0, then cuts a ``max_length`` that leaves less than
    :func:`kcpp_reserved_tokens` of the context to the prompt. It reports
    ``"length"`` when it used this budget up, e.g. ``(900, 1000, 4096) -> 800``,
    ``(512, 4096, 4096) -> 512``, ``(4000, 8192, 4096) -> 3277``,
    ``(512, 4096, 4096, genlimit=200) -> 200``.

    Args:
        max_length: the ``max_tokens`` sent to koboldcpp (the job's ``max_length``).
        max_context_length: the ``max_context_length`` sent to koboldcpp.
        kcpp_max_context: koboldcpp's loaded context size.
        genlimit: koboldcpp's ``--genlimit``; 0 (or less) means none.
    """
    context = min(max_context_length, kcpp_max_context)
    if genlimit > 0:
        max_length = min(max_length, genlimit)
    return min(max_length, kcpp_max_uncut_length(context))


def kcpp_context_keeping_budget(
    max_length: int, max_context_length: int, kcpp_max_context: int
) -> int:
    """The ``max_context_length`` to send koboldcpp so that it cuts none of ``max_length``.

    koboldcpp cuts a ``max_length`` that leaves less than about 20 % of the
    request's context to the prompt (:func:`kcpp_effective_max_length`), so a
    job with context 500 and ``max_length`` 420 would get 400 tokens. This is
    the smallest context at or above the job's, and at most koboldcpp's own,
    within which ``max_length`` is generated whole: ``(420, 500, 4096) -> 524``,
    ``(256, 4096, 4096) -> 4096`` (the job's own, already enough),
    ``(4000, 4096, 4096) -> 4096`` (nothing larger to give). Send it only once
    the fit check passed: the prompt then fits the job's context with the
    budget, so a larger context makes koboldcpp drop nothing from it (it
    trims a prompt only beyond ``context - max_length``), and the model sees
    the same prompt.

    Args:
        max_length: the job's ``max_length``, tokens.
        max_context_length: the job's ``max_context_length``, tokens.
        kcpp_max_context: koboldcpp's loaded context size, tokens.
    """
    low = min(max_context_length, kcpp_max_context)
    high = kcpp_max_context
    if kcpp_max_uncut_length(low) >= max_length or kcpp_max_uncut_length(high) < max_length:
        return low if kcpp_max_uncut_length(low) >= max_length else high
    # kcpp_max_uncut_length never decreases as the context grows: bisect.
    while high - low > 1:
        middle = (low + high) // 2
        if kcpp_max_uncut_length(middle) >= max_length:
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True)
class WorkerSettings:
    """The worker's configuration.

    Attributes (tokens unless said otherwise):
        api_key: the Horde API key; sent only to ``horde_url``'s host.
        worker_name: the Horde worker name (``--hordeworkername``).
        model_id: the model name popped for and declared as ``model_id``,
            e.g. ``"koboldcpp/Qwen3-8B-Q4_K_M"``.
        backend_max_context_length: koboldcpp's loaded context size.
        backend_model_name: the model name koboldcpp reports (``/api/v1/model``),
            when read from it (the standalone worker); ``""`` otherwise.
        horde_max_context_length: ``--hordemaxctx``; 0 means the backend's.
        max_length: ``--hordegenlen``, the most tokens asked for one job; the
            declared value is :attr:`declared_max_length`.
        horde_url: the Horde's base URL.
        kcpp_url: koboldcpp's base URL.
        kcpp_password: koboldcpp's ``--password``, sent as a Bearer token to it only.
        vision: koboldcpp has a multimodal projector loaded and reports vision.
        image_url_transport: declare the ``url`` image transport beside ``base64``.
        prompt_jobs: serve text jobs too (False with ``--chat-only``).
        chat_withhold: features and guarantees the operator withholds.
        trusted: the worker is trusted by the Horde (its progress lease cap is
            600 s from pop instead of 200 s).
        threads: koboldcpp's parallel worker threads (sent as ``threads`` when > 1).
        bridge_agent: the pop's ``bridge_agent`` (and the ``User-Agent`` header):
            koboldcpp's embedded worker name and version field, which the Horde
            validates, then this package and its version (see ``BRIDGE_AGENT``).
        local_idle_s: seconds to wait after a local user's generation before popping.
        pop_timeout_s, submit_timeout_s, progress_timeout_s: read timeouts, seconds.
        connect_timeout_s: connect timeout for every call, seconds.
        messages_max_bytes: cap on a decoded ``messages_url`` body, bytes.
        kcpp_max_request_bytes: the largest request body koboldcpp accepts, bytes:
            its ``--maxrequestsize`` (MB, default 32) times 1024 * 1024; koboldcpp
            answers a larger one with 500 "Payload is too big", so the worker
            faults a chat job whose encoded request is larger without sending it.
        kcpp_genlimit: koboldcpp's ``--genlimit`` (tokens; 0: none): koboldcpp
            caps every generation there and reports a normal stop, so the
            worker declares and budgets at most that many tokens.
        lease_s: a job's base lease when the pop has no ``ttl``, seconds.
        backend_probe_s: seconds between readiness probes of a koboldcpp that
            failed a job and does not answer (3 s; tests may shorten it).
    """

    api_key: str = field(repr=False)
    worker_name: str
    model_id: str
    backend_max_context_length: int
    backend_model_name: str = ""
    horde_max_context_length: int = 0
    max_length: int = 1024
    horde_url: str = DEFAULT_HORDE_URL
    kcpp_url: str = DEFAULT_KCPP_URL
    kcpp_password: str = field(default="", repr=False)
    vision: bool = False
    image_url_transport: bool = True
    prompt_jobs: bool = True
    chat_withhold: frozenset[str] = frozenset()
    trusted: bool = False
    threads: int = 1
    bridge_agent: str = BRIDGE_AGENT
    local_idle_s: float = 20.0
    pop_timeout_s: float = 40.0
    submit_timeout_s: float = 30.0
    progress_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    messages_max_bytes: int = 36 * MIB
    kcpp_max_request_bytes: int = 32 * MIB
    kcpp_genlimit: int = 0
    lease_s: float = 150.0
    backend_probe_s: float = 3.0

    @property
    def max_context_length(self) -> int:
        """The context advertised to the Horde: ``min(backend, --hordemaxctx or backend)``."""
        backend = self.backend_max_context_length
        horde = self.horde_max_context_length
        return min(backend, horde) if horde > 0 else backend

    @property
    def declared_max_length(self) -> int:
        """The ``max_length`` declared to the Horde (chat and text), tokens.

        ``--hordegenlen``, lowered to :func:`kcpp_max_uncut_length` of the
        declared context when it is larger: koboldcpp would cut a larger budget
        anyway, and a job with it leaves no room for a prompt (every one would
        be a ``prompt_overflow`` fault). E.g. ``--hordegenlen 100000`` on a
        4096-token context declares 3277. Lowered to koboldcpp's ``--genlimit``
        (:attr:`kcpp_genlimit`) too, where koboldcpp stops every generation.
        Never below 1.

        Seed: "1. Declare chat on pop" (chat limits).
        """
        declared = min(self.max_length, kcpp_max_uncut_length(self.max_context_length))
        if self.kcpp_genlimit > 0:
            declared = min(declared, self.kcpp_genlimit)
        return max(1, declared)

    def max_length_warning(self) -> str | None:
        """One start-up warning line when ``--hordegenlen`` was lowered, else None.

        E.g. ``"max_length 100000 (--hordegenlen) is lowered to 3277: koboldcpp
        cuts a max_length above 3277 on this worker's 4096-token context, which
        keeps room for the prompt"`` (also when the value is the default, 1024).
        """
        declared = self.declared_max_length
        if declared >= self.max_length:
            return None
        if 0 < self.kcpp_genlimit <= declared:
            return (
                f"max_length {self.max_length} (--hordegenlen) is lowered to {declared}: "
                f"koboldcpp's --genlimit {self.kcpp_genlimit} stops every generation there"
            )
        return (
            f"max_length {self.max_length} (--hordegenlen) is lowered to {declared}: koboldcpp "
            f"cuts a max_length above {declared} on this worker's {self.max_context_length}-token "
            "context, which keeps room for the prompt"
        )

    @property
    def lease_cap_s(self) -> float:
        """How far progress posts can extend a lease, in seconds from pop."""
        return 600.0 if self.trusted else 200.0

    def replace(self, **changes: object) -> WorkerSettings:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
