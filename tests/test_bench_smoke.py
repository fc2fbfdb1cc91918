"""The benchmarks must not rot: a quick run of the cheap ones exits 0 and prints figures.

The kudos and slow-host benchmarks need a real koboldcpp: here they are run
without one (each must say it was skipped and exit 0), and its arithmetic is checked on a made-up
record of the dev Horde.

Runs ``python bench/run.py --quick --only overhead,throughput,sse,stop,journal
--no-save`` (about 25 s: the dev Horde and a scripted koboldcpp in a server
process, the worker in another; the stop's four phases against a worker
process; a few hundred journal writes) and checks that every selected
benchmark printed its figures, its reproduce command and the summary. No
figure is held to its target here: the machine's load decides those, and
``bench/run.py`` reports them.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ("overhead", "throughput", "sse", "stop", "journal")


def bench(
    *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` (a bench script and its flags) from the repository's root,
    its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def test_quick_run_of_the_cheap_benchmarks_prints_their_figures() -> None:
    result = bench(
        "bench/run.py", "--quick", "--only", ",".join(CHEAP), "--no-save", timeout_s=120
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    for name in CHEAP:
        assert f"-- {name} (bench/" in out, out[-3000:]
    # the figures the targets apply to, with numbers
    figure = r"min\s+[\d.]+\s+median\s+[\d.]+\s+max\s+[\d.]+"
    for label in (
        "overhead per chat job, median (worker code)",
        "overhead per chat job, p99 (worker code)",
        "throughput, text jobs",
        "throughput, chat jobs (20 msgs, 2 tools)",
        "idle gap: submit answered -> next pop",
        "SIGTERM -> exit, pop beside the submit in flight",
        "SIGTERM -> exit, token count",
        "SIGTERM -> exit, streamed generation",
        "SIGTERM -> exit, idle (between pops)",
        "journal per job, today (add, kept reply, removal), tmp",
        "journal per job, former (fsync add, remove), tmp",
    ):
        assert re.search(re.escape(label) + r".*?" + figure, out), label
    assert re.search(r"MB/s\s+min\s+[\d.]+\s+median", out), "SSE figures missing"
    assert "reproduce: python bench/bench_overhead.py" in out
    assert "reproduce: python bench/bench_throughput.py" in out
    assert "reproduce: python bench/bench_stop.py --quick --grace 1" in out
    assert "reproduce: python bench/bench_journal.py --quick" in out
    # the stop's table: each phase with the grace, the bound and the job's end
    assert re.search(r"token count\s+1s\s+[\d.]+s\s+[\d.]+s\s+3s\s+\w", out), out[-3000:]
    assert "== summary" in out
    assert "figure(s) off target" in out


def test_kudos_bench_without_koboldcpp_says_it_was_skipped_and_exits_0() -> None:
    env = dict(os.environ, KCPP_DIR="/nonexistent/koboldcpp")
    env.pop("BENCH_PKG_ROOT", None)
    result = bench("bench/bench_kudos.py", "--quick", timeout_s=60, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped: no koboldcpp.py in /nonexistent/koboldcpp (set KCPP_DIR)" in result.stdout
    assert "reproduce: KCPP_DIR=/nonexistent/koboldcpp python bench/bench_kudos.py --quick" in (
        result.stdout
    )


def test_slow_host_bench_without_koboldcpp_says_it_was_skipped_and_exits_0() -> None:
    env = dict(os.environ, KCPP_DIR="/nonexistent/koboldcpp")
    env.pop("BENCH_PKG_ROOT", None)
    result = bench("bench/bench_slow_host.py", "--minutes", "0.1", timeout_s=60, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped: no koboldcpp.py in /nonexistent/koboldcpp (set KCPP_DIR)" in result.stdout
    assert (
        "reproduce: KCPP_DIR=/nonexistent/koboldcpp python bench/bench_slow_host.py --minutes 0.1"
        in result.stdout
    )


def _bench_module(name: str = "bench_kudos") -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_kudos_bench_reads_gap_pop_to_submit_and_wall_from_the_horde_record() -> None:
    bk = _bench_module()
    call = bk.Call
    # one slot, 150 ms: job a popped (answer ready at 0.15), submitted at 1.15 (answer 1.30);
    # the pop for b overlaps that submit (arrives 1.16); b submitted 2.31 (answer 2.46);
    # the pop for c arrives 2.56 (after b's answer); c submitted 3.71 (answer 3.86)
    calls = [
        call("pop", 0.00, 0.15, 200, "a"),
        call("submit", 1.15, 1.30, 200, "a", reward=5.0),
        call("pop", 1.16, 1.31, 200, "b"),
        call("submit", 2.31, 2.46, 200, "b", reward=5.0),
        call("pop", 2.56, 2.71, 200, "c"),
        call("submit", 3.71, 3.86, 200, "c", reward=5.0),
        call("pop", 3.90, 4.05, 200, None),  # empty: not a job pop
    ]
    fig = bk.analyse_batch(calls, {"a", "b", "c"}, slots=1)
    assert fig["ok"] == 3
    assert fig["kudos"] == 15.0
    assert abs(fig["wall_s"] - 3.86) < 1e-9
    assert [round(g) for g in fig["gaps_ms"]] == [-140, 100]
    assert [round(x, 2) for x in fig["pop_to_submit_s"]] == [1.0, 1.0, 1.0]
    assert fig["bad"] == {}
    # two slots: the threads' calls cannot be told apart, so no gap
    assert bk.analyse_batch(calls, {"a", "b", "c"}, slots=2)["gaps_ms"] == []


def test_kudos_bench_reads_generation_times_from_koboldcpp_log_lines() -> None:
    bk = _bench_module()
    text = (
        "[13:16:24] CtxLimit:73/1024, Init:0.00s, Processed:1 in 0.02s (47.62T/s), "
        "Generated:48/48 in 0.81s (59.63T/s), Total:0.83s[13:16:24] horde-worker-1 INFO: "
        "job=x kind=text submitted: 204 chars, 0.9 s, 5 kudos\n"
        "[13:17:41] BatchRequest:11, Prompt:25, Generated:48/48 in 1.87s (25.73T/s), Stop:0\n"
    )
    assert bk.logged_generation_times(text) == [0.83, 1.87]


def test_kudos_bench_targets_and_ratios_are_paired_by_round() -> None:
    bk = _bench_module()

    def batch(worker: str, slots: int, latency: int, rnd: int, wall: float) -> Any:
        return bk.Batch(
            worker=worker,
            slots=slots,
            latency_ms=latency,
            round=rnd,
            jobs=10,
            ok=10,
            wall_s=wall,
            kudos=50.0,
            gen_times_s=[0.8] * 10,
            gaps_ms=[1.0 if worker == "ours" else 100.0],
        )

    batches = []
    for rnd, drift in ((1, 1.0), (2, 1.5)):  # the machine is 1.5x slower in round 2
        for latency, own_wall, ours_wall in ((0, 10.0, 9.5), (150, 12.5, 10.0)):
            batches.append(batch("own", 1, latency, rnd, own_wall * drift))
            batches.append(batch("ours", 1, latency, rnd, ours_wall * drift))
            batches.append(batch("own", 2, latency, rnd, own_wall * drift * 1.1))
            batches.append(batch("ours", 2, latency, rnd, ours_wall * drift * 0.9))
    lines, figures = bk.summarise(batches, [0, 150], [1, 2], [0.9, 0.95])
    by_name = {f["name"]: f for f in figures}
    kudos = by_name["kudos/hour ours/own, 1 slot, 150 ms"]
    assert kudos["values"] == [1.25, 1.25] and kudos["met"] is True
    per_job = by_name["per-job time ours/own, 1 slot, 0 ms"]
    assert per_job["values"] == [0.95, 0.95] and per_job["met"] is True
    assert by_name["gap submit answer -> next pop, ours, 1 slot, 0 ms"]["met"] is True
    # idle per job: own 200 ms and ours 150 ms in round 1, 700 and 625 ms in round 2;
    # at the same generation time (0.8 s) ours earns 1.0 / 0.95 and 1.5 / 1.425 as much
    same = by_name["kudos/hour ours/own at the same generation time, 1 slot, 0 ms"]
    assert [round(v, 4) for v in same["values"]] == [1.0526, 1.0526]
    assert "target" not in same  # judged at 150 ms
    same_150 = by_name["kudos/hour ours/own at the same generation time, 1 slot, 150 ms"]
    # idle 450 vs 200 ms in round 1: (0.8 + 0.45) / (0.8 + 0.2) = 1.25
    assert round(same_150["median"], 4) == 1.25 and same_150["met"] is True
    same_per_job = by_name["per-job time ours/own at the same generation time, 1 slot, 0 ms"]
    assert round(same_per_job["median"], 4) == 0.95 and same_per_job["met"] is True
    factor = by_name["2-slot factor (jobs/hour 2 slots / 1), ours, 0 ms"]
    assert abs(factor["median"] - 1 / 0.9) < 1e-3 and factor["met"] is True
    assert "target" not in by_name["2-slot factor (jobs/hour 2 slots / 1), own, 0 ms"]
    assert any("ours/own" in line and "1.250x" in line for line in lines)
    assert any("koboldcpp alone" in line and "0.925x" in line for line in lines)


def test_overhead_pairs_each_job_with_its_own_calls_when_the_next_pop_overlaps_a_submit() -> None:
    bt = _bench_module("harness.timing")
    # job a: pop answered 0.010, tokencount 0.011-0.015, chat 0.016-0.100, submit 0.101-0.110;
    # the pop for b goes out beside a's submit (0.1005) and is answered first (0.105);
    # b's calls start after a's submit returned (0.110): 0.111 tokencount, chat 0.116-0.200
    h_events = [
        ("pop", 0.000, 0.010, "a"),
        ("pop", 0.1005, 0.105, "b"),
        ("submit", 0.101, 0.110, "a"),
        ("submit", 0.2015, 0.210, "b"),
    ]
    k_events = [
        ("tokencount", 0.011, 0.015, None),
        ("chat", 0.016, 0.100, None),
        ("tokencount", 0.111, 0.115, None),
        ("chat", 0.116, 0.200, None),
    ]
    rows = bt.client_overheads(h_events, k_events)
    # a: pre 1 + 1 ms, post 1 ms; b: pre from a's submit returning (0.110) 1 + 1 ms, post 1.5 ms
    assert [round(r["total_ms"], 3) for r in rows] == [3.0, 3.5]


def test_the_route_tracer_follows_one_chat_job_over_http_and_over_the_fakes() -> None:
    for extra in ([], ["--fakes"]):
        result = bench("bench/trace_route.py", "-v", *extra, timeout_s=60)
        out = result.stdout
        assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
        route = out.splitlines()[1]
        # from the pop gate through the job's run to the submit pipeline
        for file in ("service/loop.py", "horde/pop.py", "run/chat.py", "run/submit.py"):
            assert file in route, (file, route)
        assert ("horde/client.py" in route) is not bool(extra), route
        counts = {
            name: (int(whole), int(after))
            for name, whole, after in re.findall(r"^  (in sequence|after leaving it|on the call path)\s+(\d+)\s+(\d+)$", out, re.MULTILINE)
        }
        assert set(counts) == {"in sequence", "after leaving it", "on the call path"}, out
        listed = out.split("entries after leaving the file, from the pop's answer:\n")[1]
        assert len(re.findall(r"^  \S+\.py: \S+$", listed, re.MULTILINE)) == counts["after leaving it"][1]
        # going back after leaving a file is one kind of going back in sequence
        assert counts["after leaving it"][0] <= counts["in sequence"][0]
        assert f"reproduce: python bench/trace_route.py{' --fakes' if extra else ''}" in out


def test_kudos_bench_on_the_real_horde_without_its_source_says_it_was_skipped() -> None:
    env = dict(os.environ)
    env.pop("AI_HORDE_SRC", None)
    env.pop("BENCH_PKG_ROOT", None)
    result = bench("bench/bench_kudos.py", "--quick", "--real-horde", timeout_s=60, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped: --real-horde needs AI_HORDE_SRC, an AI Horde source checkout" in result.stdout
    assert "python bench/bench_kudos.py --quick --real-horde" in result.stdout


def test_kudos_bench_reads_the_served_models_parameters_from_its_file_name() -> None:
    """The real Horde's model reference gets the served model's parameter count."""
    bk = _bench_module()
    assert bk.model_parameters(Path("m/SmolLM2-135M-Instruct.Q4_1.gguf")) == 135_000_000
    assert bk.model_parameters(Path("Qwen3-8B-Q4_K_M.gguf")) == 8_000_000_000
    assert bk.model_parameters(Path("Llama-3.2-1.5B.gguf")) == 1_500_000_000
    assert bk.model_parameters(Path("tiny.gguf")) is None


def test_kudos_bench_puts_the_dev_and_the_real_hordes_figures_side_by_side() -> None:
    bk = _bench_module()

    def batch(worker: str, latency: int, kudos: float, wall: float) -> Any:
        return bk.Batch(worker=worker, slots=1, latency_ms=latency, round=1, jobs=4, ok=4,
                        wall_s=wall, kudos=kudos, gen_times_s=[1.0] * 4)

    dev = [batch("own", 0, 8.0, 8.0), batch("ours", 0, 8.0, 4.0), batch("own", 150, 8.0, 9.0)]
    real = [batch("own", 0, 0.24, 8.0), batch("ours", 0, 0.24, 6.0)]
    lines = bk.side_by_side(dev, real, [1])
    cells = [line.split() for line in lines[1:]]
    assert ["1", "dev", "0", "ms", "own", "2.000", "3600.0", "1800"] in cells
    assert ["1", "dev", "0", "ms", "ours/own", "1.000x", "2.000x", "2.000x"] in cells
    assert ["1", "real", "own", "0.060", "108.0", "1800"] in cells
    assert ["1", "real", "ours/own", "1.000x", "1.333x", "1.333x"] in cells
    assert not any("150" in line for line in lines)  # the dev Horde at 0 ms only
