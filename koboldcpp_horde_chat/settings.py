"""Every knob of the worker in one frozen dataclass, and koboldcpp's own cut of a
request's ``max_length`` (1.116.1 ``koboldcpp.py`` L2168-2180), which decides the
declared ``max_length`` and a reply's budget.

Seed: "1. Declare chat on pop" and "Worked example: koboldcpp's embedded worker".
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from . import BRIDGE_AGENT

DEFAULT_HORDE_URL = "https://aihorde.net"
DEFAULT_KCPP_URL = "http://127.0.0.1:5001"
MIB = 1024 * 1024

def kcpp_reserved_tokens(context: int) -> int:
    """Tokens koboldcpp keeps for the prompt when it cuts a ``max_length`` (``koboldcpp.py``
    L2173), e.g. 819 for a 4096-token context, 200 for 1000."""
    return max(min(context - 4, 16), int(context * 0.2))


def kcpp_max_uncut_length(context: int) -> int:
    """The largest ``max_length`` koboldcpp generates in full within ``context`` tokens:
    3277 for 4096, 800 for 1000."""
    return context - kcpp_reserved_tokens(context)


def kcpp_effective_max_length(
    max_length: int, max_context_length: int, kcpp_max_context: int, genlimit: int = 0
) -> int:
    """The budget koboldcpp really generates under for one request, tokens (it
    reports ``"length"`` when it used it up), e.g. ``(900, 1000, 4096) -> 800``,
    ``(4000, 8192, 4096) -> 3277``, ``(512, 4096, 4096, genlimit=200) -> 200``;
    ``genlimit`` 0 or less: none."""
    context = min(max_context_length, kcpp_max_context)
    if genlimit > 0:
        max_length = min(max_length, genlimit)
    return min(max_length, kcpp_max_uncut_length(context))


def kcpp_context_keeping_budget(
    max_length: int, max_context_length: int, kcpp_max_context: int
) -> int:
    """The smallest context, from the job's up to koboldcpp's own, within which
    koboldcpp generates ``max_length`` whole, tokens: ``(420, 500, 4096) -> 524``,
    ``(4000, 4096, 4096) -> 4096``. Send it only once the fit check passed: the
    prompt then fits, so the model sees the same prompt."""
    contexts = range(min(max_context_length, kcpp_max_context), kcpp_max_context + 1)
    # kcpp_max_uncut_length never decreases as the context grows: bisect.
    found = bisect.bisect_left(contexts, max_length, key=kcpp_max_uncut_length)
    return contexts[min(found, len(contexts) - 1)]


@dataclass(frozen=True)
class WorkerSettings:
    """The worker's configuration; counts are tokens, other units in the names.

    The API key (sent only to ``horde_url``) and koboldcpp's password are kept
    out of ``repr``. ``backend_model_name``: what koboldcpp reports, standalone
    only. ``horde_max_context_length`` 0: the backend's. ``kcpp_max_request_bytes``:
    koboldcpp's ``--maxrequestsize``; a larger chat request is faulted unsent.
    ``kcpp_genlimit`` 0: none. ``lease_s``: a job's lease when the pop has no ``ttl``.
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
        backend = self.backend_max_context_length
        horde = self.horde_max_context_length
        return min(backend, horde) if horde > 0 else backend

    @property
    def declared_max_length(self) -> int:
        """``--hordegenlen``, lowered to what koboldcpp generates whole in the declared
        context (a larger budget leaves no room for a prompt) and to its
        ``--genlimit``; at least 1."""
        ctx = self.max_context_length
        return max(1, kcpp_effective_max_length(self.max_length, ctx, ctx, self.kcpp_genlimit))

    def max_length_warning(self) -> str | None:
        """One start-up warning line when ``--hordegenlen`` was lowered, else None."""
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
        return 600.0 if self.trusted else 200.0
