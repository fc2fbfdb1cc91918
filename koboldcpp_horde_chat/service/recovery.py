"""Crash recovery: the start-up pass over the jobs an earlier process left in hand.

Before the first pop, :func:`recover` faults every job the journal
(``service.journal``) holds whose lease has not ended, so the request gets it
back for another worker at once (seed "7. Fault a job"), and aborts its local
generation on koboldcpp by genkey (seed "Worked example: koboldcpp's embedded
worker").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from ..errors import BackendError, HordeRefusal, HordeUnavailable
from ..horde.codes import SETTLED_RCS, is_key_refusal
from ..horde.submits import fault_submit, text_fault_submit
from .journal import Journal, JournalEntry

log = logging.getLogger("koboldcpp_horde_chat.journal")

#: Submit attempts for one recovered job while the Horde does not answer.
RECOVERY_ATTEMPTS: Final = 3
#: Longest pause between two of those attempts, seconds.
RECOVERY_PAUSE_MAX_S: Final = 5.0



class HordeSubmitter(Protocol):
    """What :func:`recover` needs of ``horde.HordeClient``."""

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST the submit; raises ``HordeRefusal`` or ``HordeUnavailable``."""
        ...


class BackendAborter(Protocol):
    """What :func:`recover` needs of ``backend.KoboldClient``."""

    def abort(self, genkey: str, *, timeout_s: float) -> bool:
        """POST ``/api/extra/abort``; raises ``BackendError``."""
        ...


@dataclass(frozen=True)
class RecoveryResult:
    """What :func:`recover` did with the jobs an earlier process left.

    Attributes:
        faulted: faults the Horde accepted (the requests went back to the queue).
        settled: jobs the Horde had already ended (``AbortedGen``,
            ``DuplicateGen`` or 404).
        expired: jobs whose lease had ended: nothing sent.
        failed: jobs left to expire: the Horde did not answer within the lease
            and attempts, or refused the fault for another reason.
        kept: jobs left in the journal for the next start because the Horde
            refused the API key (the one refused and every one after it).
        key_refused: the Horde refused the API key (401, or 403 for the
            credentials); the recovery stopped there.
    """

    faulted: int = 0
    settled: int = 0
    expired: int = 0
    failed: int = 0
    kept: int = 0
    key_refused: bool = False

    @property
    def total(self) -> int:
        """Every job the journal held."""
        return self.faulted + self.settled + self.expired + self.failed + self.kept


def _fault_body(entry: JournalEntry, model_id_default: str) -> dict[str, Any]:
    if entry.kind == "chat":
        return fault_submit(entry.job_id, entry.model_id or model_id_default)
    return text_fault_submit(entry.job_id)


def recover(
    journal: Journal,
    *,
    horde: HordeSubmitter,
    backend: BackendAborter,
    wall: Callable[[], float],
    model_id_default: str,
    submit_timeout_s: float = 10.0,
    abort_timeout_s: float = 2.0,
    pause: Callable[[float], None] = time.sleep,
) -> RecoveryResult:
    """Fault the jobs an earlier process left in hand; call at start, before the first pop.

    For each entry of ``journal.load()``, in order:

    - its ``lease_end`` has passed (``wall()``): nothing is sent; logged as
      expired on the Horde;
    - else its genkey (when there is one) is aborted on koboldcpp
      (``backend.abort(genkey, timeout_s=abort_timeout_s)``, best effort,
      failures logged at debug) and the job is faulted (seed "7. Fault a
      job"): a chat job with ``{"id", "state": "faulted", "model_id"}`` (the
      entry's ``model_id``, else ``model_id_default``), a text job with
      ``{"id", "generation": "", "state": "faulted"}``. ``AbortedGen``,
      ``DuplicateGen`` or 404: already settled. ``HordeUnavailable``: tried
      again up to 3 attempts in all, after a pause of 1 s then 2 s (or the
      ``Retry-After``, at most 5 s), while the lease lasts; then left to
      expire. A refused API key (401, or 403 for the credentials) stops the
      recovery: that job and the ones after it stay in the journal.

    Every job ends in one log line with ``job=<id>``; every job processed is
    removed from the journal. Nothing raised for the Horde's or koboldcpp's
    answers.

    Args:
        journal: the worker's journal.
        horde: the Horde client (``submit(body, *, timeout_s) -> dict``,
            raising ``HordeRefusal`` / ``HordeUnavailable``).
        backend: the koboldcpp client (``abort(genkey, *, timeout_s) -> bool``,
            raising ``BackendError``); never given the API key.
        wall: epoch seconds.
        model_id_default: the worker's ``model_id`` for a chat entry without one.
        submit_timeout_s, abort_timeout_s: read timeouts, seconds.
        pause: waits between attempts, seconds.

    Returns:
        The counts (:class:`RecoveryResult`).
    """
    entries = journal.load()
    faulted = settled = expired = failed = kept = 0
    key_refused = False
    for entry in entries:
        if key_refused:
            kept += 1
            log.warning("job=%s kind=%s kept in the journal: the Horde refused the API key",
                        entry.job_id, entry.kind)
            continue
        now = wall()
        if now >= entry.lease_end:
            expired += 1
            log.warning(
                "job=%s kind=%s expired on the Horde while the worker was down "
                "(lease ended %.0f s ago): nothing sent",
                entry.job_id, entry.kind, now - entry.lease_end,
            )
            journal.record_fault(now)  # an aborted job on the Horde
            journal.remove(entry.job_id)
            continue
        if entry.genkey:
            try:
                backend.abort(entry.genkey, timeout_s=abort_timeout_s)
            except BackendError as exc:
                log.debug("job=%s abort of %s failed: %s", entry.job_id, entry.genkey, exc)
        outcome = _fault_after_restart(
            entry, horde, wall, pause, _fault_body(entry, model_id_default), submit_timeout_s
        )
        if outcome == "key_refused":
            key_refused = True
            kept += 1
            continue
        if outcome == "faulted":
            faulted += 1
        elif outcome == "settled":
            settled += 1
        else:
            failed += 1
        if outcome != "settled":  # faulted, or left to expire: aborted on the Horde
            journal.record_fault(wall())
        journal.remove(entry.job_id)
    result = RecoveryResult(faulted, settled, expired, failed, kept, key_refused)
    if result.total:
        log.info(
            "jobs in hand at the last stop: %d faulted, %d already settled, %d expired, "
            "%d left to expire, %d kept in the journal",
            faulted, settled, expired, failed, kept,
        )
    return result


def _fault_after_restart(
    entry: JournalEntry,
    horde: HordeSubmitter,
    wall: Callable[[], float],
    pause: Callable[[float], None],
    body: dict[str, Any],
    timeout_s: float,
) -> str:
    """Send one recovered job's fault: ``"faulted"``, ``"settled"``,
    ``"key_refused"`` or ``"failed"``; logs the job's line."""
    attempts = 0
    while True:
        attempts += 1
        try:
            horde.submit(body, timeout_s=timeout_s)
        except HordeRefusal as exc:
            if exc.rc in SETTLED_RCS or exc.status == 404:
                log.info("job=%s kind=%s already settled on the Horde (%s): nothing more to send",
                         entry.job_id, entry.kind, exc.rc or exc.status)
                return "settled"
            if is_key_refusal(exc):
                log.error(
                    "job=%s kind=%s not faulted after a restart: the Horde refused the "
                    "API key (%s); kept in the journal",
                    entry.job_id, entry.kind, exc,
                )
                return "key_refused"
            log.error("job=%s kind=%s left to expire: the Horde refused the fault (%s)",
                      entry.job_id, entry.kind, exc)
            return "failed"
        except HordeUnavailable as exc:
            delay = min(max(float(attempts), exc.retry_after_s or 0.0), RECOVERY_PAUSE_MAX_S)
            if attempts >= RECOVERY_ATTEMPTS or wall() + delay >= entry.lease_end:
                log.error("job=%s kind=%s left to expire: the Horde did not answer the fault (%s)",
                          entry.job_id, entry.kind, exc)
                return "failed"
            log.debug("job=%s fault not answered (%s); trying again in %.1f s",
                      entry.job_id, exc, delay)
            pause(delay)
            continue
        log.warning("job=%s kind=%s faulted after a restart: the worker stopped with it in hand",
                    entry.job_id, entry.kind)
        return "faulted"
