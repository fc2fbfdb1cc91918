"""The benchmarks must not rot: a quick run of the cheap ones exits 0 and prints figures.

Runs ``python bench/run.py --quick --only overhead,throughput,sse --no-save`` (about
10 s: the dev Horde and a scripted koboldcpp in a server process, the worker in
another) and checks that every selected benchmark printed its figures, its
reproduce command and the summary. No figure is held to its target here: the
machine's load decides those, and ``bench/run.py`` reports them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ("overhead", "throughput", "sse")


def test_quick_run_of_the_cheap_benchmarks_prints_their_figures() -> None:
    result = subprocess.run(
        [sys.executable, "bench/run.py", "--quick", "--only", ",".join(CHEAP), "--no-save"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
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
    ):
        assert re.search(re.escape(label) + r".*?" + figure, out), label
    assert re.search(r"MB/s\s+min\s+[\d.]+\s+median", out), "SSE figures missing"
    assert "reproduce: python bench/bench_overhead.py" in out
    assert "reproduce: python bench/bench_throughput.py" in out
    assert "== summary" in out
    assert "figure(s) off target" in out
