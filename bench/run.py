"""Run every benchmark, print the figures, and save them as JSON.

Each benchmark runs as its own process; the figures with targets are printed
again as a summary and written with the machine, the git commit and the
commands to ``bench/results/<UTC timestamp>.json`` (``--out DIR``,
``--no-save``); ``--compare OLD.json`` prints the change of every median. The
benchmarks, their targets and how they measure: bench/README.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness import BENCH, RESULTS, ROOT
from harness.report import format_figure, git, machine_info, machine_line, parser


@dataclass(frozen=True)
class Bench:
    """One sub-benchmark: its script and its arguments in full and quick mode.

    ``own``: the script takes ``--json PATH`` and writes this suite's result
    format; otherwise its stdout is parsed for "min X median Y max Z" and
    "a / b / c" lines and kept whole in the JSON.
    """

    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    timeout_s: float
    own: bool = True
    targets: tuple[tuple[str, float, str], ...] = ()  # (unit, limit, better) for parsed figures
    unit: str = ""  # the unit of parsed "a / b / c" figures
    patterns: tuple[tuple[str, str, str, float | None], ...] = ()  # (name, regex, unit, limit)


BENCHES: tuple[Bench, ...] = (
    Bench("overhead", "bench_overhead.py", (), ("--quick",), 300),
    Bench("throughput", "bench_throughput.py", (), ("--quick",), 400),
    Bench("offload", "bench_offload.py", (), ("--quick",), 300),
    Bench(
        "sse",
        "bench_sse.py",
        ("--runs", "5", "--mib", "8"),
        ("--runs", "3", "--mib", "2"),
        300,
        own=False,
        targets=(("MB/s", 50.0, "higher"),),
    ),
    Bench(
        "progress",
        "bench_progress.py",
        ("--runs", "2"),
        ("--runs", "1", "--tokens", "1000"),
        300,
        own=False,
        unit="s",
    ),
    Bench("stop", "bench_stop.py", (), ("--quick",), 600),
    Bench("journal", "bench_journal.py", (), ("--quick",), 300),
    Bench("memory", "bench_memory.py", (), ("--quick",), 600),
    Bench(
        "soak",
        "soak.py",
        (),
        ("--jobs", "2000", "--warmup", "500"),
        300,
        own=False,
        patterns=(
            ("double submits", r"double submits\s+(\d+)", "count", 0.0),
            ("lost jobs", r"lost jobs\s+(\d+)", "count", 0.0),
            ("peak RSS", r"peak RSS\s+([\d.]+)\s*MiB", "MiB", None),
            ("RSS growth after warm-up", r"RSS growth after warm-up\s+\+?(-?[\d.]+)\s*MiB", "MiB", None),
        ),
    ),
    Bench("real", "bench_real.py", (), ("--quick",), 400),
    Bench("kudos", "bench_kudos.py", (), ("--quick",), 3600),
)

_MIN_MED_MAX = re.compile(
    r"^\s*(?P<name>.*?)[\s:]*\bmin\s+(?P<min>-?[\d.]+)\s+median\s+(?P<med>-?[\d.]+)\s+"
    r"max\s+(?P<max>-?[\d.]+)\s*(?P<unit>[^\s\[(]*)"
)
_SLASHES = re.compile(
    r"^\s*(?P<name>[A-Za-z][^\d\n]*?)\s+(?P<min>-?[\d.]+)\s*/\s*(?P<med>-?[\d.]+)\s*/\s*"
    r"(?P<max>-?[\d.]+)\s*(?P<rest>.*)$"
)
_UNIT_BEFORE = re.compile(r"(?P<unit>[A-Za-z/%]+)\s*$")


def parse_figures(stdout: str, bench: Bench) -> list[dict[str, Any]]:
    """Figures from another script's stdout: "<name> ... min X median Y max Z [unit]"
    lines (the unit may also stand just before "min"), "<name> a / b / c" lines, and
    the bench's own single-value ``patterns``."""
    figures: list[dict[str, Any]] = []
    for name, pattern, unit, limit in bench.patterns:
        found = re.search(pattern, stdout)
        if found:
            v = float(found.group(1))
            pfig: dict[str, Any] = {"name": name, "unit": unit, "min": v, "median": v, "max": v}
            if limit is not None:
                pfig.update(target=f"<= {limit:g} {unit}", limit=limit, better="lower", met=v <= limit)
            figures.append(pfig)
    targets = bench.targets
    for line in stdout.splitlines():
        m = _MIN_MED_MAX.search(line)
        if m:
            name = m["name"].strip(" :")
            unit = m["unit"]
            before = _UNIT_BEFORE.search(name)
            if before:
                unit = unit or before["unit"]
                name = name[: before.start()].strip(" :")
            name = re.sub(r"\s+", " ", name)
            fig: dict[str, Any] = {
                "name": name,
                "unit": unit,
                "min": float(m["min"]),
                "median": float(m["med"]),
                "max": float(m["max"]),
            }
        else:
            s = _SLASHES.search(line)
            if not s:
                continue
            fig = {
                "name": re.sub(r"\s+", " ", s["name"].strip(" :")),
                "unit": bench.unit,
                "min": float(s["min"]),
                "median": float(s["med"]),
                "max": float(s["max"]),
            }
            rest = s["rest"].strip()
            if rest:
                fig["note"] = rest
        for unit, limit, better in targets:
            if fig["unit"] == unit:
                fig["target"] = f"{'<=' if better == 'lower' else '>='} {limit:g} {unit}"
                fig["limit"] = limit
                fig["better"] = better
                med = fig["median"]
                fig["met"] = med <= limit if better == "lower" else med >= limit
        figures.append(fig)
    return figures


def run_bench(bench: Bench, *, quick: bool) -> dict[str, Any]:
    """Run one sub-benchmark as a process; returns its result (``figures``, ``stdout``...)."""
    script = BENCH / bench.script
    command = ["python", f"bench/{bench.script}", *(bench.quick if quick else bench.full)]
    if not script.is_file():
        return {"name": bench.name, "skipped": f"bench/{bench.script} not found", "figures": []}
    args = [sys.executable, str(script), *(bench.quick if quick else bench.full)]
    out_json = None
    if bench.own:
        fd, out_json = tempfile.mkstemp(prefix=f"bench_{bench.name}_", suffix=".json")
        os.close(fd)
        Path(out_json).unlink()
        args += ["--json", out_json]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            args, cwd=str(ROOT), capture_output=True, text=True, timeout=bench.timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return {
            "name": bench.name,
            "error": f"timed out after {bench.timeout_s:g} s",
            "stdout": out,
            "figures": [],
            "command": " ".join(command),
        }
    elapsed = time.monotonic() - t0
    result: dict[str, Any]
    if bench.own and out_json and Path(out_json).is_file():
        result = json.loads(Path(out_json).read_text())
        Path(out_json).unlink()
    else:
        result = {
            "name": bench.name,
            "command": " ".join(command),
            "figures": parse_figures(proc.stdout, bench),
        }
    result["stdout"] = proc.stdout
    result["seconds"] = round(elapsed, 1)
    result["exit_code"] = proc.returncode
    if proc.returncode != 0:
        result["error"] = f"exit code {proc.returncode}: {proc.stderr.strip()[-800:]}"
    return result


def git_state() -> dict[str, Any]:
    """The commit and whether the work tree differs from it."""
    return {
        "commit": git(ROOT, "rev-parse", "HEAD"),
        "dirty": bool(git(ROOT, "status", "--porcelain", "--untracked-files=no")),
    }


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Lines "bench / figure: old median -> new median (change)" for figures in both."""
    lines = []
    for name, result in new.get("benchmarks", {}).items():
        before = {f["name"]: f for f in old.get("benchmarks", {}).get(name, {}).get("figures", [])}
        for fig in result.get("figures", []):
            prev = before.get(fig["name"])
            if prev is None:
                continue
            a, b = prev["median"], fig["median"]
            change = f"{(b - a) / a * 100:+.0f}%" if a else "n/a"
            lines.append(
                f"  {name:10} {fig['name'][:52]:52} {a:10.4g} -> {b:10.4g} {fig.get('unit', '')} ({change})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="shorter runs (about a minute)")
    ap.add_argument("--only", default="", help="comma-separated names to run")
    ap.add_argument("--skip", default="", help="comma-separated names not to run")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON")
    ap.add_argument("--no-save", action="store_true", help="do not write the JSON")
    ap.add_argument("--compare", help="an earlier results JSON to compare the medians with")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        for b in BENCHES:
            print(f"{b.name:10} bench/{b.script}")
        return 0
    names = {b.name for b in BENCHES}
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - names
    if unknown:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}; known: {sorted(names)}")
    selected = [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]
    command = "python bench/run.py" + " ".join(
        [""]
        + (["--quick"] if args.quick else [])
        + ([f"--only {args.only}"] if args.only else [])
        + ([f"--skip {args.skip}"] if args.skip else [])
    )
    machine = machine_info()
    print(f"{command}  ({'quick' if args.quick else 'full'} mode)")
    print(machine_line(machine))
    print(f"note: {machine['note']}")
    if os.environ.get("BENCH_PKG_ROOT"):
        print(f"package: {os.environ['BENCH_PKG_ROOT']} (BENCH_PKG_ROOT), not the repository's")
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    for bench in selected:
        print(f"\n-- {bench.name} (bench/{bench.script})", flush=True)
        result = run_bench(bench, quick=args.quick)
        results[bench.name] = result
        if result.get("skipped"):
            print(f"  skipped: {result['skipped']}")
            continue
        print(result.get("stdout", "").rstrip())
        if result.get("error"):
            print(f"  ERROR: {result['error']}")
        print(f"  ({result.get('seconds', '?')} s)", flush=True)
    total = time.monotonic() - t0
    report = {
        "timestamp": started.isoformat(timespec="seconds"),
        "command": command,
        "quick": args.quick,
        "git": git_state(),
        "package_root": os.environ.get("BENCH_PKG_ROOT") or str(ROOT),
        "machine": machine,
        "seconds": round(total, 1),
        "benchmarks": results,
    }
    print(f"\n== summary ({total:.0f} s)")
    missed = 0
    for name, result in results.items():
        if result.get("skipped"):
            print(f"  {name}: skipped ({result['skipped']})")
            continue
        if result.get("error"):
            print(f"  {name}: ERROR {result['error'][:200]}")
        for fig in result.get("figures", []):
            if "target" in fig:
                missed += 0 if fig["met"] else 1
                print(f"  {name:10}" + format_figure(fig)[1:])
        for note in result.get("notes", []):
            if "STALLED" in note or "failed" in note:
                print(f"  {name:10} {note}")
    print(f"  {missed} figure(s) off target")
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        print(f"\n== compared with {args.compare} ({old.get('git', {}).get('commit', '?')[:10]})")
        for line in compare(old, report):
            print(line)
    if not args.no_save:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    failed = [n for n, r in results.items() if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
