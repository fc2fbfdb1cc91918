"""Figures, the machine line, the printed report, the JSON and the reproduce command.

A bench result is a dict ``{"name", "title", "machine", "command", "figures",
"notes", ...}``; ``figures`` are :func:`figure` dicts. ``bench/run.py`` reads
the same shape from each script's ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MACHINE_NOTE = (
    "on a machine shared with other work figures vary between runs: "
    "compare medians, and re-run before concluding"
)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def figure(
    name: str,
    unit: str,
    values: Sequence[float],
    *,
    limit: float | None = None,
    better: str = "lower",
    note: str = "",
) -> dict[str, Any]:
    """One reported figure: min / median / max of ``values`` (one per run or per item).

    ``limit`` is the target; ``met`` compares the median with it
    (``better`` "lower": median <= limit; "higher": median >= limit).
    """
    vals = [float(v) for v in values]
    med = statistics.median(vals) if vals else float("nan")
    fig: dict[str, Any] = {
        "name": name,
        "unit": unit,
        "n": len(vals),
        "min": min(vals) if vals else float("nan"),
        "median": med,
        "max": max(vals) if vals else float("nan"),
        "values": [round(v, 4) for v in vals[:50]],
    }
    if limit is not None:
        fig["target"] = f"{'<=' if better == 'lower' else '>='} {limit:g} {unit}"
        fig["limit"] = limit
        fig["better"] = better
        fig["met"] = bool(med <= limit) if better == "lower" else bool(med >= limit)
    if note:
        fig["note"] = note
    return fig


def format_figure(fig: dict[str, Any]) -> str:
    """``name: min .. median .. max unit  [target: met/NOT met]`` on one line."""

    def num(x: float) -> str:
        if x != x:  # NaN
            return "n/a"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"

    text = (
        f"  {fig['name']:<44} min {num(fig['min']):>7}  median {num(fig['median']):>7}  "
        f"max {num(fig['max']):>7} {fig['unit']}"
    )
    if "target" in fig:
        text += f"   [target {fig['target']}: {'met' if fig['met'] else 'NOT met'}]"
    if fig.get("note"):
        text += f"   ({fig['note']})"
    return text


def machine_info() -> dict[str, Any]:
    """CPU, Python and load, to print beside the figures."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": load,
        "note": MACHINE_NOTE,
    }


def machine_line(m: dict[str, Any]) -> str:
    """``machine: <cpu> x<n>, Python <v>, load <1 5 15 min>`` from :func:`machine_info`."""
    return f"machine: {m['cpu']} x{m['cpus']}, Python {m['python']}, load {' '.join(m['loadavg'])}"


def rss_bytes() -> int:
    """This process's resident set size now, bytes (from /proc/self/statm)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def reproduce(script: str, *args: str, env: Sequence[str] = ()) -> str:
    """The command that reproduces a run: ``python bench/<script> <args>``, after the
    environment settings it read (``BENCH_PKG_ROOT`` and ``env``) that are set."""
    prefix = [f"{var}={os.environ[var]}" for var in ("BENCH_PKG_ROOT", *env) if os.environ.get(var)]
    return " ".join([*prefix, f"python bench/{script}", *(a for a in args if a)])


def bench_result(
    name: str, title: str, command: str, figures: list[dict[str, Any]], notes: list[str], **more: Any
) -> dict[str, Any]:
    """A bench result with this machine's :func:`machine_info`; ``more`` adds keys."""
    return {
        "name": name,
        "title": title,
        "machine": machine_info(),
        "command": command,
        "figures": figures,
        "notes": notes,
        **more,
    }


def skipped(name: str, title: str, command: str, why: str) -> dict[str, Any]:
    """The result of a bench that could not run (``skipped``: why not)."""
    return bench_result(name, title, command, [], [f"skipped: {why}"], skipped=why)


def print_result(res: dict[str, Any]) -> None:
    """Print a bench result: header, machine note, figures, notes, the command."""
    print(f"== {res['name']}: {res.get('title', '')}")
    print("  " + machine_line(res.get("machine") or machine_info()))
    print(f"  note: {MACHINE_NOTE}")
    for fig in res["figures"]:
        print(format_figure(fig))
    for note in res.get("notes", []):
        print(f"  - {note}")
    print(f"  reproduce: {res['command']}")


def write_json(path: str | None, res: dict[str, Any]) -> None:
    """Write ``res`` as JSON to ``path`` (nothing when None)."""
    if path:
        Path(path).write_text(json.dumps(res, indent=2, default=str))


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's argument parser, described by the first line of its docstring."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0])


def add_json(ap: argparse.ArgumentParser) -> None:
    """The ``--json OUT`` option of the scripts ``bench/run.py`` reads."""
    ap.add_argument("--json", help="also write the result as JSON to this file")


def finish(res: dict[str, Any], json_path: str | None) -> int:
    """Print ``res``, write it to ``json_path`` (when given); the exit code, 0."""
    print_result(res)
    write_json(json_path, res)
    return 0


def git(path: Path, *args: str) -> str:
    """``git -C path args`` stdout, stripped; "" when git fails or is missing."""
    try:
        return subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
