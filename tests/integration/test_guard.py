"""The guard against the Horde's maintenance, end to end: the standalone worker
against the dev Horde (which counts aborted jobs and enforces maintenance as the
real Horde does) and a scripted koboldcpp that is too slow for the lease or
fails its generations. In each the worker never reaches maintenance and keeps
earning what it can.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from bench.harness.worker_process import until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import Fault, ScriptedKoboldcpp, ScriptedReply

NAME = "test-worker"
#: 25 tokens/s: --hordegenlen 512 takes 20 s, past a 20 s lease less the submit's
#: 5 s margin; 128 take 5 s.
TOKEN_DELAY_S = 0.04
LONG = 512
SHORT = 128


def _long_replies(kcpp: ScriptedKoboldcpp) -> None:
    """Every generation runs to its budget, at 25 tokens/s."""
    kcpp.token_delay_s = TOKEN_DELAY_S
    kcpp.script(lambda body: ScriptedReply(text="sky " * 4000))


def _declared(horde: DevHorde) -> list[int]:
    return [int(p["body"]["max_length"]) for p in horde.pops]


def _counted(horde: DevHorde) -> tuple[int, bool]:
    details = horde.worker(NAME) or {}
    return int(details.get("uncompleted_jobs", 0)), bool(details.get("maintenance_mode"))


@pytest.mark.parametrize("horde", [{"ttl_s": 20.0, "sweep_s": 0}], indirect=True)
def test_a_koboldcpp_too_slow_for_the_lease_narrows_the_text_declaration_and_earns(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A text job of --hordegenlen tokens cannot finish in its lease: after the
    first one runs out, the worker declares a max_length its measured speed
    generates within the lease, so the long requests go to other workers and the
    short ones earn. Before the guard every long request was popped until it
    faulted, each an aborted job on the Horde."""
    caplog.set_level(logging.INFO)
    _long_replies(kcpp)
    long_ids = [horde.send_text("Once", max_length=LONG, max_context_length=2048) for _ in range(3)]
    short_ids = [
        horde.send_text("Once", max_length=SHORT, max_context_length=2048) for _ in range(3)
    ]
    start_worker()
    until(lambda: all(horde.status(r)["state"] == "done" for r in short_ids), 90,
          lambda: caplog.text[-3000:])
    aborted, maintenance = _counted(horde)
    assert not maintenance
    assert aborted <= 1, caplog.text[-3000:]
    assert "max_length for text jobs lowered from 512" in caplog.text
    assert min(_declared(horde)) < LONG
    assert all(horde.status(r)["state"] != "done" for r in long_ids)


def test_koboldcpps_own_speed_figure_fits_the_first_pop_to_the_lease(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
) -> None:
    """A koboldcpp that already generated says its speed (/api/extra/perf): the
    first pop declares what it generates within 120 s of the 150 s lease, so no
    job is lost to learn it."""
    kcpp._perf.update(total_gens=3, last_eval_speed=2.0)  # noqa: SLF001 - a used koboldcpp
    start_worker()
    until(lambda: len(horde.pops) >= 1, 30)
    assert _declared(horde)[0] == 240  # 2 tokens/s x 120 s, by 16
    assert horde.pops[0]["body"]["chat_limits"]["max_length"] == 240


@pytest.mark.parametrize("horde", [{"ttl_s": 20.0, "lease_cap_s": 24.0, "sweep_s": 0}], indirect=True)
@pytest.mark.parametrize("stream", [True, False])
def test_a_koboldcpp_too_slow_for_the_lease_narrows_the_chat_declaration_and_earns(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    """The same for chat jobs, streamed (progress posts extend the lease, up to
    its cap) or not."""
    caplog.set_level(logging.INFO)
    _long_replies(kcpp)

    def send(max_tokens: int) -> str:
        return horde.send_chat(
            {"messages": [{"role": "user", "content": "Sky?"}], "max_tokens": max_tokens,
             "stream": stream},
            best_effort=True,
        )

    long_ids = [send(LONG) for _ in range(3)]
    short_ids = [send(SHORT) for _ in range(3)]
    start_worker()
    until(lambda: all(horde.status(r)["state"] == "done" for r in short_ids), 120,
          lambda: caplog.text[-3000:])
    aborted, maintenance = _counted(horde)
    assert not maintenance
    assert aborted <= 1, caplog.text[-3000:]
    assert "max_length for chat jobs lowered from 512" in caplog.text
    # A streamed job's progress posts extend its lease (here up to 24 s): the
    # first long one may finish; none after the declaration was lowered.
    assert sum(horde.status(r)["state"] == "done" for r in long_ids) <= (1 if stream else 0)


def test_a_koboldcpp_failing_every_generation_stops_the_popping_not_the_jobs(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """koboldcpp answers its readiness probe yet fails every generation: after a
    few failures in a row the worker stops popping and probes koboldcpp with a
    generation the size of the failed job, ever less often, instead of faulting
    every job it pops into maintenance; once koboldcpp generates again it pops
    and earns."""
    caplog.set_level(logging.INFO)
    # The first probe 3 s after the withdrawal (60 s in service), then 6 s later...
    monkeypatch.setattr("koboldcpp_horde_chat.state.probes.FIRST_WAIT_S", 3.0)
    for _ in range(60):
        kcpp.inject("generate", (500, {"detail": {"msg": "boom"}}))
        kcpp.inject("chat", (500, {"detail": {"msg": "boom"}}))
    # Distinct requests: one payload faulted twice is another matter (test_refaults.py).
    ids = [horde.send_text(f"Once {i}", max_length=32, max_attempts=1) for i in range(25)]
    ids += [
        horde.send_chat(
            {"messages": [{"role": "user", "content": f"Sky {i}?"}]},
            best_effort=True,
            max_attempts=1,
        )
        for i in range(5)
    ]
    start_worker()
    until(lambda: "failed 3 generations in a row: not popping" in caplog.text, 60,
          lambda: caplog.text[-3000:])
    pops = len(horde.pops)
    assert _counted(horde) == (3, False)
    time.sleep(12.0)  # two probes (3 s, then 6 s later) fail meanwhile: still no pop
    assert len(horde.pops) == pops
    kcpp._faults.clear()  # noqa: SLF001 - koboldcpp is fixed
    until(lambda: "koboldcpp generates again: popping" in caplog.text, 30,
          lambda: caplog.text[-3000:])
    until(lambda: sum(horde.status(r)["state"] == "done" for r in ids) >= 5, 60)
    assert _counted(horde) == (3, False)


def test_a_mix_of_failing_chat_and_text_jobs_withdraws_chat_then_stops_before_maintenance(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp fails every chat completion and the text generations of some
    prompts, and some conversations do not fit their context (a prompt_overflow
    fault, counted by the Horde as any other): the jobs come interleaved with text
    jobs that succeed, so no streak of failures stops the popping. The worker
    withdraws chat at 15 aborted jobs, keeps earning from text jobs, and stops
    popping at 19, before the Horde's 21st; the chat context it declares is never
    narrowed (a narrower one would not keep a conversation from overflowing)."""
    caplog.set_level(logging.INFO)

    def fail(route: str, body: Any) -> Fault | None:
        if route == "chat":
            return 500, {"detail": {"msg": "chat template error"}}
        if route == "generate" and isinstance(body, dict) and "FAIL" in str(body.get("prompt")):
            return 500, {"detail": {"msg": "boom"}}
        return None

    kcpp.fail_when(fail)

    def chat() -> str:
        return horde.send_chat(
            {"messages": [{"role": "user", "content": "Sky?"}], "max_tokens": 32},
            best_effort=True,
            max_attempts=1,
        )

    def overflowing_chat() -> str:
        return horde.send_chat(
            {
                "messages": [{"role": "user", "content": "words " * 400}],
                "max_tokens": 32,
                "max_context_length": 256,
            },
            best_effort=True,
            max_attempts=1,
        )

    good: list[str] = []
    for i in range(24):  # 36 failing jobs in all: 12 chat, then text alone
        if i < 12:
            chat() if i % 4 else overflowing_chat()
        good.append(horde.send_text(f"Once {i}", max_length=32, max_attempts=1))
        horde.send_text(f"FAIL {i}", max_length=32, max_attempts=1)
    start_worker()
    until(
        lambda: "not popping, to stay out of maintenance" in caplog.text or _counted(horde)[1],
        120,
        lambda: caplog.text[-3000:],
    )
    pops = len(horde.pops)
    time.sleep(3.0)
    assert len(horde.pops) == pops  # stopped
    aborted, maintenance = _counted(horde)
    assert not maintenance
    assert aborted <= 19, caplog.text[-3000:]
    text = caplog.text
    assert (
        "in the Horde's hour (maintenance above 20), chat jobs among them: withdrawing "
        "the chat declaration (text jobs continue)" in text
    )
    bodies = [p["body"] for p in horde.pops]
    withdrawn_at = next(i for i, b in enumerate(bodies) if "chat_jobs" not in b)
    assert all("chat_jobs" not in b for b in bodies[withdrawn_at:])  # not back within the hour
    assert {b["chat_limits"]["max_context_length"] for b in bodies if "chat_limits" in b} == {4096}
    # It went on earning from text jobs after chat was withdrawn.
    done = [r for r in good if horde.status(r)["state"] == "done"]
    popped_after = {
        j for p in horde.pops[withdrawn_at:] for j in (p["response"] or {}).get("ids", [])
    }
    assert done and any(
        set(horde.status(r)["job_ids"]) & popped_after for r in done
    ), caplog.text[-3000:]


def test_a_koboldcpp_failing_only_chat_withdraws_chat_after_three_and_text_keeps_earning(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """koboldcpp fails every chat completion while its text generations succeed,
    the jobs interleaved: the third chat failure in a row withdraws chat (its
    probe, a one-message chat completion, fails too), so at most 3 chat jobs are
    faulted, and text jobs go on earning. Before, each text job ended the streak
    and chat jobs were faulted until the Horde's count withdrew chat at 15."""
    caplog.set_level(logging.INFO)
    # The chat probe's first wait: 3 s here (60 s in service).
    monkeypatch.setattr("koboldcpp_horde_chat.state.probes.FIRST_WAIT_S", 3.0)

    def fail(route: str, body: Any) -> Fault | None:
        if route == "chat":
            return 500, {"detail": {"msg": "chat template error"}}
        return None

    kcpp.fail_when(fail)
    chats, texts = [], []
    for i in range(12):
        chats.append(horde.send_chat(
            {"messages": [{"role": "user", "content": f"Sky {i}?"}], "max_tokens": 32},
            best_effort=True, max_attempts=1,
        ))
        texts.append(horde.send_text(f"Once {i}", max_length=32, max_attempts=1))
    start_worker()
    until(lambda: all(horde.status(r)["state"] == "done" for r in texts), 90,
          lambda: caplog.text[-3000:])
    aborted, maintenance = _counted(horde)
    assert not maintenance
    assert aborted <= 3, caplog.text[-3000:]
    assert (
        "chat generations failed 3 times in a row: popping without the chat declaration "
        "(text jobs continue)" in caplog.text
    )
    # koboldcpp generates chat again: the chat probe gives chat back.
    kcpp.fail_when(None)
    until(lambda: "koboldcpp generates chat completions again: declaring chat again"
          in caplog.text, 30, lambda: caplog.text[-3000:])
    until(lambda: sum(horde.status(r)["state"] == "done" for r in chats) >= 1, 60,
          lambda: caplog.text[-3000:])


@pytest.mark.parametrize("horde", [{"ttl_s": 20.0, "sweep_s": 0}], indirect=True)
def test_a_lowered_max_length_comes_back_once_koboldcpp_is_fast_again_with_no_short_job(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A text job runs out of its lease and the text max_length is cut; koboldcpp
    is then fast again, and only requests longer than the cut wait (the Horde
    skips them). The worker re-measures koboldcpp with a short generation of its
    own once the cool-off has passed (2 s here instead of 60), declares
    --hordegenlen again and serves them. Before, it declared the cut until a
    short job happened to come."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("koboldcpp_horde_chat.state.lease_fit.RECHECK_AFTER_S", 2.0)
    _long_replies(kcpp)
    first = horde.send_text("Once", max_length=LONG, max_context_length=2048, max_attempts=1)
    start_worker()
    until(lambda: "max_length for text jobs lowered from 512" in caplog.text, 60,
          lambda: caplog.text[-3000:])
    kcpp.token_delay_s = 0.0  # koboldcpp is fast again
    waiting = [
        horde.send_text("Once", max_length=400, max_context_length=2048) for _ in range(2)
    ]
    until(lambda: all(horde.status(r)["state"] == "done" for r in waiting), 60,
          lambda: caplog.text[-3000:])
    assert "max_length for text jobs raised from" in caplog.text
    assert "to 512: koboldcpp generates" in caplog.text
    assert "(measured with a generation of the worker's own)" in caplog.text
    assert horde.status(first)["state"] != "done"
    aborted, maintenance = _counted(horde)
    assert aborted <= 1 and not maintenance


def test_pops_whose_answers_were_lost_are_counted_so_mixed_failures_never_reach_maintenance(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two pops whose answers are lost (the Horde assigns each a job, then the
    connection closes unanswered) and a mix of failing jobs: the jobs the worker
    never saw expire on the Horde as aborted jobs. The worker counts each lost
    pop as one, so its own aborts stop short and the Horde's count stays within
    its 20 an hour even after those jobs expire."""
    caplog.set_level(logging.INFO)

    def fail(route: str, body: Any) -> Fault | None:
        if route == "generate" and isinstance(body, dict) and "FAIL" in str(body.get("prompt")):
            return 500, {"detail": {"msg": "boom"}}
        return None

    kcpp.fail_when(fail)
    for i in range(30):
        horde.send_text(f"Once {i}", max_length=32, max_attempts=1)
        horde.send_text(f"FAIL {i}", max_length=32, max_attempts=1)
    horde.inject("pop", "ok", "drop", "ok", "ok", "drop")
    start_worker()
    until(
        lambda: "not popping, to stay out of maintenance" in caplog.text or _counted(horde)[1],
        120,
        lambda: caplog.text[-3000:],
    )
    time.sleep(2.0)  # the last submits answered
    horde.expire_leases()  # the jobs of the lost answers expire on the Horde
    aborted, maintenance = _counted(horde)
    print(f"aborted jobs on the Horde after the lost pops' jobs expired: {aborted}")
    assert not maintenance, caplog.text[-3000:]
    assert aborted <= 20, caplog.text[-3000:]
