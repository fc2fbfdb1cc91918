"""The client's side: chat and text requests, their status, waiting, cancelling,
the worker details and the client routes over HTTP.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterable
from typing import Any

from koboldcpp_horde_chat.devkit._http import Request, Response
from koboldcpp_horde_chat.devkit.horde.chat import ChatContract, _validate_chat_body
from koboldcpp_horde_chat.devkit.horde.helpers import _ApiError, _is_int, log
from koboldcpp_horde_chat.devkit.horde.state import _Req, _Worker
from koboldcpp_horde_chat.devkit.horde.values import _FINAL_STATES


class ClientRoutes(ChatContract):
    """What a client (or a test) sends and sees, in process and over HTTP."""

    def send_chat(
        self,
        body: dict[str, Any],
        *,
        best_effort: bool = False,
        max_attempts: int | None = None,
        validated_backends: bool = False,
    ) -> str:
        """Queue a client's chat request; returns its request id.

        ``body`` holds OpenAI chat-completions fields: ``messages``, ``tools``,
        ``tool_choice``, ``parallel_tool_calls``, ``response_format``,
        ``temperature``, ``top_p``, ``frequency_penalty``, ``presence_penalty``,
        ``seed``, ``stop``, ``max_tokens`` (tokens), ``reasoning_effort``,
        ``stream``, ``model`` (a ``model_id`` to require), plus the Horde's
        optional ``max_context_length`` (tokens). ``best_effort`` opts out of
        strict conformance. ``validated_backends`` (false by default, as the real
        Horde stores a request that leaves it out: its parser's default, whatever
        its API model documents) sends the request only to workers whose bridge
        agent names a validated backend (:data:`LLM_VALIDATED_BACKENDS`). A
        faulted or expired job puts the request back at the head of the queue,
        for the worker that faulted it too; the sweep (every ``sweep_s``) faults
        it once it has more than 2 such jobs, as on the real Horde.
        ``max_attempts`` (a test hook the real Horde lacks) faults it at once at
        its n-th such job instead. Raises
        ``ValueError`` naming an invalid field, or an image the dev Horde cannot
        store (see the module docstring: a data URL or an http(s) URL on
        127.0.0.1, within the caps, a JPEG of longest side at most 2048 or
        converted by ``image_converter``).
        """
        _validate_chat_body(body)
        if not self.chat_routes:
            raise ValueError("this Horde has no chat routes")
        if max_attempts is not None and max_attempts < 1:
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
        max_attempts: int | None = None,
        validated_backends: bool = False,
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

    def find_user(self, key: str | None) -> dict[str, Any]:
        """The user an API key belongs to (``GET /api/v2/find_user``, the ``apikey``
        header), answered as the real Horde answers (its ``FindUser``): no key is
        401 ``InvalidAPIKey``, a key it does not know 404 ``UserNotFound`` (whose
        message repeats the key, as the real one's does), a known key
        ``{"username": "dev-user#<n>", "id": <n>, "kudos", "worker_count",
        "trusted"}`` (``trusted`` as the constructor's).

        Raises ``_ApiError`` for the refusals.
        """
        if not key:
            raise _ApiError(401, "InvalidAPIKey", "No user matching sent API Key.")
        if key not in self.api_keys:
            raise _ApiError(404, "UserNotFound", f"User with api_key '{key}' not found.")
        user_id = sorted(self.api_keys).index(key) + 1
        with self._lock:
            workers = sum(1 for w in self._workers.values() if w.owner_key == key)
        return {
            "username": f"dev-user#{user_id}",
            "id": user_id,
            "kudos": 0.0,
            "worker_count": workers,
            "trusted": self.trusted,
        }

    def _client_route(self, req: Request) -> Response:
        parts = [p for p in req.path.split("/") if p]
        method = req.method
        if parts[:4] == ["api", "v2", "generate", "chat"] and not self.chat_routes:
            raise _ApiError(404, "NotFound", "This Horde has no chat routes.")
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
                    max_attempts=(
                        None
                        if horde.get("max_attempts") is None
                        else int(horde["max_attempts"])
                    ),
                    validated_backends=horde.get("validated_backends") is True,
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
                validated_backends=body.get("validated_backends") is True,
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
        if parts == ["api", "v2", "find_user"]:
            if method != "GET":
                raise _ApiError(405, "MethodNotAllowed", "Use GET.")
            return Response.json(200, self.find_user(req.headers.get("apikey")))
        if parts == ["api", "v2", "dev", "ledger"]:
            return Response.json(200, self.ledger)
        raise _ApiError(404, "NotFound", f"No route {req.method} {req.path}.")

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
