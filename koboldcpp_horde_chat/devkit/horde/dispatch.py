"""What every route of the dev Horde shares over HTTP: the request log and the pops
seen, scripted answers (:meth:`DevHorde.inject`), the body and key checks.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from koboldcpp_horde_chat.devkit._http import Request, Response
from koboldcpp_horde_chat.devkit.horde.helpers import _ApiError, _is_int, log
from koboldcpp_horde_chat.devkit.horde.state import HordeCore, _Job


class Dispatch(HordeCore):
    """The request log, scripted answers and the checks before any route runs."""

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

    def inject(self, route: str, *responses: Any) -> None:
        """Queue scripted answers for the next calls of ``route``.

        ``route`` is ``"pop"``, ``"submit"``, ``"progress"`` or ``"storage"``. Each
        response is used once, in order, then normal service resumes:

        * ``(status, json_body)`` or ``(status, json_body, headers)``: answered as
          is (with those extra headers, e.g. ``{"Retry-After": "2"}``); the call
          is not processed;
        * ``"reset"``: the connection is closed without an answer; not processed;
        * ``"hang:<seconds>"``: sleep, then process and answer normally;
        * ``"late:<seconds>"``: process at once, answer after sleeping (a stored
          submit whose answer is still on its way);
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
                if item.startswith(("hang:", "late:")):
                    float(item[5:])
                elif item not in ("reset", "truncate", "drop", "ok"):
                    raise ValueError(f"unknown scripted response {item!r}")
            else:
                raise ValueError(f"unknown scripted response {item!r}")
        with self._lock:
            self._scripts[route].extend(responses)

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
        if script.startswith("late:"):
            time.sleep(float(script[5:]))
            return resp
        if script == "truncate":
            resp.truncate = True
        elif script == "drop":
            resp.reset = True
        return resp

    @staticmethod
    def _json_or_none(req: Request) -> Any:
        try:
            return req.json()
        except ValueError:
            return None

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
