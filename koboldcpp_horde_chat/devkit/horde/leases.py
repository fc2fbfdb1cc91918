"""Leases, expiry, aborted jobs and maintenance, and the ledger of terminal actions
(with the reward each submit earns).
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from koboldcpp_horde_chat.devkit.horde.helpers import _output_kudos, log
from koboldcpp_horde_chat.devkit.horde.state import HordeCore, _Declaration, _Job, _Req
from koboldcpp_horde_chat.devkit.horde.values import (
    MAINTENANCE_MESSAGE,
    MAX_ABORTED_JOBS,
    OWNER_MAINTENANCE_MESSAGE,
    SWEEP_FAULTED_JOBS,
    UNVALIDATED_KUDOS_FACTOR,
)


class Leases(HordeCore):
    """A job's lease from its pop to its end, the worker counts it feeds, the ledger."""

    def expire_leases(self) -> list[str]:
        """End the lease of every job still open now, as if its ttl had passed, and
        run the sweep now.

        Returns their ids. Each is recorded ``expired`` in the ledger, counts as
        an aborted job of its worker, and its request goes back to the queue (or
        faults: see :meth:`sweep`), so a test of a lost job need not wait out a
        real lease.
        """
        with self._lock:
            now = time.monotonic()
            ids = [job.id for job in self._jobs.values() if job.action is None]
            for job_id in ids:
                self._jobs[job_id].lease_until = now - 1e-3
            self._sweep_locked(now)
        return ids

    def sweep(self) -> None:
        """Run the Horde's sweep now (it runs every ``sweep_s`` by itself): abort
        each job whose lease passed and mark faulted each request with more than
        2 faulted jobs."""
        with self._lock:
            self._sweep_locked(time.monotonic())

    @property
    def ledger(self) -> list[dict[str, Any]]:
        """Every job's terminal or refused action, in order (deep copies).

        Each entry: ``{"job_id", "request_id", "kind": "chat"|"text", "worker",
        "action": "submitted"|"faulted"|"refused"|"duplicate"|"aborted_gen"|
        "late_fault"|"cancelled"|"expired", "status": HTTP status answered (None
        for cancelled and expired), "rc": return code or None, "fault_reason":
        kept reason or None, "body": the submit body or None}``. ``late_fault``
        is a fault for a job that had already ended (accepted, expired, faulted
        or cancelled): it re-opened the request, as on the real Horde
        (:attr:`late_faults`).
        """
        with self._lock:
            self._expire_locked()
            return copy.deepcopy(self._ledger)

    @property
    def late_faults(self) -> list[dict[str, Any]]:
        """Every fault sent for a job that had already ended, in order:
        ``{"job_id", "request_id", "ended": "submitted"|"expired"|"faulted"|"cancelled",
        "worker"}``. Each re-opened its request (the real Horde's ``wp.n += 1``):
        another worker generates it again and the requester waits and pays
        again. The tests' common fixture fails a test that caused one unless
        the test is marked ``late_fault_expected``."""
        with self._lock:
            return copy.deepcopy(self._late_faults)

    def job(self, job_id: str) -> dict[str, Any] | None:
        """A job's state for tests: ``{"id", "request_id", "kind", "worker", "model",
        "action", "lease_remaining_s", "last_seq", "stream_progress"}``."""
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
            if job is None:
                return None
            return {
                "id": job.id,
                "request_id": job.request_id,
                "kind": job.kind,
                "worker": job.worker,
                "model": job.model,
                "action": job.action,
                "lease_remaining_s": job.lease_until - time.monotonic(),
                "last_seq": job.last_seq,
                "stream_progress": job.stream_progress,
            }

    def set_maintenance(self, name: str, active: bool, message: str | None = None) -> None:
        """Put worker ``name`` into maintenance or take it out, as its owner can.

        In maintenance every pop of the worker is answered 403 ``WorkerMaintenance``
        with ``message`` (:data:`OWNER_MAINTENANCE_MESSAGE` when None). Taking it out leaves the
        aborted-job count as it is. Raises ``KeyError`` for a worker that never popped.
        """
        with self._lock:
            w = self._workers[name]
            w.maintenance = bool(active)
            w.maintenance_msg = (message or OWNER_MAINTENANCE_MESSAGE) if active else ""
        log.info("worker %s maintenance %s", name, "on" if active else "off")

    def _new_job(
        self, req: _Req, decl: _Declaration, model: str | None, max_length: int, now: float
    ) -> _Job:
        job = _Job(
            id=str(uuid.uuid4()),
            request_id=req.id,
            kind=req.kind,
            worker=decl.name,
            model=model,
            limits=dict(decl.limits),
            popped_at=now,
            lease_until=now + self.ttl_s,
            max_length=max_length,
        )
        self._jobs[job.id] = job
        req.job_ids.append(job.id)
        req.state = "processing"
        req.worker = decl.name
        req.model = model
        return job

    def _ttl_value(self) -> float | int:
        return int(self.ttl_s) if self.ttl_s == int(self.ttl_s) else self.ttl_s

    def _reward(self, job: _Job, nbytes: int) -> float:
        """The kudos for ``nbytes`` of output: 0.3 x for a worker whose backend the
        Horde does not validate (its bridge agent at the time of the reward)."""
        reward = _output_kudos(nbytes)
        worker = self._workers.get(job.worker)
        if worker is not None and not worker.decl.validated:
            reward = round(reward * UNVALIDATED_KUDOS_FACTOR, 2)
        return reward

    def _expire_locked(self) -> None:
        """Run the sweeps due by now (every ``sweep_s`` seconds since the start; at
        every call when ``sweep_s`` is 0). Called by every call that looks at state,
        so the sweep is lazy: what it would have done by now is done first."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._sweep_locked(now)
        if self.sweep_s > 0:
            missed = (now - self._next_sweep) // self.sweep_s
            self._next_sweep += (missed + 1) * self.sweep_s

    def _sweep_locked(self, now: float) -> None:
        """The real Horde's sweep (horde/database/threads.py ``check_waiting_prompts``),
        in its order: each open job whose lease passed is aborted (``is_stale``:
        ``abort()``, which counts an aborted job of its worker,
        horde/classes/base/processing_generation.py, then ``wp.n += 1``: its request
        goes back to the queue); then each request with more than 2 faulted jobs
        (faulted or expired, these included) is marked faulted. A request sent with
        ``max_attempts`` faults at once instead (:meth:`_restart`)."""
        for job in self._jobs.values():
            if job.action is None and now > job.lease_until:
                job.action = "expired"
                self._record(job, "expired", None, None, None, None)
                log.info("job %s expired (lease passed)", job.id)
                self._log_aborted_job(job.worker, now)
                req = self._requests[job.request_id]
                if req.state == "processing" and req.job_ids[-1] == job.id:
                    self._restart(req)
                self._changed.notify_all()
        for req in self._requests.values():
            if req.max_attempts is not None or req.state not in ("waiting", "processing"):
                continue
            faulted = sum(
                1 for jid in req.job_ids if self._jobs[jid].action in ("faulted", "expired")
            )
            if faulted > SWEEP_FAULTED_JOBS:
                req.state = "faulted"
                log.info("request %s faulted by the sweep: %d faulted jobs", req.id, faulted)
                self._changed.notify_all()

    def _log_aborted_job(self, name: str, now: float) -> None:
        """Count an aborted job of worker ``name``; more than 20 in the window put it
        into maintenance and start the count again (the real Horde's
        horde/classes/base/worker.py ``log_aborted_job``: the count starts again when
        an aborted job comes more than an hour after the window began, which is
        when the worker was created or the count last started again)."""
        worker = self._workers.get(name)
        if worker is None:
            return
        if now - worker.aborted_since > self.aborted_jobs_window_s:
            worker.aborted_jobs = 0
            worker.aborted_since = now
        worker.aborted_jobs += 1
        worker.uncompleted_jobs += 1
        if worker.aborted_jobs > MAX_ABORTED_JOBS:
            worker.maintenance = True
            worker.maintenance_msg = MAINTENANCE_MESSAGE
            worker.aborted_jobs = 0
            log.warning(
                "worker %s put into maintenance: more than %d aborted jobs within %g s",
                name, MAX_ABORTED_JOBS, self.aborted_jobs_window_s,
            )

    def _restart(self, req: _Req) -> None:
        """A job of ``req`` faulted or expired: the request goes back to the queue in
        its old place (the head, as on the real Horde: ``wp.n += 1``), for any
        worker, the one that faulted it too. Only with ``max_attempts`` (a test
        hook the real Horde lacks) does it fault at once, at its n-th such job;
        otherwise the sweep faults it (:meth:`_sweep_locked`)."""
        req.restarted += 1
        if req.max_attempts is not None and req.restarted >= req.max_attempts:
            req.state = "faulted"
        else:
            req.state = "waiting"

    def _record(
        self,
        job: _Job,
        action: str,
        status: int | None,
        rc: str | None,
        fault_reason: str | None,
        body: dict[str, Any] | None,
    ) -> None:
        self._ledger.append(
            {
                "job_id": job.id,
                "request_id": job.request_id,
                "kind": job.kind,
                "worker": job.worker,
                "action": action,
                "status": status,
                "rc": rc,
                "fault_reason": fault_reason,
                "body": copy.deepcopy(body),
            }
        )
