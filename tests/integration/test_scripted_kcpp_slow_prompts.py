"""The scripted koboldcpp as a host slow only for long prompts, or hanging on
them: processing time proportional to the prompt's tokens, reported in
``/api/extra/perf``; an abort heard only between two batches of 512 prompt
tokens (koboldcpp 1.116.1 ``gpttype_adapter.cpp`` L6093, L6754, L6909); a prompt
over ``hang_prompts_over`` tokens hanging until aborted."""

from __future__ import annotations

import threading
import time
from typing import Any

import requests

from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp

#: Seconds per prompt token: a 512-token batch takes 0.5 s.
PER_TOKEN_S = 0.5 / 512


def _generate(url: str, words: int, genkey: str, timeout: float = 30.0) -> dict[str, Any]:
    body = {
        "prompt": "abc " * words, "max_length": 8, "max_context_length": 4096,
        "genkey": genkey,
    }
    answer = requests.post(f"{url}/api/v1/generate", json=body, timeout=timeout)
    return dict(answer.json())


def test_a_long_prompt_is_processed_in_proportion_to_its_tokens_and_reported() -> None:
    with ScriptedKoboldcpp(prompt_token_delay_s=PER_TOKEN_S) as kcpp:
        start = time.monotonic()
        _generate(kcpp.url, 20, "HORDEREQ_short")
        short_s = time.monotonic() - start
        start = time.monotonic()
        _generate(kcpp.url, 1000, "HORDEREQ_long")
        long_s = time.monotonic() - start
        perf = requests.get(f"{kcpp.url}/api/extra/perf", timeout=5).json()
    assert short_s < 0.3 < 0.9 < long_s
    prompt = perf["last_input_count"]
    assert prompt > 1000
    assert abs(perf["last_process_time"] - prompt * PER_TOKEN_S) < 1e-6
    assert perf["total_gens"] == 2


def test_an_abort_during_prompt_processing_ends_it_at_the_next_batch() -> None:
    with ScriptedKoboldcpp(prompt_token_delay_s=PER_TOKEN_S) as kcpp:
        answers: list[dict[str, Any]] = []
        thread = threading.Thread(
            target=lambda: answers.append(_generate(kcpp.url, 4000, "HORDEREQ_job"))
        )
        start = time.monotonic()
        thread.start()
        time.sleep(0.2)  # within the first 512-token batch
        requests.post(f"{kcpp.url}/api/extra/abort", json={"genkey": "HORDEREQ_job"}, timeout=5)
        thread.join(10)
        took = time.monotonic() - start
    assert answers and answers[0]["results"][0]["text"] == ""
    # The batch under way (0.5 s) ends first; the other seven are not processed.
    assert 0.45 < took < 1.5


def test_a_prompt_over_the_hang_size_hangs_until_aborted_and_a_short_one_answers() -> None:
    with ScriptedKoboldcpp(hang_prompts_over=500) as kcpp:
        assert _generate(kcpp.url, 20, "HORDEREQ_probe")["results"][0]["text"]
        try:
            _generate(kcpp.url, 600, "HORDEREQ_job", timeout=1.0)
        except requests.Timeout:
            pass
        else:
            raise AssertionError("a long prompt answered")
        requests.post(f"{kcpp.url}/api/extra/abort", json={"genkey": "HORDEREQ_job"}, timeout=5)
        assert kcpp.aborts[-1] == "HORDEREQ_job"
