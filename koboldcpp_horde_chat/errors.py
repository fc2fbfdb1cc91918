"""One exception tree for the worker: the I/O edges turn ``requests`` exceptions and
HTTP statuses into these. Messages never contain the API key or a password.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any


class HordeChatError(Exception):
    """Base class."""


class ConfigError(HordeChatError):
    """The worker cannot start with these settings (bad flag, protected backend...)."""


# --- the Horde ---------------------------------------------------------------


@dataclass(eq=False, repr=False)
class HordeError(HordeChatError):
    """An answer from the Horde other than success (``status`` 0: no answer; ``rc``:
    the Horde's return code or ``""``; ``body``: the answer's JSON object or {};
    ``retry_after_s`` and ``sent``: see :class:`HordeUnavailable`)."""

    message: str
    _: KW_ONLY
    status: int = 0
    rc: str = ""
    job_id: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    retry_after_s: float | None = None
    sent: bool | None = None

    def __str__(self) -> str:
        return self._describe(with_job=True)

    @property
    def reason(self) -> str:
        """The error without its job id, for a log line that names the job already."""
        return self._describe(with_job=False)

    def _describe(self, *, with_job: bool) -> str:
        named = (("status", self.status), ("rc", self.rc), ("job", with_job and self.job_id))
        parts = [f"{name}={value}" for name, value in named if value]  # status 0: no answer
        return f"{self.message} ({', '.join(parts)})" if parts else self.message


class HordeRefusal(HordeError):
    """A definitive 4xx answer (400, 401, 403, 404, 409, 413...). Not retryable."""


class HordeUnavailable(HordeError):
    """5xx, 429 or a network failure (status 0), with its ``Retry-After`` in seconds
    or None. ``sent`` False: the request certainly did not reach the Horde
    (connection refused); None: it may have."""


# --- koboldcpp -----------------------------------------------------------------


@dataclass(eq=False, repr=False)
class BackendError(HordeChatError):
    """koboldcpp failed: connection refused, timeout, 5xx, invalid JSON... (``status``
    0: no answer)."""

    detail: str
    _: KW_ONLY
    status: int = 0


class BackendUnauthorized(BackendError):
    """koboldcpp answered 401, or masks the model name: the password is missing or wrong."""


class BackendBusy(BackendError):
    """koboldcpp answered 503 "Server is busy"."""


# --- inputs --------------------------------------------------------------------


class FetchError(HordeChatError):
    """A ``messages_url`` or image URL could not be fetched, was too large or invalid."""


@dataclass(eq=False, repr=False)
class PayloadError(HordeChatError):
    """A popped job's payload is malformed at ``path`` (``"payload.messages[2].role"``)."""

    path: str
    problem: str
    _: KW_ONLY
    job_id: str | None = None

    def __post_init__(self) -> None:
        self.args = (f"{self.path}: {self.problem}",)


@dataclass(eq=False, repr=False)
class ReplyError(HordeChatError):
    """koboldcpp's reply cannot be submitted (finish reason ``error``, a malformed tool
    call...); ``feature``: the declared feature whose part is unusable, or None."""

    why: str
    _: KW_ONLY
    feature: str | None = None


# --- serving a job -----------------------------------------------------------------


@dataclass(eq=False, repr=False)
class JobFault(HordeChatError):
    """The job cannot be served: fault it (seed "7. Fault a job").

    ``counts`` False: the Horde counts the fault apart (after a
    ``ChatSubmitNonconformant`` refusal), not toward maintenance.
    ``backend_failed``: the loop checks koboldcpp answers before the next pop.
    ``feature``: the declared feature a refused reply pointed at, or None.
    """

    why: str
    _: KW_ONLY
    fault_reason: str | None = None
    counts: bool = True
    backend_failed: bool = False
    feature: str | None = None


@dataclass(eq=False, repr=False)
class JobEnded(HordeChatError):
    """The job ended without a submit: the client cancelled it, or the Horde ended
    it (``counted``: ``ChatJobAborted``, counted toward maintenance)."""

    why: str
    _: KW_ONLY
    counted: bool = False
