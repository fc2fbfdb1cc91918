"""What the worker calls on a Horde client: the seam a fake Horde implements.

:class:`HordeAPI` is the Horde client as the pop loop, the pop beside a
submit, a job's run (its progress posts) and the submit pipeline use it.
:class:`~.client.HordeClient` implements it over HTTP; tests pass an
in-process Horde typed against it, checked by ``mypy --strict``.

Seed: "Worked example: the pop loop" steps 1, 6 and 7 and "Streaming progress".
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class HordeAPI(Protocol):
    """The Horde's text worker routes, as the worker calls them.

    Every call takes a JSON body (a dict) and returns the decoded JSON answer,
    and raises only ``errors.HordeRefusal`` (4xx, a redirect) or
    ``errors.HordeUnavailable`` (429, 5xx, no answer, an unreadable answer);
    ``timeout_s`` is the read timeout in seconds.
    """

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST ``/api/v2/generate/text/pop`` with the declaration (seed step 1)."""
        ...

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST ``/api/v2/generate/text/submit``: a reply or a fault (seed steps 6, 7)."""
        ...

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST ``/api/v2/generate/text/progress`` (seed "Streaming progress")."""
        ...

    def close(self) -> None:
        """Release the client's connections (a client used on one thread is done)."""
        ...


@runtime_checkable
class FindsUser(Protocol):
    """A Horde client that can read the API key's owner (``HordeClient`` does)."""

    def find_user(self, *, timeout_s: float) -> dict[str, Any]:
        """GET ``/api/v2/find_user``: the key's owner (``trusted`` among its keys)."""
        ...
