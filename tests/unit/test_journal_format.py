"""The journal file's format read and written on its own (``state.journal_format``):
what ``Journal`` writes reads back as it was, and bytes that are not a journal
are said in the words its log line uses."""

from __future__ import annotations

import json

import pytest

from koboldcpp_horde_chat.state.journal_format import (
    MAX_FAULTS,
    MAX_FILE_BYTES,
    JournalEntry,
    NotAJournal,
    document_text,
    read_document,
)
from koboldcpp_horde_chat.state.journal_rules import ClockMark

REPLY = {"id": "j2", "message": {"role": "assistant", "content": "Blue."}, "state": "ok"}
ENTRIES = [
    JournalEntry("j1", "text", None, "HORDEREQ_a", 1_700_000_150.0),
    JournalEntry("j2", "chat", "koboldcpp/m", "", 1_700_000_151.5, "reply_sent", REPLY),
]
MARK = ClockMark(1_700_000_042.5, "boot", 5321.25)


def test_what_is_written_reads_back_as_it_was() -> None:
    text = document_text(ENTRIES, [1_700_000_100.0004], MARK)
    assert json.loads(text) == {
        "version": 2,
        "jobs": [
            {"job_id": "j1", "kind": "text", "model_id": None, "genkey": "HORDEREQ_a",
             "lease_end": 1_700_000_150.0},
            {"job_id": "j2", "kind": "chat", "model_id": "koboldcpp/m", "genkey": "",
             "lease_end": 1_700_000_151.5, "terminal": "reply_sent", "reply": REPLY},
        ],
        "faults": [1_700_000_100.0],
        "clock": {"wall": 1_700_000_042.5, "boot_id": "boot", "boottime": 5321.25},
    }  # fmt: skip
    assert " " not in text.replace("Blue.", "") and text.isascii()
    doc = read_document(text.encode())
    assert doc.entries == ENTRIES and doc.skipped == []
    assert doc.faults == [1_700_000_100.0] and doc.clock == MARK
    assert "faults" not in json.loads(document_text([], [], MARK))


def test_entries_of_the_wrong_shape_are_skipped_by_index_and_the_faults_kept_are_numbers() -> None:
    raw = json.dumps({
        "version": 2,
        "jobs": [ENTRIES[0].to_json(), {"job_id": "j3", "kind": "image"}, "x"],
        "faults": [True, "1", float("nan"), *range(MAX_FAULTS + 5)],
    }).encode()  # fmt: skip
    doc = read_document(raw)
    assert doc.entries == [ENTRIES[0]]
    assert doc.skipped == [(1, "genkey is missing"), (2, "not a JSON object")]
    assert doc.faults == [float(t) for t in range(5, MAX_FAULTS + 5)]
    assert doc.clock is None


def test_a_fault_time_too_large_for_a_float_is_not_kept_and_the_journal_still_reads() -> None:
    raw = json.dumps({"version": 2, "jobs": [], "faults": [1_700_000_100.0, 10**400]}).encode()
    assert read_document(raw).faults == [1_700_000_100.0]


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"{not json", "is not valid JSON"),
        (b"\xff\xfe", "is not valid JSON"),
        (b"[]", "is not a job journal"),
        (b'{"version": 1}', "is not a job journal"),
        (b'{"version": 0, "jobs": []}', "is not a version 2 job journal"),
        (b" " * (MAX_FILE_BYTES + 1), f"is over {MAX_FILE_BYTES} bytes"),
    ],
)
def test_bytes_that_are_not_a_journal_are_said_in_a_few_words(raw: bytes, why: str) -> None:
    with pytest.raises(NotAJournal) as caught:
        read_document(raw)
    assert str(caught.value) == why
