"""One exception tree for the worker: the I/O edges turn ``requests`` exceptions and
HTTP statuses into these. Messages never contain the API key or a password.
"""

from __future__ import annotations

from typing import Any


class HordeChatError(Exception):
    """Base class. ``retryable`` is True when the same call may succeed later."""

    retryable: bool = False


class ConfigError(HordeChatError):
    """The worker cannot start with these settings (bad flag, protected backend...)."""


# --- the Horde ---------------------------------------------------------------


class HordeError(HordeChatError):
    """An answer from the Horde other than success (``status`` 0: no answer; ``rc``:
    the Horde's return code or ``""``; ``body``: the answer's JSON object or {};
    ``retry_after_s`` and ``sent``: see :class:`HordeUnavailable`)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        rc: str = "",
        job_id: str | None = None,
        body: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
        sent: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.rc = rc
        self.job_id = job_id
        self.body = body if body is not None else {}
        self.retry_after_s = retry_after_s
        self.sent = sent

    def __str__(self) -> str:
        return self._describe(with_job=True)

    @property
    def reason(self) -> str:
        """The error without its job id, for a log line that names the job already."""
        return self._describe(with_job=False)

    def _describe(self, *, with_job: bool) -> str:
        parts = [f"status={self.status}"] if self.status else []  # 0: no HTTP answer
        if self.rc:
            parts.append(f"rc={self.rc}")
        if self.job_id and with_job:
            parts.append(f"job={self.job_id}")
        return f"{self.message} ({', '.join(parts)})" if parts else self.message


class HordeRefusal(HordeError):
    """A definitive 4xx answer (400, 401, 403, 404, 409, 413...). Not retryable."""


class HordeUnavailable(HordeError):
    """5xx, 429 or a network failure (status 0), with its ``Retry-After`` in seconds
    or None. ``sent`` False: the request certainly did not reach the Horde
    (connection refused); None: it may have."""

    retryable = True


# --- koboldcpp -----------------------------------------------------------------


class BackendError(HordeChatError):
    """koboldcpp failed: connection refused, timeout, 5xx, invalid JSON... (``status``
    0: no answer)."""

    retryable = True

    def __init__(self, detail: str, *, status: int = 0) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


class BackendUnauthorized(BackendError):
    """koboldcpp answered 401, or masks the model name: the password is missing or wrong."""

    retryable = False


class BackendBusy(BackendError):
    """koboldcpp answered 503 "Server is busy"."""


# --- inputs --------------------------------------------------------------------


class FetchError(HordeChatError):
    """A ``messages_url`` or image URL could not be fetched, was too large or invalid."""


class PayloadError(HordeChatError):
    """A popped job's payload is malformed at ``path`` (``"payload.messages[2].role"``)."""

    def __init__(self, path: str, problem: str, *, job_id: str | None = None) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
        self.job_id = job_id


class ReplyError(HordeChatError):
    """koboldcpp's reply cannot be submitted (finish reason ``error``, a malformed tool
    call...); ``feature``: the declared feature whose part is unusable, or None."""

    def __init__(self, why: str, *, feature: str | None = None) -> None:
        super().__init__(why)
        self.feature = feature


# --- serving a job -----------------------------------------------------------------


class JobFault(HordeChatError):
    """The job cannot be served: fault it (seed "7. Fault a job").

    ``counts`` False: the Horde counts the fault apart (after a
    ``ChatSubmitNonconformant`` refusal), not toward maintenance.
    ``backend_failed``: the loop checks koboldcpp answers before the next pop.
    ``feature``: the declared feature a refused reply pointed at, or None.
    """

    def __init__(
        self,
        why: str,
        *,
        fault_reason: str | None = None,
        counts: bool = True,
        backend_failed: bool = False,
        feature: str | None = None,
    ) -> None:
        super().__init__(why)
        self.why = why
        self.fault_reason = fault_reason
        self.counts = counts
        self.backend_failed = backend_failed
        self.feature = feature


class JobEnded(HordeChatError):
    """The job ended without a submit: the client cancelled it, or the Horde ended
    it (``counted``: ``ChatJobAborted``, counted toward maintenance)."""

    def __init__(self, why: str, *, counted: bool = False) -> None:
        super().__init__(why)
        self.counted = counted
