"""The worker routes: pop (with moderator messages), submit (steps 6 and 7, faults and
refusals) and "Streaming progress".
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from koboldcpp_horde_chat.devkit._http import Response
from koboldcpp_horde_chat.devkit.horde.chat import ChatContract
from koboldcpp_horde_chat.devkit.horde.eligibility import Eligibility
from koboldcpp_horde_chat.devkit.horde.helpers import (
    _ApiError,
    _invalid_input,
    _is_int,
    _job_answer,
    _nul_path,
    _rfc822,
    log,
)
from koboldcpp_horde_chat.devkit.horde.state import (
    _Declaration,
    _Job,
    _Req,
    _Worker,
    _WorkerMessage,
)
from koboldcpp_horde_chat.devkit.horde.values import (
    FAULT_REASON_SENTENCES,
    PROGRESS_BYTES_PER_TOKEN,
    PROGRESS_MAX_POSTS,
    SUBMIT_STATES,
    WORKER_MESSAGE_S,
)


class WorkerRoutes(ChatContract, Eligibility):
    """The pop, the submit and progress posts of a worker."""

    def add_worker_message(
        self,
        message: str,
        *,
        worker: str | None = None,
        origin: str | None = "moderator",
        expiry_s: float = WORKER_MESSAGE_S,
    ) -> str:
        """Leave a moderator message for a worker's owner; returns its id.

        Every pop answer of worker ``worker`` (of every worker when None) lists
        it under ``messages`` as ``{"id", "message", "origin", "expiry"}`` until
        ``expiry_s`` seconds from now (``expiry`` is an RFC 822 date; ``origin``
        None leaves the key out).
        """
        item = _WorkerMessage(
            id=str(uuid.uuid4()),
            worker=worker,
            message=str(message),
            origin=origin,
            expiry=time.time() + float(expiry_s),
        )
        with self._lock:
            self._worker_messages.append(item)
        return item.id

    def _messages_for(self, worker: str) -> list[dict[str, Any]]:
        now = time.time()
        out: list[dict[str, Any]] = []
        for m in self._worker_messages:
            if m.expiry <= now or m.worker not in (None, worker):
                continue
            entry: dict[str, Any] = {"id": m.id, "message": m.message}
            if m.origin is not None:
                entry["origin"] = m.origin
            entry["expiry"] = _rfc822(m.expiry)
            out.append(entry)
        return out

    def _pop(self, body: dict[str, Any], key: str) -> Response:
        decl = self._declaration(body)
        now = time.monotonic()
        with self._lock:
            self._expire_locked()
            worker = self._workers.get(decl.name)
            if worker is not None and worker.owner_key != key:
                raise _ApiError(
                    403, "WrongCredentials", "This worker name belongs to another API key."
                )
            if worker is None:
                worker = self._workers[decl.name] = _Worker(
                    decl.name, decl, owner_key=key, aborted_since=now
                )
            worker.decl = decl
            worker.last_pop = now
            if worker.maintenance:
                # The real Horde's horde/apis/v2/base.py JobPopTemplate: a worker in
                # maintenance is offered only its owner's own requests, and a pop that
                # finds none is answered 403 WorkerMaintenance with the worker's
                # maintenance message. Every dev Horde request is a client's.
                refusal = {"message": worker.maintenance_msg, "rc": "WorkerMaintenance"}
                self._pops.append(
                    {
                        "worker": decl.name,
                        "body": copy.deepcopy(body),
                        "status": 403,
                        "response": copy.deepcopy(refusal),
                    }
                )
                log.info("pop by %s refused: the worker is in maintenance", decl.name)
                return Response.json(403, refusal)
            chosen: _Req | None = None
            text_model: str | None = None
            skipped: dict[str, int] = {}
            for req in sorted(self._requests.values(), key=lambda r: r.order):
                if req.state != "waiting":
                    continue
                reason: str | None
                if req.kind == "text":
                    text_model, reason = self._text_eligible(req, decl)
                    if text_model is not None:
                        chosen = req
                        break
                else:
                    ok, reason = self._chat_eligible(req, decl)
                    if ok:
                        chosen = req
                        break
                if reason is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
            if chosen is None:
                # Only an answer without a job reports what the pop passed over.
                answer: dict[str, Any] = {"id": None, "ids": [], "skipped": skipped}
            elif chosen.kind == "text":
                answer = self._assign_text(chosen, decl, text_model, now)
            else:
                answer = self._assign_chat(chosen, decl, now)
            answer["messages"] = self._messages_for(decl.name)
            self._pops.append(
                {
                    "worker": decl.name,
                    "body": copy.deepcopy(body),
                    "status": 200,
                    "response": copy.deepcopy(answer),
                }
            )
            self._changed.notify_all()
        if chosen is not None:
            log.info("pop by %s: %s job %s", decl.name, chosen.kind, answer["id"])
        return Response.json(200, answer)

    def _assign_text(
        self, req: _Req, decl: _Declaration, model: str | None, now: float
    ) -> dict[str, Any]:
        job = self._new_job(req, decl, model, req.max_length, now)
        payload = copy.deepcopy(req.params)
        payload.update(
            {
                "prompt": req.prompt,
                "max_length": req.max_length,
                "max_context_length": req.max_context_length,
            }
        )
        return _job_answer(job.id, payload, self._ttl_value(), model)

    def _submit(self, body: dict[str, Any], key: str) -> Response:
        job_id = body.get("id")
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id) if isinstance(job_id, str) else None
            if job is None:
                raise _ApiError(404, "InvalidJobID", "No job with this id.")
            self._check_owner(job, key)
            req = self._requests[job.request_id]
            try:
                state = body.get("state", "ok")
                if state not in SUBMIT_STATES:
                    raise _invalid_input(
                        "state", f"{state!r} is not one of {list(SUBMIT_STATES)}"
                    )
                if state == "faulted":
                    self._check_fault_shape(job, body)
                if job.action is not None:
                    answer = self._ended(job, body, state)
                    self._changed.notify_all()
                    return Response.json(200, answer)
                where = _nul_path(body)
                if where is not None:
                    raise _ApiError(
                        400,
                        "NulByteInPayload",
                        f"The submit holds a NUL character (U+0000) at {where}; "
                        "nothing was stored.",
                    )
                if state == "faulted":
                    answer = self._fault(job, req, body)
                elif job.kind == "text":
                    answer = self._text_reply(job, req, body)
                else:
                    answer = self._chat_reply(job, req, body)
                if state != "faulted":
                    log.info(
                        "job %s submitted (%s kudos); request %s is %s",
                        job.id, answer.get("reward"), req.id, req.state,
                    )
            except _ApiError as err:
                action = {"DuplicateGen": "duplicate", "AbortedGen": "aborted_gen"}.get(
                    err.rc or "", "refused"
                )
                self._record(job, action, err.status, err.rc, None, body)
                if action == "refused" and job.action is None:
                    job.last_refusal = (err.rc, err.message)
                    req.refusals.append({"job_id": job.id, "rc": err.rc, "message": err.message})
                log.info("submit of job %s refused: %s %s", job.id, err.rc, err.message)
                raise
            self._changed.notify_all()
        return Response.json(200, answer)

    def _ended(self, job: _Job, body: dict[str, Any], state: str) -> dict[str, Any]:
        """A submit for a job that already ended; raises its refusal as an ``_ApiError``.

        As the real Horde's horde/apis/v2/base.py ``JobSubmitTemplate.validate``
        answers what horde/classes/kobold/processing_generation.py ``set_generation``
        returns: a job with a stored reply answers 400 ``DuplicateGen`` to any
        submit; a job that ended without one (expired, faulted, or cancelled: the
        real Horde marks each faulted) answers a fault 200 ``{"reward": 0}`` (the
        ``kudos == -1`` branch for ``state == "faulted"``), and anything else 400
        ``AbortedGen``.

        A fault is never free there: ``set_generation`` runs ``self.wp.n += 1``
        for every faulted submit before it looks at the job, so a fault for a
        job that already ended (accepted, faulted, expired) re-opens its
        request: another worker generates it again. So here too: the request
        goes back to the queue when it had ended (``reopened`` counts it), and
        the fault is kept in :attr:`late_faults` (ledger ``late_fault``) for a
        test to see that none was sent.
        """
        if state == "faulted":
            self._reopen(job, body)
        if job.action == "submitted":
            raise _ApiError(400, "DuplicateGen", "This job was already submitted.")
        if state != "faulted":
            raise _ApiError(400, "AbortedGen", "This job has ended; it was not stored.")
        return {"reward": 0}

    def _reopen(self, job: _Job, body: dict[str, Any]) -> None:
        """A fault for job ``job``, which had ended: its request is re-opened."""
        req = self._requests[job.request_id]
        req.reopened += 1
        if req.state in ("done", "faulted"):
            req.state = "waiting"
        self._record(job, "late_fault", 200 if job.action != "submitted" else 400,
                     None, None, body)
        self._late_faults.append(
            {"job_id": job.id, "request_id": req.id, "ended": job.action, "worker": job.worker}
        )
        log.warning("job %s faulted after it ended (%s): request %s re-opened, as the real "
                    "Horde's wp.n += 1 does", job.id, job.action, req.id)

    def _check_fault_shape(self, job: _Job, body: dict[str, Any]) -> None:
        """The input check of a faulted submit (before any state is looked at).

        ``model_id`` marks a chat submit, which needs no ``generation``; any other
        faulted submit (a text job's, or a chat job's without ``model_id``) is a
        text submit and needs ``generation`` (400 input validation otherwise).
        """
        if job.kind == "text" or body.get("model_id") is None:
            if not isinstance(body.get("generation"), str):
                raise _invalid_input(
                    "generation",
                    "a text submit needs generation (a chat submit is marked by model_id)",
                )
        elif "message" in body or "generation" in body:
            raise _ApiError(
                400,
                "ChatSubmitInvalid",
                "A faulted chat submit has neither generation nor message.",
            )

    def _fault(self, job: _Job, req: _Req, body: dict[str, Any]) -> dict[str, Any]:
        """Step 7: accept a faulted submit, reward 0, give the request back to the queue.

        The fault counts as an aborted job of the worker (the real Horde's
        horde/classes/kobold/processing_generation.py ``set_generation`` calls
        ``abort()`` for ``state == "faulted"``), except a fault after a
        ``ChatSubmitNonconformant`` refusal, counted under ``nonconformant_replies``.
        """
        reason = body.get("fault_reason")
        kept = reason if reason in FAULT_REASON_SENTENCES else None
        job.action = "faulted"
        self._record(job, "faulted", 200, None, kept, body)
        worker = self._workers.get(job.worker)
        refusal = job.last_refusal
        if refusal is not None and refusal[0] == "ChatSubmitNonconformant":
            if worker is not None:
                worker.nonconformant_replies += 1
        else:
            self._log_aborted_job(job.worker, time.monotonic())
        if kept is not None:
            req.fault_reasons.append(kept)
            req.return_code = "ChatWorkerFault"
            if refusal is not None and kept == "reply_refused":
                req.return_message = refusal[1]
            else:
                req.return_message = FAULT_REASON_SENTENCES[kept]
        elif refusal is not None and refusal[0] == "ChatSubmitNonconformant":
            req.return_code = "ChatWorkerFault"
            req.return_message = refusal[1]
        if req.state == "processing" and req.job_ids[-1] == job.id:
            self._restart(req)
        log.info("job %s faulted (reason=%s); request %s is %s", job.id, kept, req.id, req.state)
        return {"reward": 0}

    def _text_reply(self, job: _Job, req: _Req, body: dict[str, Any]) -> dict[str, Any]:
        if "message" in body:
            raise _ApiError(
                400, "ChatSubmitInvalid", "A text job is submitted with generation, not message."
            )
        generation = body.get("generation")
        if not isinstance(generation, str):
            raise _invalid_input("generation", "a text job is submitted with generation")
        reward = self._reward(job, len(generation.encode()))
        job.action = "submitted"
        self._record(job, "submitted", 200, None, None, body)
        if req.state == "processing":
            req.state = "done"
        req.generation = generation
        req.reward = reward
        return {"reward": reward}

    def _progress(self, body: dict[str, Any], key: str) -> Response:
        """"Streaming progress": sequencing, retries, caps, cancel and lease extension."""
        job_id = body.get("id")
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id) if isinstance(job_id, str) else None
            if job is None:
                raise _ApiError(404, "InvalidJobID", "No job with this id.")
            self._check_owner(job, key)
            if not job.stream_progress:
                raise _ApiError(
                    404, "ChatProgressNotStreaming", "This job does not stream progress."
                )
            seq = body.get("seq")
            delta = body.get("delta")
            if job.action == "cancelled":
                accepted = seq if _is_int(seq) and seq == job.last_seq + 1 else job.last_seq
                return Response.json(200, {"accepted_seq": accepted, "cancelled": True})
            if job.action is not None:
                raise _ApiError(404, "ChatJobAborted", "This job has ended.")
            if not _is_int(seq) or seq < 1:
                raise _ApiError(400, "ChatProgressInvalid", "seq must be a positive integer.")
            if not isinstance(delta, dict):
                raise _ApiError(400, "ChatProgressInvalid", "delta must be an object.")
            if delta.get("content") is None and delta.get("reasoning_content") is None:
                raise _ApiError(
                    400,
                    "ChatProgressInvalid",
                    "delta must include content, reasoning_content or both.",
                )
            content = delta.get("content", "")
            reasoning = delta.get("reasoning_content", "")
            if content is None:
                content = ""
            if reasoning is None:
                reasoning = ""
            if not isinstance(content, str) or not isinstance(reasoning, str):
                raise _ApiError(
                    400, "ChatProgressInvalid", "delta content and reasoning must be strings."
                )
            expected = job.last_seq + 1
            if job.last_seq and seq == job.last_seq:
                if (content, reasoning) == job.last_delta:
                    return Response.json(200, {"accepted_seq": seq, "cancelled": False})
                raise _ApiError(
                    409,
                    "ChatProgressOutOfSequence",
                    "The content under an accepted seq cannot change.",
                    {"expected_seq": expected},
                )
            if seq != expected:
                raise _ApiError(
                    409,
                    "ChatProgressOutOfSequence",
                    f"seq {seq} is out of sequence; expected {expected}.",
                    {"expected_seq": expected},
                )
            nbytes = len(content.encode("utf-8")) + len(reasoning.encode("utf-8"))
            if (
                job.progress_posts >= PROGRESS_MAX_POSTS
                or job.progress_bytes + nbytes > PROGRESS_BYTES_PER_TOKEN * job.max_length
            ):
                raise _ApiError(413, "ChatProgressCapReached", "The progress cap is reached.")
            job.progress_posts += 1
            job.progress_bytes += nbytes
            job.last_seq = seq
            job.last_delta = (content, reasoning)
            entry: dict[str, Any] = {"seq": seq, "content": content}
            if "reasoning_content" in delta:
                entry["reasoning_content"] = reasoning
            req = self._requests[job.request_id]
            req.stream.append(entry)
            if nbytes:
                now = time.monotonic()
                job.lease_until = max(
                    job.lease_until, min(now + self.ttl_s, job.popped_at + self.lease_cap_s)
                )
            self._changed.notify_all()
        return Response.json(200, {"accepted_seq": seq, "cancelled": False})
