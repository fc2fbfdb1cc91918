"""Kudos per hour on a real koboldcpp: koboldcpp's own embedded worker against the patched one.

Both serve the same text jobs from the dev Horde (in this process) at each
``--latency-ms`` and ``--slots``, alternating, for ``--rounds``: per-job time,
busy fraction, kudos/hour, the gap from a submit's answer to the next pop, pop
to submit, and the ratios ours/own. Needs a built koboldcpp and a model
(``KCPP_DIR``, ``KCPP_MODEL``); without them it says it was skipped and why.
``--real-horde`` then serves the same jobs from the real AI Horde server too
(``AI_HORDE_SRC``, ``harness.real_horde``), each worker rewarded by its own kudos
formula, and prints those figures beside the dev Horde's.
The figures, targets and method: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from harness import PKG_ROOT
from harness.devkit import Request, Response, TimedDevHorde, is_validated_backend
from harness.real_horde import HordeUser, RealHorde, RealHordeError, source_from_env, sql_literal
from harness.real_kcpp import KoboldcppProcess, find_koboldcpp, stop_all, stop_on_sigterm
from harness.report import (
    add_json,
    bench_result,
    figure,
    git,
    machine_line,
    parser,
    reproduce,
    skipped,
    write_json,
)

API_KEY = "bench-kudos-key-0123456789"
OWN, OURS = "own", "ours"
#: The bridge agent koboldcpp's own worker sends, and the start of ours.
OWN_AGENT = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
OURS_AGENT_PREFIX = "KoboldCppEmbedWorker:2:koboldcpp-horde-chat"
#: The line of koboldcpp.py that hard-codes the Horde, and what the own copy has instead.
CLUSTER_LINE = '    cluster = "https://aihorde.net"\n'
CLUSTER_ENV_LINE = '    cluster = os.environ.get("AI_HORDE_URL", "https://aihorde.net")\n'
PROMPT = (
    "### Instruction:\nWrite a short story about a lighthouse keeper who finds a "
    "message in a bottle.\n### Response:\n"
)
MAX_CONTEXT = 1024
GEN_PARAMS: dict[str, Any] = {
    "temperature": 0.0,
    "sampler_seed": 1234,
    "rep_pen": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "ban_eos_token": True,
}
#: koboldcpp counts its start as a local request and its worker waits 20 s after it.
KCPP_START_QUIET_S = 20.0
FIRST_POP_TIMEOUT_S = 90.0
#: Log lines worth a note: koboldcpp's own worker's errors and busy waits, our warnings.
ODD_LINE = re.compile(
    r"Server Busy|Error|error|Failed|failed|Traceback|Abandoned|WARNING|ERROR|Paused"
)


# --------------------------------------------------------------------------------------
# koboldcpp: the two copies, one process


def kcpp_version(source: str) -> str:
    """koboldcpp's release from its source (``KcppVersion = "1.116.1"``), or ""."""
    found = re.search(r'^KcppVersion\s*=\s*"([^"]+)"', source, re.M)
    return found.group(1) if found else ""


def prepare_tree(kdir: Path, work: Path) -> tuple[Path, str, str, str]:
    """Build the run directory: links to everything in ``kdir`` plus the two copies.

    Returns ``(tree, own script name, ours script name, koboldcpp release)``.
    Raises RuntimeError when the Horde URL line is not found once in
    ``koboldcpp.py``, no patch matches the release, or the patch does not apply.
    """
    source = (kdir / "koboldcpp.py").read_text(encoding="utf-8")
    release = kcpp_version(source)
    patch = PKG_ROOT / "patches" / f"koboldcpp-{release}.patch"
    if not patch.is_file():
        raise RuntimeError(f"no patch for koboldcpp {release or '(unknown release)'} at {patch}")
    if source.count(CLUSTER_LINE) != 1:
        raise RuntimeError(
            "koboldcpp.py does not hard-code the Horde URL on one line as expected; "
            "cannot point its own worker at the dev Horde"
        )
    tree = work / "kcpp"
    tree.mkdir()
    for entry in kdir.iterdir():
        if entry.name.startswith("koboldcpp") and entry.suffix == ".py":
            continue
        (tree / entry.name).symlink_to(entry)
    own = "koboldcpp_own_devhorde.py"
    (tree / own).write_text(source.replace(CLUSTER_LINE, CLUSTER_ENV_LINE), encoding="utf-8")
    stage = work / "patch"
    stage.mkdir()
    (stage / "koboldcpp.py").write_text(source, encoding="utf-8")
    proc = subprocess.run(
        ["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-i", str(patch)],
        cwd=str(stage),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{patch.name} does not apply: {(proc.stdout + proc.stderr).strip()}")
    ours = "koboldcpp_patched.py"
    shutil.move(str(stage / "koboldcpp.py"), str(tree / ours))
    shutil.rmtree(stage)
    return tree, own, ours, release


def job_body(max_length: int) -> dict[str, Any]:
    """The body a popped job sends to koboldcpp (the dev Horde's text payload)."""
    body = dict(GEN_PARAMS)
    body.update({"prompt": PROMPT, "max_length": max_length, "max_context_length": MAX_CONTEXT})
    return body


def _generate(url: str, body: dict[str, Any]) -> tuple[float, str]:
    """POST one job body to koboldcpp's /api/v1/generate; (seconds, text)."""
    body = dict(body, genkey=f"HORDEREQ_{os.urandom(4).hex()}")  # not a local user
    t0 = time.monotonic()
    resp = requests.post(url + "/api/v1/generate", json=body, timeout=300)
    elapsed = time.monotonic() - t0
    resp.raise_for_status()
    return elapsed, str(resp.json()["results"][0]["text"])


def measure_generation(url: str, body: dict[str, Any], *, slots: int) -> dict[str, Any]:
    """Generation time of one job on this koboldcpp, sent straight to it.

    One warm-up, three single requests; with two slots also three pairs sent
    at once. Returns ``{"single": [s...], "pair": [pair wall s...], "text": str,
    "gen_s": median single, or median pair / 2 with two slots}``.
    """
    _generate(url, body)
    singles = []
    text = ""
    for _ in range(3):
        elapsed, text = _generate(url, body)
        singles.append(elapsed)
    pairs: list[float] = []
    if slots > 1:
        for _ in range(3):
            out: list[float] = []

            def one(sink: list[float] = out) -> None:
                sink.append(_generate(url, body)[0])

            threads = [threading.Thread(target=one) for _ in range(slots)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if len(out) == slots:
                pairs.append(time.monotonic() - t0)
    gen = statistics.median(pairs) / slots if pairs else statistics.median(singles)
    return {"single": singles, "pair": pairs, "text": text, "gen_s": gen}


# --------------------------------------------------------------------------------------
# the dev Horde, timed


@dataclass
class Call:
    """One worker call as the dev Horde saw it (monotonic seconds)."""

    route: str  # "pop" | "submit" | "progress"
    t_in: float  # request read
    t_out: float  # answer ready (after the simulated latency)
    status: int
    job_id: str | None  # pop: the job handed out; submit: the job submitted
    worker: str | None = None  # pop: the worker name
    agent: str | None = None  # pop: the bridge agent
    reward: float | None = None  # submit: the kudos paid
    generation: str | None = None  # submit: the text


class RecordingHorde(TimedDevHorde):
    """The dev Horde, noting each worker call as a :class:`Call`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[Call] = []
        self._calls_lock = threading.Lock()

    def on_call(self, req: Request, resp: Response, t_in: float, t_out: float) -> None:
        route = req.path.rsplit("/", 1)[-1]
        if route not in ("pop", "submit", "progress"):
            return
        try:
            body = json.loads(req.body or b"{}")
        except ValueError:
            body = {}
        try:
            answer = json.loads(resp.body or b"{}")
        except ValueError:
            answer = {}
        body = body if isinstance(body, dict) else {}
        answer = answer if isinstance(answer, dict) else {}
        call = Call(route, t_in, t_out, resp.status, None)
        if route == "pop":
            call.job_id = answer.get("id") if isinstance(answer.get("id"), str) else None
            call.worker = body.get("name")
            call.agent = body.get("bridge_agent")
        elif route == "submit":
            call.job_id = body.get("id") if isinstance(body.get("id"), str) else None
            reward = answer.get("reward")
            call.reward = float(reward) if isinstance(reward, (int, float)) else None
            gen = body.get("generation")
            call.generation = gen if isinstance(gen, str) else None
        with self._calls_lock:
            self.calls.append(call)

    def take_calls(self) -> list[Call]:
        with self._calls_lock:
            out, self.calls = self.calls, []
        return out


# --------------------------------------------------------------------------------------
# one batch, one koboldcpp process


@dataclass
class Batch:
    """The figures of N jobs served by one worker at one latency."""

    worker: str
    slots: int
    latency_ms: int
    round: int
    jobs: int
    ok: int
    wall_s: float
    kudos: float
    gen_times_s: list[float]  # each job's generation time, koboldcpp's own figure
    gaps_ms: list[float] = field(default_factory=list)
    pop_to_submit_s: list[float] = field(default_factory=list)
    bad: dict[str, int] = field(default_factory=dict)
    same_text: int = 0
    gen_source: str = "log"

    @property
    def per_job_s(self) -> float:
        return self.wall_s / self.ok if self.ok else float("nan")

    @property
    def jobs_per_hour(self) -> float:
        return self.ok / self.wall_s * 3600 if self.wall_s > 0 else float("nan")

    @property
    def kudos_per_hour(self) -> float:
        return self.kudos / self.wall_s * 3600 if self.wall_s > 0 else float("nan")

    @property
    def gen_s(self) -> float:
        return statistics.median(self.gen_times_s) if self.gen_times_s else float("nan")

    @property
    def busy(self) -> float:
        """Generation time of the batch's jobs over the slots' wall time (0..1)."""
        if not self.wall_s > 0:
            return float("nan")
        return sum(self.gen_times_s) / (self.slots * self.wall_s)

    @property
    def idle_ms(self) -> float:
        """Slot time per job not spent generating, ms: (slots x wall - generation) / N."""
        if not self.ok:
            return float("nan")
        return (self.slots * self.wall_s - sum(self.gen_times_s)) / self.ok * 1e3

    @property
    def gap_ms(self) -> float:
        return statistics.median(self.gaps_ms) if self.gaps_ms else float("nan")

    @property
    def pop_submit_s(self) -> float:
        return statistics.median(self.pop_to_submit_s) if self.pop_to_submit_s else float("nan")

    def row(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "slots": self.slots,
            "latency_ms": self.latency_ms,
            "round": self.round,
            "jobs": self.jobs,
            "ok": self.ok,
            "wall_s": round(self.wall_s, 4),
            "per_job_s": round(self.per_job_s, 4),
            "gen_s": round(self.gen_s, 4),
            "gen_times_s": [round(g, 3) for g in self.gen_times_s],
            "gen_source": self.gen_source,
            "busy": round(self.busy, 4),
            "idle_ms_per_job": round(self.idle_ms, 1),
            "kudos": self.kudos,
            "kudos_per_hour": round(self.kudos_per_hour, 1),
            "jobs_per_hour": round(self.jobs_per_hour, 1),
            "gap_ms_median": None if self.gap_ms != self.gap_ms else round(self.gap_ms, 2),
            "gaps_ms": [round(g, 2) for g in self.gaps_ms],
            "pop_to_submit_s_median": round(self.pop_submit_s, 4),
            "bad": self.bad,
            "same_text_as_direct": self.same_text,
        }


def analyse_batch(
    calls: Sequence[Call],
    job_ids: set[str],
    *,
    slots: int,
) -> dict[str, Any]:
    """Figures of one batch from the dev Horde's record of the worker's calls.

    ``job_ids``: the jobs the dev Horde handed out for the batch's requests.
    Returns ``{"wall_s", "ok", "kudos", "gaps_ms", "pop_to_submit_s", "bad",
    "generations"}``: wall from the first job pop arriving to the last accepted
    submit answered; the gap (one slot only) from job k's submit answered to
    the pop carrying job k+1 arriving, in ms, signed; pop -> submit from the
    answer carrying a job to its first submit arriving; ``bad`` counts pops and
    submits not answered 200.
    """
    job_pops = sorted(
        (c for c in calls if c.route == "pop" and c.status == 200 and c.job_id in job_ids),
        key=lambda c: c.t_in,
    )
    submits = [c for c in calls if c.route == "submit" and c.job_id in job_ids]
    accepted = sorted((c for c in submits if c.status == 200), key=lambda c: c.t_in)
    bad: dict[str, int] = {}
    for c in calls:
        if c.status != 200 and c.route in ("pop", "submit"):
            key = f"{c.route} HTTP {c.status}"
            bad[key] = bad.get(key, 0) + 1
    first_submit: dict[str, Call] = {}
    for c in sorted(submits, key=lambda c: c.t_in):
        first_submit.setdefault(c.job_id or "", c)
    pop_to_submit = [
        first_submit[p.job_id].t_in - p.t_out for p in job_pops if p.job_id in first_submit
    ]
    gaps: list[float] = []
    if slots == 1:
        by_job = {c.job_id: c for c in accepted}
        for cur, nxt in zip(job_pops, job_pops[1:], strict=False):
            sub = by_job.get(cur.job_id)
            if sub is not None:
                gaps.append((nxt.t_in - sub.t_out) * 1e3)
    wall = (
        max(c.t_out for c in accepted) - job_pops[0].t_in if accepted and job_pops else float("nan")
    )
    return {
        "wall_s": wall,
        "ok": len({c.job_id for c in accepted}),
        "kudos": round(sum(c.reward or 0.0 for c in accepted), 2),
        "gaps_ms": gaps,
        "pop_to_submit_s": pop_to_submit,
        "bad": bad,
        "generations": [c.generation for c in accepted],
    }


@dataclass
class Context:
    horde: RecordingHorde
    tree: Path
    scripts: dict[str, str]
    model: Path
    logs: Path
    pythonpath: str
    jobs: int
    max_length: int
    notes: list[str] = field(default_factory=list)
    #: Ends every worker name, so two runs on one machine never share one (a
    #: worker refuses to start under a name another process of the machine holds).
    tag: str = field(default_factory=lambda: str(os.getpid()))
    processes: list[dict[str, Any]] = field(default_factory=list)


#: koboldcpp's line after each generation: one slot "CtxLimit:..., Total:0.97s";
#: batched (--parallelrequests) "BatchRequest:3, Prompt:25, Generated:48/48 in 1.87s".
_GEN_ONE = re.compile(r"CtxLimit:[^\n]*?Total:([\d.]+)s")
_GEN_BATCHED = re.compile(r"BatchRequest:\d+,[^\n]*? in ([\d.]+)s")


def logged_generation_times(text: str) -> list[float]:
    """Each generation's time in seconds, as koboldcpp printed it after it.

    One slot: ``Total`` of the ``CtxLimit`` line (prompt processing and
    generation); batched: the ``in X s`` of the ``BatchRequest`` line. Lines may
    run into the next log line (koboldcpp prints them without a newline).
    """
    return [float(m.group(1)) for m in _GEN_ONE.finditer(text)] + [
        float(m.group(1)) for m in _GEN_BATCHED.finditer(text)
    ]


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def odd_lines(log_path: Path, limit: int = 12) -> tuple[int, list[str]]:
    """(count, first ``limit``) of a koboldcpp log's lines about errors, busy waits or warnings."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return 0, []
    hits = [
        ln.strip()
        for ln in lines
        if ODD_LINE.search(ln)
        and "IPv6" not in ln
        and "VRAM" not in ln
        and "available RAM" not in ln
    ]
    return len(hits), hits[:limit]


def run_process(
    ctx: Context, worker: str, slots: int, latencies: Sequence[int], round_no: int
) -> list[Batch]:
    """Start one koboldcpp for ``worker``, measure its generation time, then one batch
    of ``ctx.jobs`` text jobs per latency; stop it. Raises RuntimeError on a failure."""
    name = f"bench-{worker}-s{slots}-r{round_no}-{ctx.tag}"
    log_path = ctx.logs / f"{name}.log"
    extra = ["--hordekey", API_KEY, "--hordeworkername", name, "--hordegenlen", "128"]
    if slots > 1:
        extra += ["--parallelrequests", str(slots)]
    proc = KoboldcppProcess(
        ctx.tree,
        ctx.scripts[worker],
        ctx.model,
        log_path,
        extra_args=extra,
        env={
            "AI_HORDE_URL": ctx.horde.url,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": ctx.pythonpath if worker == OURS else None,
        },
    )
    batches: list[Batch] = []
    record: dict[str, Any] = {"name": name, "worker": worker, "slots": slots, "round": round_no}
    try:
        proc.wait_ready()
        record["ready_s"] = round(time.monotonic() - proc.started_at, 1)
        body = job_body(ctx.max_length)
        gen = measure_generation(proc.url, body, slots=slots)
        record["direct"] = {
            "single_s": [round(x, 4) for x in gen["single"]],
            "pair_s": [round(x, 4) for x in gen["pair"]],
            "gen_s": round(gen["gen_s"], 4),
        }
        # wait for the worker's first pop (it sits out koboldcpp's start first)
        deadline = time.monotonic() + FIRST_POP_TIMEOUT_S
        agent = None
        while time.monotonic() < deadline and agent is None:
            if not proc.alive():
                raise RuntimeError(f"koboldcpp exited; see {log_path}")
            for c in list(ctx.horde.calls):
                if c.route == "pop" and c.worker == name:
                    agent = c.agent or ""
                    break
            time.sleep(0.1)
        if agent is None:
            raise RuntimeError(f"{name}: no pop within {FIRST_POP_TIMEOUT_S:.0f} s; see {log_path}")
        record["first_pop_s"] = round(time.monotonic() - proc.started_at, 1)
        record["bridge_agent"] = agent
        want_ours = worker == OURS
        if agent.startswith(OURS_AGENT_PREFIX) != want_ours or not is_validated_backend(agent):
            raise RuntimeError(
                f"{name} popped with bridge agent {agent!r}: not the expected "
                f"{'package' if want_ours else 'koboldcpp'} worker (see {log_path})"
            )
        for latency in latencies:
            ctx.horde.latency_s = latency / 1000.0
            ctx.horde.take_calls()
            log_offset = _log_size(log_path)
            rids = [
                ctx.horde.send_text(
                    PROMPT,
                    max_length=ctx.max_length,
                    max_context_length=MAX_CONTEXT,
                    params=GEN_PARAMS,
                )
                for _ in range(ctx.jobs)
            ]
            timeout = 60.0 + ctx.jobs * 30.0
            if not ctx.horde.wait(rids, timeout_s=timeout):
                raise RuntimeError(
                    f"{name}: the batch at {latency} ms did not end in {timeout:.0f} s"
                )
            time.sleep(max(0.3, 2 * latency / 1000.0))  # let the last submit's answer be recorded
            calls = ctx.horde.take_calls()
            statuses = [ctx.horde.status(r) for r in rids]
            job_ids = {j for st in statuses for j in st["job_ids"]}
            fig = analyse_batch(calls, job_ids, slots=slots)
            gen_times = logged_generation_times(_log_since(log_path, log_offset))
            gen_source = "log"
            if len(gen_times) != fig["ok"]:
                # not koboldcpp's usual lines: fall back on the direct measurement
                gen_times = [gen["gen_s"]] * fig["ok"]
                gen_source = "direct"
            bad = dict(fig["bad"])
            for st in statuses:
                if st["state"] != "done" or st["restarted"]:
                    key = f"request {st['state']}, restarted {st['restarted']}"
                    bad[key] = bad.get(key, 0) + 1
            for entry in ctx.horde.ledger:
                if entry["job_id"] in job_ids and entry["action"] != "submitted":
                    key = f"job {entry['action']}"
                    bad[key] = bad.get(key, 0) + 1
            batch = Batch(
                worker=worker,
                slots=slots,
                latency_ms=latency,
                round=round_no,
                jobs=len(rids),
                ok=fig["ok"],
                wall_s=fig["wall_s"],
                kudos=fig["kudos"],
                gen_times_s=gen_times,
                gaps_ms=fig["gaps_ms"],
                pop_to_submit_s=fig["pop_to_submit_s"],
                bad=bad,
                same_text=sum(1 for g in fig["generations"] if g == gen["text"]),
                gen_source=gen_source,
            )
            batches.append(batch)
            print(
                f"  round {round_no} {slots} slot(s) {latency:>3} ms {worker:4}: "
                f"per job {batch.per_job_s:.3f} s, gen {batch.gen_s:.3f} s ({gen_source}), busy "
                f"{batch.busy * 100:.0f} %, idle {batch.idle_ms:.0f} ms/job, {batch.kudos_per_hour:.0f} kudos/h, gap "
                f"{batch.gap_ms:.1f} ms, pop->submit {batch.pop_submit_s:.3f} s"
                + (f", NOT OK: {bad}" if bad else ""),
                flush=True,
            )
    finally:
        proc.stop()
        count, lines = odd_lines(log_path)
        record["odd_log_lines"] = count
        record["odd_log_sample"] = lines
        ctx.processes.append(record)
    return batches


# --------------------------------------------------------------------------------------
# the real AI Horde

#: The model name both workers declare to the real Horde (``--hordemodelname``), which
#: its model reference knows with the served model's parameter count.
REAL_MODEL = "koboldcpp/kcpp-bench"
#: A parameter count in a model file's name: ``SmolLM2-135M-Instruct`` -> 135 M.
_PARAMS_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([MB])(?![A-Za-z])", re.I)


def model_parameters(model: Path) -> int | None:
    """The parameter count the model file's name gives (``135M``, ``7B``), or None."""
    found = _PARAMS_IN_NAME.search(model.stem.replace("_", "-"))
    if found is None:
        return None
    scale = 1e6 if found.group(2).upper() == "M" else 1e9
    return int(float(found.group(1)) * scale)


@dataclass
class RealRun:
    """The real Horde with its trusted owner (both workers') and its client."""

    horde: RealHorde
    owner: HordeUser
    client: HordeUser

    def send_text(self, max_length: int) -> str:
        body = {
            "prompt": PROMPT,
            "params": dict(GEN_PARAMS, max_length=max_length, max_context_length=MAX_CONTEXT),
            "models": [REAL_MODEL],
        }
        resp = requests.post(self.horde.url + "/api/v2/generate/text/async",
                             headers={"apikey": self.client.api_key}, json=body, timeout=30)
        if resp.status_code != 202:
            raise RuntimeError(f"the real Horde refused a request: {resp.status_code} {resp.text[:200]}")
        return str(resp.json()["id"])

    def rows(self, query: str) -> list[dict[str, Any]]:
        return [json.loads(r[0]) for r in self.horde.sql(f"select row_to_json(q) from ({query}) q")]

    def done(self, rids: Sequence[str]) -> int:
        ids = ", ".join(sql_literal(r) for r in rids)
        return int(self.horde.sql(
            f"select count(*) from waiting_prompts wp where wp.id in ({ids}) and wp.n = 0 and "
            "exists (select 1 from processing_gens p where p.wp_id = wp.id and p.generation is not null)"
        )[0][0])


def analyse_real_batch(run: RealRun, rids: Sequence[str], *, slots: int) -> dict[str, Any]:
    """Figures of one batch from the real Horde's database, as :func:`analyse_batch`'s.

    A job's pop is its ``processing_gens`` row's ``created``, its submit the owner's
    ``kudos_ledger`` credit's ``created`` (both the Horde's clock, written while it
    answers), its reward that credit's ``amount``; ``bad`` counts faulted jobs and
    requests not done.
    """
    ids = ", ".join(sql_literal(r) for r in rids)
    jobs = run.rows(
        "select p.id, p.wp_id, p.generation, p.faulted, extract(epoch from p.created) as t "
        f"from processing_gens p where p.wp_id in ({ids}) order by p.created"
    )
    job_ids = ", ".join(sql_literal(j["id"]) for j in jobs) or "''"
    credits = {
        c["job_id"]: c for c in run.rows(
            "select job_id, amount, extract(epoch from created) as t from kudos_ledger "
            f"where user_id = {run.owner.user_id} and job_id::text in ({job_ids})"
        )
    }
    served = [j for j in jobs if j["generation"] is not None and j["id"] in credits]
    bad: dict[str, int] = {}
    faulted = sum(1 for j in jobs if j["faulted"])
    if faulted:
        bad["job faulted or aborted"] = faulted
    if run.done(rids) != len(rids):
        bad["request not done"] = len(rids) - run.done(rids)
    pops = sorted(served, key=lambda j: float(j["t"]))
    submits = {j["id"]: float(credits[j["id"]]["t"]) for j in served}
    gaps = []
    if slots == 1:
        gaps = [(float(nxt["t"]) - submits[cur["id"]]) * 1e3 for cur, nxt in zip(pops, pops[1:], strict=False)]
    wall = max(submits.values()) - float(pops[0]["t"]) if pops else float("nan")
    return {
        "wall_s": wall,
        "ok": len(served),
        "kudos": round(sum(float(credits[j["id"]]["amount"]) for j in served), 2),
        "gaps_ms": gaps,
        "pop_to_submit_s": [submits[j["id"]] - float(j["t"]) for j in served],
        "bad": bad,
        "generations": [j["generation"] for j in served],
    }


def run_real_process(ctx: Context, run: RealRun, worker: str, slots: int, round_no: int) -> Batch:
    """:func:`run_process` against the real Horde (loopback, no added latency): one
    koboldcpp for ``worker``, its generation time measured, one batch of ``ctx.jobs``
    text jobs; stop it. Raises RuntimeError on a failure."""
    name = f"bench-real-{worker}-s{slots}-r{round_no}-{ctx.tag}"
    log_path = ctx.logs / f"{name}.log"
    extra = [f"--hordekey={run.owner.api_key}", "--hordeworkername", name, "--hordegenlen", "128",
             "--hordemodelname", REAL_MODEL]
    if slots > 1:
        extra += ["--parallelrequests", str(slots)]
    proc = KoboldcppProcess(
        ctx.tree, ctx.scripts[worker], ctx.model, log_path, extra_args=extra,
        env={"AI_HORDE_URL": run.horde.url, "PYTHONUNBUFFERED": "1",
             "PYTHONPATH": ctx.pythonpath if worker == OURS else None},
    )
    record: dict[str, Any] = {"name": name, "worker": worker, "slots": slots, "round": round_no,
                              "horde": "real"}
    try:
        proc.wait_ready()
        record["ready_s"] = round(time.monotonic() - proc.started_at, 1)
        gen = measure_generation(proc.url, job_body(ctx.max_length), slots=slots)
        record["direct"] = {"single_s": [round(x, 4) for x in gen["single"]],
                            "pair_s": [round(x, 4) for x in gen["pair"]], "gen_s": round(gen["gen_s"], 4)}
        deadline = time.monotonic() + FIRST_POP_TIMEOUT_S
        agent = None
        while time.monotonic() < deadline and agent is None:
            # its row appears at its first pop, with the bridge agent a moment later
            if not proc.alive():
                raise RuntimeError(f"koboldcpp exited; see {log_path}")
            found = run.rows(f"select bridge_agent from workers where name = {sql_literal(name)}")
            agent = found[0]["bridge_agent"] if found else None
            agent = None if agent == "unknown:0:unknown" else agent
            time.sleep(0.25)
        if agent is None:
            raise RuntimeError(f"{name}: no pop within {FIRST_POP_TIMEOUT_S:.0f} s; see {log_path}")
        record["first_pop_s"] = round(time.monotonic() - proc.started_at, 1)
        record["bridge_agent"] = agent
        if agent.startswith(OURS_AGENT_PREFIX) != (worker == OURS) or not is_validated_backend(agent):
            raise RuntimeError(f"{name} popped with bridge agent {agent!r}: not the expected worker")
        log_offset = _log_size(log_path)
        rids = [run.send_text(ctx.max_length) for _ in range(ctx.jobs)]
        timeout = 60.0 + ctx.jobs * 30.0
        deadline = time.monotonic() + timeout
        while run.done(rids) < len(rids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the batch did not end in {timeout:.0f} s; see {log_path}")
            time.sleep(0.25)
        fig = analyse_real_batch(run, rids, slots=slots)
        gen_times = logged_generation_times(_log_since(log_path, log_offset))
        gen_source = "log"
        if len(gen_times) != fig["ok"]:
            gen_times, gen_source = [gen["gen_s"]] * fig["ok"], "direct"
        batch = Batch(
            worker=worker, slots=slots, latency_ms=0, round=round_no, jobs=len(rids), ok=fig["ok"],
            wall_s=fig["wall_s"], kudos=fig["kudos"], gen_times_s=gen_times, gaps_ms=fig["gaps_ms"],
            pop_to_submit_s=fig["pop_to_submit_s"], bad=fig["bad"],
            same_text=sum(1 for g in fig["generations"] if g == gen["text"]), gen_source=gen_source,
        )
        print(
            f"  real Horde, round {round_no} {slots} slot(s) {worker:4}: per job {batch.per_job_s:.3f} s, "
            f"gen {batch.gen_s:.3f} s ({gen_source}), busy {batch.busy * 100:.0f} %, "
            f"{batch.kudos / max(batch.ok, 1):.2f} kudos/job, {batch.kudos_per_hour:.0f} kudos/h"
            + (f", NOT OK: {batch.bad}" if batch.bad else ""),
            flush=True,
        )
        return batch
    finally:
        proc.stop()
        count, lines = odd_lines(log_path)
        record["odd_log_lines"] = count
        record["odd_log_sample"] = lines
        ctx.processes.append(record)


def run_real_horde(ctx: Context, src: Path, rounds: int, slots_list: Sequence[int]) -> dict[str, Any]:
    """Start the real Horde (the served model in its reference, a trusted owner) and
    run both workers against it; ``{"batches", "parameters", "start_s", "stop_s"}``.
    Raises RealHordeError or RuntimeError."""
    parameters = model_parameters(ctx.model)
    entry = {"parameters": parameters or 1_000_000_000, "name": REAL_MODEL}
    horde = RealHorde(src, text_models={REAL_MODEL: entry}, log=lambda line: print(f"  {line}", flush=True))
    batches: list[Batch] = []
    try:
        horde.start()
        run = RealRun(horde, horde.user("bench-owner", trusted=True), horde.user("bench-client", trusted=False))
        print(f"  the real Horde is up at {horde.url} ({horde.timings['start_s']:.0f} s)", flush=True)
        for r in range(rounds):
            order = (OWN, OURS) if r % 2 == 0 else (OURS, OWN)
            for slots in slots_list:
                for worker in order:
                    batches.append(run_real_process(ctx, run, worker, slots, r + 1))
    finally:
        horde.stop()
    return {"batches": batches, "parameters": parameters, "set_up_s": horde.timings.get("set_up_s"),
            "start_s": horde.timings.get("start_s"), "stop_s": horde.timings.get("stop_s")}


def side_by_side(dev: Sequence[Batch], real: Sequence[Batch], slots_list: Sequence[int]) -> list[str]:
    """Lines comparing the dev Horde at 0 ms with the real Horde, per slots setting:
    kudos/job, kudos/hour and jobs/hour of each worker, and ours/own."""
    lines = [f"  {'slots':>5}  {'Horde':<10} {'worker':<8} {'kudos/job':>9} {'kudos/h':>9} {'jobs/h':>8}"]
    for slots in slots_list:
        for label, group in (("dev 0 ms", [b for b in dev if b.latency_ms == 0]), ("real", list(real))):
            med: dict[str, tuple[float, float, float]] = {}
            for worker in (OWN, OURS):
                mine = [b for b in group if b.worker == worker and b.slots == slots]
                if not mine:
                    continue
                med[worker] = (
                    _med([b.kudos / b.ok for b in mine if b.ok]),
                    _med([b.kudos_per_hour for b in mine]),
                    _med([b.jobs_per_hour for b in mine]),
                )
                k, kh, jh = med[worker]
                lines.append(f"  {slots:>5}  {label:<10} {worker:<8} {_num(k, '9.3f')} {_num(kh, '9.1f')} {_num(jh, '8.0f')}")
            if OWN in med and OURS in med:
                (ko, kho, jho), (ku, khu, jhu) = med[OWN], med[OURS]
                lines.append(
                    f"  {slots:>5}  {label:<10} {'ours/own':<8} {_num(ku / ko if ko else float('nan'), '8.3f')}x "
                    f"{_num(khu / kho if kho else float('nan'), '8.3f')}x {_num(jhu / jho if jho else float('nan'), '7.3f')}x"
                )
    return lines


# --------------------------------------------------------------------------------------
# the table and the targets


def _med(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def _num(x: float, fmt: str) -> str:
    return "n/a" if x != x else format(x, fmt)


def summarise(
    batches: Sequence[Batch],
    latencies: Sequence[int],
    slots_list: Sequence[int],
    ceiling: Sequence[float] = (),
) -> tuple[list[str], list[dict[str, Any]]]:
    """The printed table's lines and the figures (with targets) for the JSON.

    ``ceiling``: per koboldcpp process with several slots, the jobs/hour factor of
    koboldcpp alone (slots x a single request's time / the time of that many
    sent at once).
    """

    def pick(worker: str, slots: int, latency: int) -> list[Batch]:
        return sorted(
            (
                b
                for b in batches
                if b.worker == worker and b.slots == slots and b.latency_ms == latency
            ),
            key=lambda b: b.round,
        )

    def paired(a: list[Batch], b: list[Batch], attr: str) -> list[float]:
        rb = {x.round: x for x in b}
        out = []
        for x in a:
            y = rb.get(x.round)
            if y is not None:
                num, den = getattr(x, attr), getattr(y, attr)
                if den and den == den and num == num:
                    out.append(num / den)
        return out

    head = (
        f"  {'slots':>5} {'latency':>7}  {'worker':<8} {'per job s':>9} {'gen s':>6} "
        f"{'busy':>5} {'idle ms':>7} {'kudos/h':>8} {'jobs/h':>7} {'gap ms':>7} "
        f"{'pop->submit s':>13}"
    )
    lines = [head, "  " + "-" * (len(head) - 2)]
    figures: list[dict[str, Any]] = []
    for slots in slots_list:
        for latency in latencies:
            own, ours = pick(OWN, slots, latency), pick(OURS, slots, latency)
            for label, group in ((OWN, own), (OURS, ours)):
                if not group:
                    continue
                lines.append(
                    f"  {slots:>5} {latency:>4} ms  {label:<8} "
                    f"{_num(_med([b.per_job_s for b in group]), '9.3f')} "
                    f"{_num(_med([b.gen_s for b in group]), '6.3f')} "
                    f"{_num(_med([b.busy * 100 for b in group]), '4.0f')}% "
                    f"{_num(_med([b.idle_ms for b in group]), '7.0f')} "
                    f"{_num(_med([b.kudos_per_hour for b in group]), '8.0f')} "
                    f"{_num(_med([b.jobs_per_hour for b in group]), '7.0f')} "
                    f"{_num(_med([b.gap_ms for b in group]), '7.1f') if slots == 1 else '    n/a'} "
                    f"{_num(_med([b.pop_submit_s for b in group]), '13.3f')}"
                )
            if own and ours:
                pj = paired(ours, own, "per_job_s")
                bz = paired(ours, own, "busy")
                kh = paired(ours, own, "kudos_per_hour")
                jh = paired(ours, own, "jobs_per_hour")
                ps = paired(ours, own, "pop_submit_s")
                rown = {b.round: b for b in own}
                gap_diff = [b.gap_ms - rown[b.round].gap_ms for b in ours if b.round in rown]
                idle_diff = [b.idle_ms - rown[b.round].idle_ms for b in ours if b.round in rown]
                lines.append(
                    f"  {slots:>5} {latency:>4} ms  {'ours/own':<8} "
                    f"{_num(_med(pj), '8.3f')}x {'':>6} {_num(_med(bz), '4.2f')}x "
                    f"{_num(_med(idle_diff), '+5.0f')}ms "
                    f"{_num(_med(kh), '7.3f')}x {_num(_med(jh), '6.3f')}x "
                    + (f"{_num(_med(gap_diff), '+5.0f')}ms " if slots == 1 else "    n/a ")
                    + f"{_num(_med(ps), '12.3f')}x"
                )
                # The two workers' koboldcpp runs generate at slightly different speeds
                # (the machine is shared): the same ratios had both generated every job
                # in the mean generation time of this configuration, from each round's idle.
                every = [g for b in own + ours for g in b.gen_times_s]
                g = statistics.fmean(every) if every else float("nan")
                same_kh = [
                    (g + rown[b.round].idle_ms / 1e3) / (g + b.idle_ms / 1e3)
                    for b in ours
                    if b.round in rown
                ]
                lines.append(
                    f"  {slots:>5} {latency:>4} ms  {'same gen':<8} "
                    f"{_num(_med([1 / x for x in same_kh]), '8.3f')}x {g:6.3f} {'':>14} "
                    f"{_num(_med(same_kh), '7.3f')}x"
                )
                cfg = f"{slots} slot{'s' if slots > 1 else ''}, {latency} ms"
                figures.append(
                    figure(
                        f"kudos/hour ours/own at the same generation time, {cfg}",
                        "x",
                        same_kh,
                        limit=1.10 if latency == 150 and slots == 1 else None,
                        better="higher",
                        note=f"both at {g:.3f} s per job, each round's idle",
                    )
                )
                figures.append(
                    figure(
                        f"per-job time ours/own at the same generation time, {cfg}",
                        "x",
                        [1 / x for x in same_kh],
                        limit=1.0 if latency == 0 and slots == 1 else None,
                        note=f"both at {g:.3f} s per job, each round's idle",
                    )
                )
                figures.append(
                    figure(
                        f"kudos/hour ours/own, {cfg}",
                        "x",
                        kh,
                        limit=1.10 if latency == 150 and slots == 1 else None,
                        better="higher",
                        note="per round",
                    )
                )
                figures.append(
                    figure(
                        f"per-job time ours/own, {cfg}",
                        "x",
                        pj,
                        limit=1.0 if latency == 0 and slots == 1 else None,
                    )
                )
            for label, group in ((OWN, own), (OURS, ours)):
                if not group:
                    continue
                cfg = f"{label}, {slots} slot{'s' if slots > 1 else ''}, {latency} ms"
                figures.append(figure(f"per-job time, {cfg}", "s", [b.per_job_s for b in group]))
                figures.append(figure(f"busy fraction, {cfg}", "%", [b.busy * 100 for b in group]))
                figures.append(
                    figure(f"idle slot time per job, {cfg}", "ms", [b.idle_ms for b in group])
                )
                figures.append(
                    figure(f"kudos/hour, {cfg}", "kudos/h", [b.kudos_per_hour for b in group])
                )
                if slots == 1:
                    figures.append(
                        figure(
                            f"gap submit answer -> next pop, {cfg}",
                            "ms",
                            [b.gap_ms for b in group],
                            limit=5.0 if label == OURS and latency == 0 else None,
                            note="median per round",
                        )
                    )
                figures.append(
                    figure(f"pop -> submit, {cfg}", "s", [b.pop_submit_s for b in group])
                )
        lines.append("")
    if 1 in slots_list and any(s > 1 for s in slots_list):
        many = max(slots_list)
        lines.append(f"  {many} slots over 1 slot (jobs/hour, per round, median):")
        for latency in latencies:
            parts = []
            for label in (OWN, OURS):
                one = pick(label, 1, latency)
                factor = paired(pick(label, many, latency), one, "jobs_per_hour")
                if not one or not factor:
                    continue
                parts.append(f"{label} {_num(_med(factor), '.3f')}x")
                figures.append(
                    figure(
                        f"{many}-slot factor (jobs/hour {many} slots / 1), {label}, {latency} ms",
                        "x",
                        factor,
                        limit=1.0 if label == OURS else None,
                        better="higher",
                    )
                )
            lines.append(f"    {latency:>4} ms: " + ", ".join(parts))
        logged = []
        for label in (OWN, OURS):
            for latency in latencies:
                one = {b.round: b for b in pick(label, 1, latency)}
                logged += [
                    many * one[b.round].gen_s / b.gen_s
                    for b in pick(label, many, latency)
                    if b.round in one and b.gen_s > 0
                ]
        if logged:
            lines.append(
                f"    koboldcpp's own generation time of the jobs, one at a time vs {many} at "
                f"once ({many} x the 1-slot median / the {many}-slot median, per batch): "
                f"{_num(_med(logged), '.3f')}x (min {_num(min(logged), '.3f')}, max "
                f"{_num(max(logged), '.3f')})"
            )
            figures.append(
                figure(f"{many}-slot factor of koboldcpp's generation time (log)", "x", logged)
            )
        if ceiling:
            lines.append(
                f"    koboldcpp alone, {many} requests at once vs one at a time (sent straight "
                f"to it, per process): {_num(_med(ceiling), '.3f')}x "
                f"(min {_num(min(ceiling), '.3f')}, max {_num(max(ceiling), '.3f')}): the "
                "factor no worker can beat on this backend"
            )
            figures.append(
                figure(f"{many}-slot factor of koboldcpp alone (direct requests)", "x", ceiling)
            )
    return lines, figures


def target_lines(figures: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for fig in figures:
        if "target" in fig:
            state = "met" if fig["met"] else "MISSED"
            med = fig["median"]
            out.append(
                f"  {fig['name']:<58} {_num(med, '.3f'):>8} {fig['unit']:<3} "
                f"target {fig['target']}: {state}"
            )
    return out


# --------------------------------------------------------------------------------------


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: a comma-separated list of integers, not {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"--{what}: a comma-separated list of integers >= 0, not {text!r}")
    return values


def _command(args: argparse.Namespace) -> str:
    return reproduce(
        "bench_kudos.py",
        "--quick" if args.quick else "",
        "--real-horde" if args.real_horde else "",
        *(
            f"{flag} {value}"
            for flag, value in (
                ("--jobs", args.jobs),
                ("--rounds", args.rounds),
                ("--latency-ms", args.latency_ms),
                ("--slots", args.slots),
                ("--max-length", args.max_length),
            )
            if value is not None
        ),
        env=("KCPP_DIR", "KCPP_MODEL", *(("AI_HORDE_SRC",) if args.real_horde else ())),
    )


def _git_commit(path: Path) -> str:
    """The short commit of the repository at ``path``, and whether the package or the
    patches there differ from it (other files do not count); "?" outside git."""
    head = git(path, "log", "-1", "--format=%h")
    dirty = git(
        path, "status", "--porcelain", "--untracked-files=no", "--", "koboldcpp_horde_chat", "patches"
    )
    return (head or "?") + (" with uncommitted changes to the package" if dirty else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    jobs = args.jobs or (6 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    latencies = _parse_ints(args.latency_ms or "0,150", "latency-ms")
    slots_list = sorted(set(_parse_ints(args.slots or ("1" if args.quick else "1,2"), "slots")))
    if 0 in slots_list:
        raise SystemExit("--slots: at least 1")
    max_length = args.max_length or 48
    command = _command(args)
    title = "kudos per hour, koboldcpp's own embedded worker vs koboldcpp with the patch"
    real_src = source_from_env()
    if args.real_horde:
        title += ", on the dev Horde and the real AI Horde"
        if real_src is None:
            return skipped("kudos", title, command,
                           "--real-horde needs AI_HORDE_SRC, an AI Horde source checkout")
    kdir, model, why = find_koboldcpp()
    if kdir is None or model is None:
        return skipped("kudos", title, command, why)
    work = Path(tempfile.mkdtemp(prefix="bench_kudos_"))
    logs = work / "logs"
    logs.mkdir()
    try:
        tree, own_script, ours_script, release = prepare_tree(kdir, work)
    except RuntimeError as exc:
        shutil.rmtree(work, ignore_errors=True)
        return skipped("kudos", title, command, str(exc))
    result = bench_result("kudos", title, command, [], [])
    pkg = PKG_ROOT.resolve()
    result["package"] = {"root": str(pkg), "commit": _git_commit(pkg)}
    result["koboldcpp"] = {"dir": str(kdir), "release": release, "model": str(model)}
    result["config"] = {
        "jobs": jobs,
        "rounds": rounds,
        "latency_ms": latencies,
        "slots": slots_list,
        "max_length": max_length,
        "max_context_length": MAX_CONTEXT,
        "params": GEN_PARAMS,
    }
    print(
        f"koboldcpp {release} ({kdir}), model {model.name}; package {pkg} "
        f"({result['package']['commit']}); {jobs} jobs x {len(latencies)} latencies x "
        f"{len(slots_list)} slot setting(s) x 2 workers x {rounds} round(s); logs in {logs}",
        flush=True,
    )
    horde = RecordingHorde(api_keys=(API_KEY,))
    horde.start()
    ctx = Context(
        horde=horde,
        tree=tree,
        scripts={OWN: own_script, OURS: ours_script},
        model=model,
        logs=logs,
        pythonpath=str(pkg),
        jobs=jobs,
        max_length=max_length,
    )
    batches: list[Batch] = []
    real: dict[str, Any] | None = None
    t0 = time.monotonic()
    try:
        for r in range(rounds):
            order = (OWN, OURS) if r % 2 == 0 else (OURS, OWN)
            lat_order = list(latencies) if r % 2 == 0 else list(reversed(latencies))
            for slots in slots_list:
                for worker in order:
                    batches += run_process(ctx, worker, slots, lat_order, r + 1)
        if args.real_horde and real_src is not None:
            print("the real AI Horde:", flush=True)
            try:
                real = run_real_horde(ctx, real_src, rounds, slots_list)
            except RealHordeError as exc:
                result["notes"].append(f"the real Horde did not start: {exc}")
    finally:
        stop_all()
        horde.stop()
        shutil.rmtree(tree, ignore_errors=True)
    ceiling = [
        s["slots"] * statistics.median(s["direct"]["single_s"]) / statistics.median(pairs)
        for s in ctx.processes
        if (pairs := s.get("direct", {}).get("pair_s"))
    ]
    lines, figures = summarise(batches, latencies, slots_list, ceiling)
    result["table"] = lines
    result["figures"] = figures
    result["batches"] = [b.row() for b in batches]
    result["processes"] = ctx.processes
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["logs"] = str(logs)
    notes = result["notes"]
    for s in ctx.processes:
        d = s.get("direct", {})
        notes.append(
            f"{s['name']}: ready {s.get('ready_s', '?')} s, first pop {s.get('first_pop_s', '?')} s "
            f"after start; direct gen {d.get('single_s')} s"
            + (f", pairs {d.get('pair_s')} s" if d.get("pair_s") else "")
            + f"; {s.get('odd_log_lines', 0)} log line(s) about errors/busy/warnings"
        )
    bad = [b for b in batches if b.bad or b.ok != b.jobs]
    notes.append(
        "every job submitted and accepted, none faulted, expired or restarted"
        if not bad
        else "jobs that ended badly: "
        + "; ".join(
            f"{b.worker} {b.slots} slot(s) {b.latency_ms} ms round {b.round}: {b.bad}" for b in bad
        )
    )
    same = sum(b.same_text for b in batches)
    total = sum(b.ok for b in batches)
    notes.append(f"generations equal to the direct request's text: {same} of {total}")
    if real is not None:
        rb: list[Batch] = real["batches"]
        lines, figs = summarise(rb, [0], slots_list)
        for fig in figs:
            fig["name"] = "real Horde: " + fig["name"]
            for key in ("target", "limit", "better", "met"):
                fig.pop(key, None)
        result["figures"] += figs
        params = real["parameters"]
        result["real_horde"] = {
            "table": lines,
            "side_by_side": side_by_side(batches, rb, slots_list),
            "batches": [b.row() for b in rb],
            "model": REAL_MODEL,
            "parameters": params,
            "timings_s": {k: real[k] and round(real[k], 1) for k in ("set_up_s", "start_s", "stop_s")},
        }
        bad_real = [b for b in rb if b.bad or b.ok != b.jobs]
        notes.append(
            f"real Horde: {REAL_MODEL} in its model reference with "
            + (f"{params / 1e6:g} M parameters (the model file's name)" if params else
               "1 B parameters (the model file's name gives none)")
            + ", the owner trusted; "
            + ("every job submitted and rewarded, none faulted or aborted" if not bad_real else
               "jobs that ended badly: " + "; ".join(f"{b.worker} {b.slots} slot(s) round {b.round}: {b.bad}"
                                                      for b in bad_real))
        )
    return result


def print_report(result: dict[str, Any]) -> None:
    print(f"== kudos: {result['title']}")
    print("  " + machine_line(result["machine"]))
    print(
        f"  note: {result['machine']['note']}. Ratios ours/own hold across runs; absolute times do not "
        "(koboldcpp gets what the other work leaves of 2 shared cores)"
    )
    if result.get("skipped"):
        print(f"  skipped: {result['skipped']}")
        print(f"  reproduce: {result['command']}")
        return
    cfg = result["config"]
    pkg = result["package"]
    print(
        f"  koboldcpp {result['koboldcpp']['release']}, {Path(result['koboldcpp']['model']).name}; "
        f"package {pkg['root']} ({pkg['commit']})"
    )
    print(
        f"  {cfg['jobs']} text jobs per batch (max_length {cfg['max_length']}, temperature 0, "
        f"fixed seed, ban_eos_token), {cfg['rounds']} round(s); medians over rounds; "
        "ratios per round, then the median"
    )
    for line in result["table"]:
        print(line)
    print(
        "  per job = wall / N (first job pop arrived -> last submit answered); gen = a job's "
        "generation time as koboldcpp logs it; busy = the jobs' generation time / (slots x "
        "wall); idle = (slots x wall - generation time) / N; gap = submit answered -> next "
        "job pop arrived (negative: the pop overlapped the submit); pop->submit = pop "
        "answered -> submit arrived; ours/own rows: ratios, and differences in ms; same gen "
        "rows: the per-job and kudos/hour ratios had both workers' koboldcpp generated each "
        "job in the mean generation time of the configuration (shown), from each round's idle"
    )
    real = result.get("real_horde")
    if real:
        print(
            f"  against the real AI Horde ({real['model']}, a known model of its reference; "
            "its own kudos formula; loopback, no added latency; pop = the job's row, submit = "
            "the owner's credit, both as the Horde's database times them):"
        )
        for line in real["table"]:
            print(line)
        print("  dev Horde at 0 ms and real Horde side by side (medians over rounds):")
        for line in real["side_by_side"]:
            print(line)
        print(f"  real Horde set-up/start/stop: {real['timings_s']} s")
    print("  targets:")
    for line in target_lines(result["figures"]):
        print(line)
    for note in result["notes"]:
        print(f"  - {note}")
    print(f"  koboldcpp logs: {result.get('logs')}")
    print(f"  reproduce: {result['command']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--jobs", type=int, default=None, help="text jobs per batch (20; quick 6)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (3; quick 1)")
    ap.add_argument("--latency-ms", default=None, help="dev Horde latencies, ms (0,150)")
    ap.add_argument("--slots", default=None, help="--parallelrequests settings (1,2; quick 1)")
    ap.add_argument("--max-length", type=int, default=None, help="tokens per job (48)")
    ap.add_argument("--quick", action="store_true", help="6 jobs, 1 round, 1 slot")
    ap.add_argument("--real-horde", action="store_true",
                    help="also serve the jobs from the real AI Horde (AI_HORDE_SRC: its source)")
    add_json(ap)
    args = ap.parse_args(argv)
    stop_on_sigterm()
    try:
        result = run(args)
    except KeyboardInterrupt:
        stop_all()
        print("interrupted; every koboldcpp started was stopped", file=sys.stderr)
        return 130
    print_report(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
