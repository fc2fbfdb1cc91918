"""The one reading of the Horde's answer to a reply's or a fault's submit
(``state/submit_answers.py``), and the proof that the live submit
(``run/submit.py``) and the start-up recovery (``service/recovery.py``) both
use it: the same answers leave the same journal in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.harness.fakes import FakeClock
from koboldcpp_horde_chat.errors import HordeRefusal, HordeUnavailable, JobFault
from koboldcpp_horde_chat.run import submit as submit_mod
from koboldcpp_horde_chat.service import recovery as recovery_mod
from koboldcpp_horde_chat.state import journal as journal_mod
from koboldcpp_horde_chat.state.journal import Journal
from koboldcpp_horde_chat.state.submit_answers import (
    Answer,
    Reading,
    read_answer,
    refused_reply_fault,
)
from koboldcpp_horde_chat.translate.submits import FAULT_REPLY_REFUSED
from tests.unit.test_journal import (
    NOW,
    ScriptedHorde,
    _fixed_clock_mark,  # noqa: F401  (autouse: the journal's clocks read NOW)
    chat_entry,
    job_lines,
    journal_with,
    run_recover,
)
from tests.unit.test_pure_core import PACKAGE, violations
from tests.unit.test_submit_lines import JOB, job_in_hand, pipeline, reply_body


def refusal(status: int = 400, rc: str = "") -> HordeRefusal:
    return HordeRefusal(f"submit: HTTP {status}", status=status, rc=rc)


def lost(status: int = 0, sent: bool | None = None, retry_after_s: float | None = None) -> Any:
    return HordeUnavailable("submit: no answer", status=status, sent=sent,
                            retry_after_s=retry_after_s)


# --- the reading, on plain values ----------------------------------------------------------


def test_the_reading_does_no_io() -> None:
    """It imports, besides the pure core, only two modules as pure as the core."""
    pure_too = {"from horde.codes import ...", "from state.journal_rules import ..."}
    for name in ("state/submit_answers", "state/journal_rules", "horde/codes"):
        source = (PACKAGE / f"{name}.py").read_text(encoding="utf-8")
        assert set(violations(source, name.replace("/", "."))) <= pure_too


def test_an_accepted_reply_is_read_with_its_reward_and_a_fault_without() -> None:
    assert read_answer({"reward": 12.5}, fault=False) == Reading(Answer.ACCEPTED, kudos=12.5)
    assert read_answer({"reward": "many"}, fault=False) == Reading(Answer.ACCEPTED)
    assert read_answer({}, fault=False) == Reading(Answer.ACCEPTED)
    assert read_answer({"reward": 3}, fault=True) == Reading(Answer.ACCEPTED)


@pytest.mark.parametrize("fault", [False, True])
def test_duplicate_gen_means_the_horde_had_it(fault: bool) -> None:
    exc = refusal(400, "DuplicateGen")
    assert read_answer(exc, fault=fault) == Reading(Answer.DUPLICATE, exc)


def test_aborted_gen_ends_the_job_and_counts_an_aborted_job_for_a_reply_only() -> None:
    exc = refusal(400, "AbortedGen")
    assert read_answer(exc, fault=False) == Reading(Answer.ENDED, exc, aborted=True)
    assert read_answer(exc, fault=True) == Reading(Answer.ENDED, exc)


@pytest.mark.parametrize("fault", [False, True])
def test_a_job_not_found_ended_on_the_horde(fault: bool) -> None:
    exc = refusal(404)
    assert read_answer(exc, fault=fault) == Reading(Answer.ENDED, exc)


@pytest.mark.parametrize(("status", "rc", "answer"), [
    (401, "", Answer.KEY_REFUSED),
    (403, "InvalidAPIKey", Answer.KEY_REFUSED),
    (403, "WrongCredentials", Answer.KEY_REFUSED),
    (403, "SomethingElse", Answer.REFUSED),
    (400, "ChatSubmitInvalid", Answer.REFUSED),
    (413, "", Answer.REFUSED),
])
def test_a_refusal_is_the_keys_or_definitive(status: int, rc: str, answer: Answer) -> None:
    for fault in (False, True):
        reading = read_answer(refusal(status, rc), fault=fault)
        assert reading.answer is answer and not reading.not_taken and not reading.aborted


def test_a_refused_reply_is_faulted_reply_refused_for_the_chat_refusals_only() -> None:
    reading = read_answer(refusal(400, "ChatSubmitInvalid"), fault=False)
    assert refused_reply_fault(reading.refusal).fault_reason == FAULT_REPLY_REFUSED
    nonconformant = refused_reply_fault(refusal(400, "ChatSubmitNonconformant"))
    assert nonconformant.fault_reason == FAULT_REPLY_REFUSED and not nonconformant.counts
    assert refused_reply_fault(refusal(400)).fault_reason is None
    with pytest.raises(TypeError):
        _ = read_answer({}, fault=False).refusal


@pytest.mark.parametrize(("status", "sent"), [(0, False), (0, None), (429, True), (502, True)])
def test_a_lost_reply_is_sent_again_whatever_the_failure(status: int, sent: bool | None) -> None:
    exc = lost(status, sent, retry_after_s=7.0)
    reading = read_answer(exc, fault=False)
    assert reading == Reading(Answer.RETRY, exc)
    assert reading.retry_after_s == 7.0 and reading.why == exc.reason


@pytest.mark.parametrize(("status", "sent", "answer"), [
    (0, False, Answer.RETRY),  # connection refused: never reached the Horde
    (429, True, Answer.RETRY),
    (503, True, Answer.RETRY),
    (0, None, Answer.LOST),  # no answer in time: it may have
    (502, True, Answer.LOST),
    (500, True, Answer.LOST),
])
def test_a_fault_is_sent_again_only_when_known_not_to_have_reached_the_horde(
    status: int, sent: bool | None, answer: Answer
) -> None:
    exc = lost(status, sent)
    assert read_answer(exc, fault=True) == Reading(
        answer, exc, not_taken=answer is Answer.RETRY
    )
    assert read_answer(exc, fault=True).retry_after_s == 0.0


# --- both paths use it ---------------------------------------------------------------------


def live(tmp_path: Path, action: str, answers: list[Any]) -> Path:
    """The live submit of a job in hand (``reply`` or ``fault``), answered ``answers``."""
    path = tmp_path / "live.json"
    clock = FakeClock(NOW)
    sender, state = pipeline(ScriptedHorde(*answers), clock, Journal(path))  # type: ignore[arg-type]
    ctx = job_in_hand(state, clock)
    if action == "reply":
        sender.reply(ctx, reply_body(), detail="stop, 2 tokens")
    else:
        sender.fault(ctx, JobFault("koboldcpp failed"))
    return path


def recovered(tmp_path: Path, action: str, answers: list[Any]) -> Path:
    """The recovery of the same job left in the journal with its reply (or none)."""
    extra = {"terminal": "reply_sent", "reply": reply_body()} if action == "reply" else {}
    path = journal_with(tmp_path, chat_entry(JOB, **extra))
    run_recover(path, ScriptedHorde(*answers))
    return path


def journal_after(path: Path) -> tuple[list[tuple[str, str]], int]:
    """(the jobs left and their terminal-action state, the faults kept for maintenance)."""
    journal = Journal(path)
    entries = [(e.job_id, e.terminal) for e in journal.load()]
    return entries, len(journal.recent_faults(NOW + 600))


@pytest.mark.parametrize(("action", "answers", "faults"), [
    ("reply", [{"reward": 7}], 0),
    ("reply", [refusal(400, "DuplicateGen")], 0),
    ("reply", [refusal(400, "AbortedGen")], 1),  # an aborted job on the Horde
    ("reply", [refusal(404)], 0),
    ("reply", [refusal(400, "ChatSubmitInvalid"), {}], 1),  # faulted instead
    ("reply", [lost(502, True), {"reward": 7}], 0),
    ("fault", [{}], 1),
    ("fault", [lost(503, True), {}], 1),  # sent again: it never reached the Horde
    ("fault", [lost(0, None)], 1),  # may have reached it: never sent again
    # The live submit counts its fault as it sends it, the recovery once the Horde
    # may have counted it: for these two only the jobs left are compared.
    ("fault", [refusal(400)], None),
    ("fault", [refusal(400, "AbortedGen")], None),
])  # fmt: skip
def test_the_live_submit_and_the_recovery_leave_the_same_journal_for_the_same_answers(
    tmp_path: Path, action: str, answers: list[Any], faults: int | None
) -> None:
    (tmp_path / "live").mkdir()
    (tmp_path / "restart").mkdir()
    live_jobs, live_faults = journal_after(live(tmp_path / "live", action, list(answers)))
    jobs, recovered_faults = journal_after(recovered(tmp_path / "restart", action, answers))
    assert live_jobs == jobs == []
    if faults is not None:
        assert live_faults == recovered_faults == faults


def test_both_paths_read_the_answer_with_the_one_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both send through ``journal.send_terminal``, which reads with ``read_answer``."""
    calls: list[tuple[str, bool]] = []

    def spy(where: str) -> Any:
        def sending(*args: Any, fault: bool, **kwargs: Any) -> Reading:
            calls.append((where, fault))
            return journal_mod.send_terminal(*args, fault=fault, **kwargs)
        return sending

    def reading(answer: Any, *, fault: bool) -> Reading:
        calls.append(("read", fault))
        return read_answer(answer, fault=fault)

    monkeypatch.setattr(submit_mod, "send_terminal", spy("live"))
    monkeypatch.setattr(recovery_mod, "send_terminal", spy("recovery"))
    monkeypatch.setattr(journal_mod, "read_answer", reading)
    (tmp_path / "live").mkdir()
    (tmp_path / "restart").mkdir()
    live(tmp_path / "live", "reply", [refusal(400, "ChatSubmitInvalid"), {}])
    recovered(tmp_path / "restart", "reply", [refusal(400, "ChatSubmitInvalid"), {}])
    assert calls == [
        ("live", False), ("read", False), ("live", True), ("read", True),
        ("recovery", False), ("read", False), ("recovery", True), ("read", True),
    ]


def test_the_recoverys_line_for_a_fault_sent_before_the_restart_keeps_its_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = journal_with(tmp_path, chat_entry(JOB, terminal="fault_sent"))
    run_recover(path, ScriptedHorde())
    assert job_lines(caplog, JOB) == [
        f"job={JOB} kind=chat: its fault was sent before the restart; nothing more sent "
        "(a second fault would re-open the request again)"
    ]


@pytest.mark.parametrize(
    ("status", "sent", "not_taken"),
    [(0, False, True), (429, True, True), (503, True, True),
     (0, None, False), (502, True, False), (504, True, False), (500, True, False)],
)  # fmt: skip
def test_only_a_refused_connection_429_or_503_is_known_not_to_have_reached_the_horde(
    status: int, sent: bool | None, not_taken: bool
) -> None:
    unanswered = HordeUnavailable("submit: no answer", status=status, sent=sent)
    assert read_answer(unanswered, fault=True).not_taken is not_taken
