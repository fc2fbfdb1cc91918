"""One exception tree for the worker.

Every error the worker raises derives from :class:`HordeChatError`. The I/O
edges (``horde/client.py``, ``koboldcpp/client.py``, ``run/downloads.py``) translate ``requests``
exceptions and HTTP statuses into these classes, so no ``requests`` exception
escapes them. Each class says whether trying the same call again may help
(``retryable``). Messages never contain the Horde API key or a password.

Seed sections: "7. Fault a job" and "Submit refusals".
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
    """An answer from the Horde other than success.

    Attributes:
        status: HTTP status, or 0 when no response arrived.
        rc: the Horde's return code (``"ChatSubmitInvalid"``...), or ``""``.
        message: the Horde's ``message`` text (shortened), or a description.
        job_id: the job the call was about, when there is one.
        body: the decoded JSON body of the response, when it was a JSON object.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        rc: str = "",
        job_id: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.rc = rc
        self.job_id = job_id
        self.body = body if body is not None else {}

    def __str__(self) -> str:
        return self._describe(with_job=True)

    @property
    def reason(self) -> str:
        """The error without its job id, for a log line that names the job already
        (``"job=<id> submit failed (<reason>)"``): the message, then the status
        and ``rc`` when there are any, e.g. ``"submit: HTTP 503 (status=503)"``."""
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
    """5xx, 429 or a network failure (status 0). Retryable.

    ``retry_after_s`` holds the Horde's ``Retry-After`` in seconds when it sent one.
    ``sent`` is False when the request certainly did not reach the Horde
    (connection refused), True or None otherwise.
    """

    retryable = True

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
        super().__init__(message, status=status, rc=rc, job_id=job_id, body=body)
        self.retry_after_s = retry_after_s
        self.sent = sent


# --- koboldcpp -----------------------------------------------------------------


class BackendError(HordeChatError):
    """koboldcpp failed: connection refused, timeout, 5xx, invalid JSON...

    Attributes:
        status: HTTP status, or 0 when no response arrived.
        detail: a short description (never a password).
    """

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
    """A ``messages_url`` or image URL could not be fetched, was too large or invalid.

    The job is faulted without ``fault_reason`` (seed: "Fetch offloaded messages").
    """


class PayloadError(HordeChatError):
    """A popped job's payload is malformed.

    Attributes:
        path: where, as a JSON path such as ``"payload.messages[2].role"``.
        job_id: the job id when the pop carried one (so the job can be faulted).
    """

    def __init__(self, path: str, problem: str, *, job_id: str | None = None) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
        self.job_id = job_id


class ReplyError(HordeChatError):
    """The backend's reply cannot be submitted as a structured reply.

    For example finish reason ``error``, an unknown finish reason, or a malformed
    tool call. The job is faulted without ``fault_reason`` (seed: worked example).

    Attributes:
        feature: the declared feature whose part of the reply is unusable
            (``"tools"`` for a malformed tool call), or None.
    """

    def __init__(self, why: str, *, feature: str | None = None) -> None:
        super().__init__(why)
        self.feature = feature


# --- serving a job -----------------------------------------------------------------


class JobFault(HordeChatError):
    """A step of a job run cannot serve the job: fault it (seed "7. Fault a job").

    Raised by the job runs and turned into the fault submit and its log line
    in one place (the submit pipeline).

    Attributes:
        why: a one-line reason for the log (never a key or a password).
        fault_reason: the seed's ``fault_reason`` (``"prompt_overflow"``,
            ``"reply_refused"``), or None for a fault without one.
        counts: False for a fault the Horde counts apart (after a
            ``ChatSubmitNonconformant`` refusal): it does not count toward
            maintenance.
        backend_failed: koboldcpp failed the job (the loop then checks that it
            still answers before the next pop).
        feature: the declared feature or guarantee a refused reply pointed at
            (``guard.refused_reply_features``), or None: its fault counts
            toward stopping the pops, not toward withdrawing chat as a whole.
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
    """The job ended without a submit: the client cancelled it or the Horde
    ended it (``ChatJobAborted``). The local generation was aborted; nothing
    more is sent for it (seed "Streaming progress").

    Attributes:
        counted: the Horde ended the job itself (``ChatJobAborted``: its lease
            ran out, an aborted job it counts toward maintenance), not the
            client's cancel (settled, not counted).
    """

    def __init__(self, why: str, *, counted: bool = False) -> None:
        super().__init__(why)
        self.counted = counted
