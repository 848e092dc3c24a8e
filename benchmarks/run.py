"""The side-by-side benchmark: the Trio client against vLLM 0.33's real ``AsyncMPClient``,
the vLLM-style asyncio clients and the blocking limit, on the same reference engine, in
one run.

    python -m benchmarks.run [--quick] [--repeats N] [--out DIR] [--clients A,B,...]
                             [--vllm-python PATH|none]
    python -m benchmarks.run --redraw RESULTS_JSON [--out DIR]

The clients: ``trio-batch`` and ``trio-stream`` (ours, batch API and per-request
streams), ``vllm`` (vLLM 0.33's own ``AsyncMPClient``, batch API, run by
``benchmarks/vllm_worker.py`` in the interop environment that ``nox -s interop``
builds), ``asyncio`` (vLLM's client design with our codec), ``asyncio-stream``
(per-request streams served as vLLM's ``AsyncLLM`` serves them, on ``asyncio``) and
``blocking`` (blocking pyzmq, no event loop). The ``vllm`` client is measured when the
vLLM environment is found: ``--vllm-python``, else ``$TRIO_ENGINECORE_VLLM_PYTHON``, else
a complete ``.nox/vllm-0.33-*`` (one with its ``recipe.json``) in this checkout; without one
the report says so (and how to get it) instead of failing.

Every measurement runs in a fresh worker process (``benchmarks/worker.py``) against a
fresh engine process, so CPU accounting is per process and nothing is shared between
clients. Clients alternate (A B C D, A B C D, ...) and every figure is the median of
``--repeats`` runs. The report gives ratios of the Trio figures to the baselines
measured in the same run: machines differ, ratios travel.

Writes ``results.json`` (every run, the medians and the project's performance goals with
their ratios), ``results.md`` (the goals table, then the tables) and ``results.png`` (client
CPU per token against concurrency) into ``--out``: by default ``benchmarks/results/``
for a full run, and a new temporary directory for ``--quick``
(whose figures mean nothing, so it never replaces the committed ones). It says where on
stderr. ``--redraw`` draws ``results.png`` again from an existing ``results.json``.
Progress goes to stderr: one line redrawn in place on a terminal, otherwise a plain
line every few seconds at most.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

VLLM = "vllm"
"""vLLM 0.33's real ``AsyncMPClient`` (``benchmarks/vllm_worker.py``, vLLM's environment)."""
GENERATE_CLIENTS = ["trio-batch", "trio-stream", VLLM, "asyncio", "asyncio-stream", "blocking"]
RECV_CLIENTS = ["trio-batch", VLLM, "asyncio", "blocking"]
UTILITY_CLIENTS = ["trio-batch", VLLM, "asyncio", "blocking"]
ARRAY_CLIENTS = ["trio", "raw-pyzmq", "memcpy"]
ALL_CLIENTS = sorted(
    {*GENERATE_CLIENTS, *RECV_CLIENTS, *UTILITY_CLIENTS, *ARRAY_CLIENTS, "trio-stream"}
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
"""Where the committed figures live: a full run writes here unless told otherwise."""
VLLM_WORKER = BENCH_DIR / "vllm_worker.py"
VLLM_PYTHON_VARIABLE = "TRIO_ENGINECORE_VLLM_PYTHON"
GOAL_STEP_S = 0.0
TUNED_GC_THRESHOLD = (20_000, 10, 10)
"""The collector thresholds of the tuned-GC series (CPython's default: 700, 10, 10)."""
TUNED_GC_CLIENTS = ["trio-batch", "trio-stream", VLLM, "asyncio-stream"]
"""The engine step time of the goals' generate figures (as the goals were set)."""


# ------------------------------------------------------------- vLLM's client


def find_vllm_python(explicit: str | None = None) -> tuple[Path | None, str]:
    """The vLLM environment's interpreter, and how it was found (or why there is none).

    ``explicit`` (``--vllm-python``) first: a path, or ``none`` for no vLLM client;
    then ``$TRIO_ENGINECORE_VLLM_PYTHON``; then the newest complete ``.nox/vllm-0.33-*``
    of this checkout (``nox -s interop`` writes its ``recipe.json`` last; the worker
    is written for vLLM 0.33's client).

    Raises:
        FileNotFoundError: a path was given explicitly and has no interpreter.
    """
    given = explicit if explicit is not None else os.environ.get(VLLM_PYTHON_VARIABLE)
    source = "--vllm-python" if explicit is not None else f"${VLLM_PYTHON_VARIABLE}"
    if given:
        if given.lower() == "none":
            return None, f"not measured: {source} none"
        python = Path(given)
        if not python.exists():
            raise FileNotFoundError(f"{source}: no interpreter at {python}")
        return python, _describe_env(python)
    complete = sorted(
        (marker.parent for marker in (REPO / ".nox").glob("vllm-0.33-*/recipe.json")),
        key=lambda env: env.stat().st_mtime,
    )
    for env in reversed(complete):
        python = env / "bin" / "python"
        if python.exists():
            return python, _describe_env(python)
    return None, (
        "not measured: the vLLM 0.33 interop environment (.nox/vllm-0.33-<hash>) is "
        "absent; `nox -s interop` builds it (once, a few minutes), then `nox -s bench` "
        "measures vLLM 0.33's real AsyncMPClient beside the others"
    )


def _describe_env(python: Path) -> str:
    env = python.absolute().parent.parent
    if env.parent == (REPO / ".nox").absolute() and env.name.startswith("vllm-"):
        return f"the interop environment .nox/{env.name}"
    return str(python)


def vllm_version(python: Path) -> str | None:
    """vLLM's version in that environment, from its installed metadata (no import)."""
    # Not resolved: a venv's bin/python links to the base interpreter.
    for info in python.parent.parent.glob("lib/python*/site-packages/vllm-*.dist-info"):
        return info.name.removeprefix("vllm-").removesuffix(".dist-info")
    return None


def vllm_environment() -> dict[str, str]:
    """The environment of the vLLM worker: this one's less this venv, vLLM's CPU
    platform, its logs on stderr at ERROR only, no telemetry, no hub look-ups."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        VLLM_LOGGING_LEVEL="ERROR",
        VLLM_LOGGING_COLOR="0",
        NO_COLOR="1",
        VLLM_ENGINE_READY_TIMEOUT_S="120",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


# ------------------------------------------------------------------- processes


def engine_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def engine_command(group: dict[str, Any], spec: dict[str, Any]) -> list[str] | None:
    """The command of the process the worker talks to: the reference engine, the
    flooding fake engine of the receive benchmark, or none."""
    if group["workload"] == "recv":
        return [
            sys.executable,
            "-m",
            "benchmarks.flood",
            "--input-address",
            spec["input_address"],
            "--output-address",
            spec["output_address"],
            "--batch",
            str(spec["batch"]),
            "--messages",
            str(spec["messages"]),
        ]
    if group["engine"] is None:
        return None
    return [
        sys.executable,
        "-m",
        "trio_enginecore",
        "serve",
        "--log-level",
        "WARNING",
        "--input-address",
        spec["input_address"],
        "--output-address",
        spec["output_address"],
        *group["engine"],
    ]


def run_worker(group: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement: a fresh engine (if any), a fresh worker process (for the
    ``vllm`` client, ``benchmarks/vllm_worker.py`` in the group's ``vllm_python``
    environment, its stderr kept in a file that a failure quotes)."""
    tmp = tempfile.mkdtemp(prefix="tecb-", dir="/tmp")
    spec = {**spec, "input_address": f"ipc://{tmp}/in", "output_address": f"ipc://{tmp}/out"}
    command = engine_command(group, spec)
    engine = subprocess.Popen(command) if command is not None else None
    stderr_log = None
    try:
        if spec["client"] == VLLM:
            vllm_python = group.get("vllm_python")
            if vllm_python is None:
                raise RuntimeError("the vllm client needs the vLLM environment's python")
            stderr_log = Path(tmp, "vllm-worker.log").open("w")  # noqa: SIM115
            worker = subprocess.Popen(
                # By path, from /tmp: nothing of this checkout is importable there.
                [str(vllm_python), str(VLLM_WORKER), json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=stderr_log,
                text=True,
                env=vllm_environment(),
                cwd=tmp,
            )
        else:
            worker = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
                stdout=subprocess.PIPE,
                text=True,
            )
        assert worker.stdout is not None
        engine_at_ready = None
        last = ""
        for line in worker.stdout:
            line = line.strip()
            if line == "READY" and engine is not None:
                engine_at_ready = engine_cpu_s(engine.pid)
            elif line:
                last = line
        engine_after = None
        if engine is not None and engine.poll() is None:
            engine_after = engine_cpu_s(engine.pid)
        if worker.wait(timeout=600) != 0:
            detail = ""
            if stderr_log is not None:
                stderr_log.flush()
                tail = Path(stderr_log.name).read_text(errors="replace").splitlines()[-30:]
                detail = "\n" + "\n".join(tail)
            raise RuntimeError(f"worker failed for {spec}{detail}")
        result: dict[str, Any] = json.loads(last)
        if engine_at_ready is not None and engine_after is not None:
            result["engine_cpu_s"] = engine_after - engine_at_ready
            if result.get("wall_s"):
                result["engine_cpu_share"] = result["engine_cpu_s"] / result["wall_s"]
        return result
    finally:
        if stderr_log is not None:
            stderr_log.close()
        if engine is not None:
            engine.terminate()
            try:
                engine.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------- the plan


def plan(
    quick: bool, *, vllm_python: Path | None = None, clients: Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """Every measurement group: a spec shared by the clients that are compared.

    ``vllm_python``: the vLLM environment's interpreter, to measure vLLM's own client
    too (generate, recv, utility; a group with it carries it as ``vllm_python``);
    ``clients``: only these (groups left without a client are dropped).
    """
    # Quick: the goals' C = 64 and 512 (not 4096: too slow for a smoke run).
    concurrencies = [64, 512] if quick else [1, 64, 512, 4096]
    step_times = [0.0] if quick else [0.0, 0.002]
    duration = 0.4 if quick else 1.5
    groups: list[dict[str, Any]] = [
        {
            "workload": "generate",
            "clients": GENERATE_CLIENTS,
            "spec": {"concurrency": c, "tokens": 64, "duration_s": duration},
            "engine": ["--step-time-s", repr(step), "--max-num-seqs", str(max(c, 1))],
            "key": {"step_time_s": step, "concurrency": c},
        }
        for step in step_times
        for c in concurrencies
    ]
    # The same generate workload with the collector tuned in every client alike
    # (gc.set_threshold at startup, as the performance guide suggests): what the
    # figures become when an application makes that one-line change.
    groups += [
        {
            "workload": "generate",
            "name": "generate_gc",
            "clients": TUNED_GC_CLIENTS,
            "spec": {
                "concurrency": c,
                "tokens": 64,
                "duration_s": duration,
                "gc_threshold": list(TUNED_GC_THRESHOLD),
            },
            "engine": ["--step-time-s", "0.0", "--max-num-seqs", str(c)],
            "key": {"step_time_s": 0.0, "concurrency": c},
        }
        for c in ([512] if quick else [64, 512, 4096])
    ]
    groups.append(
        {
            "workload": "recv",
            "clients": RECV_CLIENTS,
            "spec": {"batch": 256, "messages": 300 if quick else 3000},
            "engine": None,
            "key": {"batch": 256},
        }
    )
    groups.append(
        {
            "workload": "utility",
            "clients": UTILITY_CLIENTS,
            "spec": {"calls": 50 if quick else 500},
            "engine": [],
            "key": {},
        }
    )
    groups.append(
        {
            "workload": "abort",
            "clients": ["trio-stream", "asyncio", "blocking"],
            "spec": {"samples": 10 if quick else 50},
            "engine": ["--step-time-s", "0.002"],
            "key": {},
        }
    )
    groups.append(
        {
            "workload": "idle_streams",
            "clients": ["trio-stream", "asyncio-stream"],
            "spec": {"streams": 500 if quick else 10_000},
            "engine": ["--max-num-seqs", "16"],
            "key": {},
        }
    )
    groups.append(
        {
            "workload": "array",
            "clients": ARRAY_CLIENTS,
            "spec": {"mib": 8 if quick else 64, "repeats": 3 if quick else 5},
            "engine": None,
            "key": {},
        }
    )
    wanted = set(clients) if clients is not None else None
    selected = []
    for group in groups:
        names = [
            c
            for c in group["clients"]
            if (vllm_python is not None or c != VLLM) and (wanted is None or c in wanted)
        ]
        if names:
            selected.append({**group, "clients": names})
            if VLLM in names:
                selected[-1]["vllm_python"] = vllm_python
    return selected


def execute(groups: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    from trio_enginecore._bench import ProgressLine

    progress = ProgressLine()
    runs: list[dict[str, Any]] = []
    total = sum(len(g["clients"]) for g in groups) * repeats
    done = 0
    started = time.monotonic()
    for group in groups:
        for rep in range(repeats):
            # Rotate the order each repetition: A B C, B C A, ... so that no client
            # always runs first (or last) on a warming machine.
            clients = (
                group["clients"][rep % len(group["clients"]) :]
                + group["clients"][: rep % len(group["clients"])]
            )
            for client in clients:
                spec = {"client": client, "workload": group["workload"], **group["spec"]}
                result = run_worker(group, spec)
                runs.append(
                    {
                        "workload": group.get("name", group["workload"]),
                        "client": client,
                        "rep": rep,
                        **group["key"],
                        **result,
                    }
                )
                done += 1
                elapsed = time.monotonic() - started
                progress.update(
                    f"[{done}/{total}] {group.get('name', group['workload'])} {group['key']} "
                    f"{client}"
                    f"  ({elapsed:.0f} s)"
                )
    progress.done(f"[{done}/{total}] measured in {time.monotonic() - started:.0f} s")
    return runs


# -------------------------------------------------------------------- reporting


def _median(values: Iterable[Any]) -> float:
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    numbers = [v for v in numbers if not math.isnan(v)]
    return statistics.median(numbers) if numbers else math.nan


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, key, client): the median of every numeric figure."""
    grouped: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        key = (run["workload"], run.get("step_time_s"), run.get("concurrency"), run["client"])
        grouped.setdefault(key, []).append(run)
    rows = []
    for (workload, step, c, client), items in grouped.items():
        row: dict[str, Any] = {"workload": workload, "client": client, "runs": len(items)}
        if step is not None:
            row["step_time_s"] = step
        if c is not None:
            row["concurrency"] = c
        names = {k for item in items for k in item} - {
            "workload",
            "client",
            "rep",
            "step_time_s",
            "concurrency",
        }
        for name in sorted(names):
            values = [item.get(name) for item in items]
            if all(isinstance(v, bool) for v in values):
                row[name] = all(values)
            elif any(isinstance(v, int | float) for v in values):
                row[name] = _median(values)
                row[name + "_runs"] = values
        rows.append(row)
    return rows


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _generate_cpu(rows: list[dict[str, Any]], client: str, concurrency: int) -> float | None:
    row = _find(
        rows,
        workload="generate",
        step_time_s=GOAL_STEP_S,
        concurrency=concurrency,
        client=client,
    )
    return None if row is None else row.get("cpu_us_per_token")


def goals(rows: list[dict[str, Any]], machine: dict[str, Any]) -> list[dict[str, Any]]:
    """The performance goals, each with what this run measured for it.

    Every goal has ``figure``, ``goal`` (its text), ``measured`` (one item per figure
    it covers: ``label``, ``value``, ``detail``), ``value`` (the worst of them),
    ``met`` (None when something was not measured) and ``note`` (why not). The
    generate figures are the engine-step-0 ones (``GOAL_STEP_S``), as the goals were set.
    """
    vllm_missing = None if (machine.get("vllm") or {}).get("measured") else "no vLLM client"

    def cpu_ratio(client: str, baseline: str, c: int) -> dict[str, Any]:
        value, base = _generate_cpu(rows, client, c), _generate_cpu(rows, baseline, c)
        missing = [name for name, v in ((client, value), (baseline, base)) if v is None]
        return {
            "label": f"C = {c}",
            "value": _ratio(value, base),
            "detail": f"{_fmt(value, '.2f')} ÷ {_fmt(base, '.2f')} µs/token",
            "missing": f"{', '.join(missing)} at C = {c} not measured" if missing else None,
        }

    def simple(workload: str, client: str, name: str) -> float | None:
        row = _find(rows, workload=workload, client=client)
        return None if row is None else row.get(name)

    recv_trio = simple("recv", "trio-batch", "messages_per_s")
    recv_blocking = simple("recv", "blocking", "messages_per_s")
    utility_trio = simple("utility", "trio-batch", "rtt_p50_s")
    utility_vllm = simple("utility", VLLM, "rtt_p50_s")
    stream_64 = _generate_cpu(rows, "trio-stream", 64)
    stream_4096 = _generate_cpu(rows, "trio-stream", 4096)
    idle_trio = simple("idle_streams", "trio-stream", "bytes_per_stream")
    idle_asyncio = simple("idle_streams", "asyncio-stream", "bytes_per_stream")
    traced_trio = simple("idle_streams", "trio-stream", "traced_bytes_per_stream")
    traced_asyncio = simple("idle_streams", "asyncio-stream", "traced_bytes_per_stream")

    def item(label: str, value: Any, base: Any, detail: str, what: str) -> dict[str, Any]:
        missing = None if value is not None and base is not None else f"{what} not measured"
        return {"label": label, "value": _ratio(value, base), "detail": detail, "missing": missing}

    specs: list[tuple[str, str, str, float, list[dict[str, Any]], bool]] = [
        (
            "batch API client CPU/token ÷ vLLM `AsyncMPClient`, C = 64 and 512",
            "≤ 0.5",
            "<=",
            0.5,
            [cpu_ratio("trio-batch", VLLM, 64), cpu_ratio("trio-batch", VLLM, 512)],
            True,
        ),
        (
            "streams client CPU/token ÷ vLLM `AsyncMPClient` (batch), C = 512",
            "≤ 1.0",
            "<=",
            1.0,
            [cpu_ratio("trio-stream", VLLM, 512)],
            True,
        ),
        (
            "streams ÷ the AsyncLLM-style asyncio per-request streams baseline, C = 512",
            "≤ 0.6",
            "<=",
            0.6,
            [cpu_ratio("trio-stream", "asyncio-stream", 512)],
            False,
        ),
        (
            "receive path ÷ blocking pyzmq loop (256 outputs/message)",
            "≥ 0.9",
            ">=",
            0.9,
            [
                item(
                    "messages/s",
                    recv_trio,
                    recv_blocking,
                    f"{_fmt(recv_trio, ',.0f')} ÷ {_fmt(recv_blocking, ',.0f')} messages/s",
                    "the receive path",
                )
            ],
            False,
        ),
        (
            "stream cost/token, C = 4096 ÷ C = 64",
            "≤ 1.2",
            "<=",
            1.2,
            [
                item(
                    "trio-stream",
                    stream_4096,
                    stream_64,
                    f"{_fmt(stream_4096, '.2f')} ÷ {_fmt(stream_64, '.2f')} µs/token",
                    "trio-stream at C = 64 and 4096",
                )
            ],
            False,
        ),
        (
            "utility round trip p50 ÷ vLLM `AsyncMPClient`",
            "≤ 0.8",
            "<=",
            0.8,
            [
                item(
                    "p50",
                    utility_trio,
                    utility_vllm,
                    f"{_fmt(None if utility_trio is None else 1e6 * utility_trio, '.0f')} ÷ "
                    f"{_fmt(None if utility_vllm is None else 1e6 * utility_vllm, '.0f')} µs",
                    "the utility round trip",
                )
            ],
            True,
        ),
    ]
    out: list[dict[str, Any]] = []
    for figure, goal, op, limit, measured, needs_vllm in specs:
        out.append(_goal(figure, goal, op, limit, measured, vllm_missing if needs_vllm else None))
    memory = {
        "label": "trio-stream",
        "value": idle_trio if idle_trio is not None else math.nan,
        "detail": f"asyncio-stream {_fmt(idle_asyncio, ',.0f')} bytes; held by Python "
        f"(tracemalloc): {_fmt(traced_trio, ',.0f')} bytes, asyncio-stream "
        f"{_fmt(traced_asyncio, ',.0f')}",
        "missing": None if idle_trio is not None else "idle streams not measured",
    }
    out.append(_goal("memory per idle stream (bytes)", "≤ 2.5 KB", "<=", 2500.0, [memory], None))
    return out


def _goal(
    figure: str,
    goal: str,
    op: str,
    limit: float,
    measured: list[dict[str, Any]],
    missing_client: str | None,
) -> dict[str, Any]:
    notes = [m.pop("missing") for m in measured]
    notes = [n for n in notes if n]
    if missing_client is not None:
        notes.insert(0, missing_client)
    values = [m["value"] for m in measured if not math.isnan(m["value"])]
    complete = len(values) == len(measured) and not notes
    worst = math.nan
    if values:
        worst = max(values) if op == "<=" else min(values)
    met = None
    if complete:
        met = worst <= limit if op == "<=" else worst >= limit
    return {
        "figure": figure,
        "goal": goal,
        "op": op,
        "limit": limit,
        "measured": measured,
        "value": worst,
        "met": met,
        "note": "; ".join(dict.fromkeys(notes)) or None,
    }


def goals_table(goal_rows: list[dict[str, Any]], machine: dict[str, Any]) -> list[str]:
    out = [
        "## Goals",
        "",
        f"Ratios from this run; generate figures at engine step {GOAL_STEP_S * 1e3:g} ms, "
        "T = 64. `met` takes the worst figure of a row.",
        "",
        "| figure | measured | goal | met |",
        "|---|---|---|---|",
    ]
    for goal in goal_rows:
        cells = []
        for m in goal["measured"]:
            if math.isnan(m["value"]):
                continue
            value = _fmt(m["value"], ",.0f" if goal["limit"] > 100 else ".2f")
            label = f" {m['label']}" if len(goal["measured"]) > 1 else ""
            cells.append(f"{value}{label} ({m['detail']})")
        measured = "; ".join(cells)
        if goal["note"]:
            measured = f"{measured}; " if measured else ""
            measured += f"not measured: {goal['note']}"
        met = {True: "yes", False: "**no**", None: "-"}[goal["met"]]
        out.append(f"| {goal['figure']} | {measured} | {goal['goal']} | {met} |")
    vllm = machine.get("vllm") or {}
    if not vllm.get("measured"):
        out += ["", f"vLLM's `AsyncMPClient`: {vllm.get('note', 'not measured')}."]
    return [*out, ""]


def _vllm_line(machine: dict[str, Any]) -> str:
    vllm = machine.get("vllm") or {}
    if vllm.get("measured"):
        return (
            f"`vllm` is vLLM {vllm.get('version') or '?'}'s own `AsyncMPClient` "
            f"(batch API, `client_addresses`, vLLM's `EngineCoreRequest`s), run in "
            f"{vllm.get('source')}, its startup heap frozen by vLLM's `freeze_gc_heap()` "
            "as vLLM's API server does (every other client's startup heap is frozen "
            "alike, with `gc.freeze()`)."
        )
    return f"**vLLM's `AsyncMPClient`: {vllm.get('note', 'not measured')}.**"


GENERATE_BASELINES = [VLLM, "asyncio", "asyncio-stream", "blocking"]


def _ratio_header(baseline: str) -> str:
    return f"CPU/token ÷ {baseline}" if baseline in (VLLM, "asyncio") else f"÷ {baseline}"


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any], quick: bool) -> str:
    out = [
        "# trio-enginecore benchmark",
        "",
        f"Measured {machine['date']} on {machine['cpus']} CPUs ({machine['processor']}), "
        f"Python {machine['python']}, {machine['platform']}."
        + (" **Quick mode: tiny sizes, figures are not meaningful.**" if quick else ""),
        "Medians of the runs; ratios compare with baselines measured in the same run. CPU is "
        "the client process's CPU time (not wall time). `engine` is the engine process's CPU "
        "share of the wall time: near 100 % means the engine, not the client, set the pace.",
        _vllm_line(machine),
        "",
        *goals_table(goals(rows, machine), machine),
    ]
    measured = {r["client"] for r in rows if r["workload"] == "generate"}
    # A baseline this run did not measure (vLLM without its environment) gets no column.
    baselines = [b for b in GENERATE_BASELINES if b in measured]
    for step in sorted({r["step_time_s"] for r in rows if r["workload"] == "generate"}):
        out += _generate_table(
            rows,
            "generate",
            step,
            f"Generate, T = 64 tokens per request, engine step {step * 1e3:g} ms",
            baselines,
        )
    if any(r["workload"] == "generate_gc" for r in rows):
        tuned = {r["client"] for r in rows if r["workload"] == "generate_gc"}
        out += [
            "## Generate with the collector tuned, T = 64, engine step 0 ms",
            "",
            "Every client of this table sets `gc.set_threshold"
            f"{TUNED_GC_THRESHOLD}` once connected (after freezing its startup heap, as "
            "in every table): the one-line change the performance guide suggests to an "
            "application serving thousands of streams. Ratios are within this table.",
            *_tuned_summary(rows),
        ]
        out += _generate_table(
            rows, "generate_gc", 0.0, None, [b for b in GENERATE_BASELINES if b in tuned]
        )
    out += _simple_table(
        rows,
        "recv",
        "Receive path: messages of 256 outputs, as fast as they come",
        [("messages/s", "messages_per_s", ",.0f"), ("CPU µs/msg", "cpu_us_per_message", ".1f")],
        ratio_of="messages_per_s",
        baselines=[("blocking", ".2f"), (VLLM, ".2f")],
    )
    out += _simple_table(
        rows,
        "utility",
        "Utility call round trip (sequential is_sleeping)",
        [
            ("p50 µs", "rtt_p50_s", "us"),
            ("p99 µs", "rtt_p99_s", "us"),
            ("CPU µs/call", "cpu_us_per_call", ".1f"),
        ],
        ratio_of="rtt_p50_s",
        baselines=[(VLLM, ".2f"), ("asyncio", ".2f")],
    )
    out += _simple_table(
        rows,
        "abort",
        "Abort latency (cancel -> engine holds nothing; includes one utility RTT)",
        [("p50 ms", "abort_p50_s", "ms"), ("p99 ms", "abort_p99_s", "ms")],
        ratio_of="abort_p50_s",
        baselines=[("asyncio", ".2f")],
    )
    out += _simple_table(
        rows,
        "idle_streams",
        "Memory per open, idle stream",
        [
            ("streams", "streams", ",.0f"),
            ("bytes/stream", "bytes_per_stream", ",.0f"),
            ("traced bytes/stream", "traced_bytes_per_stream", ",.0f"),
        ],
        ratio_of="bytes_per_stream",
        baselines=[("asyncio-stream", ".2f")],
    )
    out += _simple_table(
        rows,
        "array",
        "A numpy array through encode -> ipc -> decode",
        [
            ("MiB", "mib", ".0f"),
            ("GB/s", "gb_per_s", ".2f"),
            ("rx CPU ms/msg", "rx_cpu_ms_per_msg", ".1f"),
        ],
        ratio_of="gb_per_s",
        baselines=[("raw-pyzmq", ".2f"), ("memcpy", ".3f")],
    )
    return "\n".join(out) + "\n"


def _generate_table(
    rows: list[dict[str, Any]],
    workload: str,
    step: float,
    title: str | None,
    baselines: list[str],
) -> list[str]:
    """One generate table (a row per concurrency and client) with its ratio columns."""
    out = [f"## {title}", ""] if title is not None else [""]
    out += [
        "| C | client | tokens/s | CPU µs/token | CPU µs/msg | p50 ms | p99 ms | engine "
        + "".join(f"| {_ratio_header(b)} " for b in baselines)
        + "|",
        "|---:|---|---:|---:|---:|---:|---:|---:" + "|---:" * len(baselines) + "|",
    ]
    for c in sorted({r["concurrency"] for r in rows if r["workload"] == workload}):
        base = {
            cl: _find(rows, workload=workload, step_time_s=step, concurrency=c, client=cl)
            for cl in GENERATE_CLIENTS
        }
        for client in GENERATE_CLIENTS:
            row = base[client]
            if row is None:
                continue
            cpu = row.get("cpu_us_per_token")
            ratios = " | ".join(
                _fmt(_ratio(cpu, (base[b] or {}).get("cpu_us_per_token")), ".2f") for b in baselines
            )
            out.append(
                f"| {c} | {client} | {_fmt(row.get('tokens_per_s'), ',.0f')} | "
                f"{_fmt(cpu, '.2f')} | {_fmt(row.get('cpu_us_per_message'), '.1f')} | "
                f"{_fmt(1e3 * row.get('latency_p50_s', math.nan), '.1f')} | "
                f"{_fmt(1e3 * row.get('latency_p99_s', math.nan), '.1f')} | "
                f"{_fmt(100 * row.get('engine_cpu_share', math.nan), '.0f')} % | "
                f"{ratios} |"
            )
    out.append("")
    return out


def _tuned_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The goals' generate ratios again, from the tuned-GC series."""

    def cpu(client: str, c: int) -> float | None:
        row = _find(rows, workload="generate_gc", concurrency=c, client=client)
        return None if row is None else row.get("cpu_us_per_token")

    items = [
        ("batch API ÷ vLLM, C = 64", cpu("trio-batch", 64), cpu(VLLM, 64)),
        ("batch API ÷ vLLM, C = 512", cpu("trio-batch", 512), cpu(VLLM, 512)),
        ("streams ÷ vLLM (batch), C = 512", cpu("trio-stream", 512), cpu(VLLM, 512)),
        ("streams ÷ asyncio-stream, C = 512", cpu("trio-stream", 512), cpu("asyncio-stream", 512)),
        ("streams, C = 4096 ÷ C = 64", cpu("trio-stream", 4096), cpu("trio-stream", 64)),
    ]
    lines = [
        f"- {label}: {_fmt(_ratio(a, b), '.2f')} ({_fmt(a, '.2f')} ÷ {_fmt(b, '.2f')} µs/token)"
        for label, a, b in items
        if a is not None and b is not None
    ]
    return ["", "The goals' generate ratios in this series:", "", *lines] if lines else []


def _simple_table(
    rows: list[dict[str, Any]],
    workload: str,
    title: str,
    columns: list[tuple[str, str, str]],
    *,
    ratio_of: str,
    baselines: list[tuple[str, str]],
) -> list[str]:
    selected = [r for r in rows if r["workload"] == workload]
    if not selected:
        return []
    present = {r["client"] for r in selected}
    # A baseline this run did not measure (vLLM without its environment) gets no column.
    baselines = [(b, spec) for b, spec in baselines if b in present]
    base = {b: _find(rows, workload=workload, client=b) for b, _ in baselines}
    header = ["client", *(c[0] for c in columns), *(f"÷ {b}" for b, _ in baselines)]
    out = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in selected:
        cells = [row["client"]]
        for _, name, spec in columns:
            value = row.get(name)
            if spec == "us":
                cells.append(_fmt(None if value is None else 1e6 * value, ".0f"))
            elif spec == "ms":
                cells.append(_fmt(None if value is None else 1e3 * value, ".2f"))
            else:
                cells.append(_fmt(value, spec))
        for b, spec in baselines:
            cells.append(_fmt(_ratio(row.get(ratio_of), (base[b] or {}).get(ratio_of)), spec))
        out.append("| " + " | ".join(cells) + " |")
    return [*out, ""]


def panel_title(step_time_s: float) -> str:
    """The title of one panel of the chart: what it shows, and which way is better."""
    return f"engine step {step_time_s * 1e3:g} ms, T = 64: lower is better"


def figure_caption(machine: dict[str, Any], quick: bool) -> str:
    """The chart's caption: when and where it was measured (as in results.md)."""
    caption = (
        f"Measured {machine['date']} on {machine['cpus']} CPUs ({machine['processor']}), "
        f"Python {machine['python']}, {machine['platform']}. Medians; client process CPU time."
    )
    if quick:
        caption += " Quick mode: not meaningful."
    return caption


def chart(
    rows: list[dict[str, Any]], path: Path, machine: dict[str, Any], *, quick: bool = False
) -> bool:
    """Client CPU per token against concurrency, one line per client and step time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return False
    steps = sorted({r["step_time_s"] for r in rows if r["workload"] == "generate"})
    fig, axes = plt.subplots(1, len(steps), figsize=(6 * len(steps), 5), squeeze=False)
    for ax, step in zip(axes[0], steps, strict=True):
        for client in GENERATE_CLIENTS:
            points = sorted(
                (r["concurrency"], r["cpu_us_per_token"])
                for r in rows
                if r["workload"] == "generate"
                and r["step_time_s"] == step
                and r["client"] == client
            )
            if points:
                # vLLM's own client is the reference line: black and dashed.
                style = {"color": "black", "linestyle": "--"} if client == VLLM else {}
                label = "vllm (vLLM's AsyncMPClient)" if client == VLLM else client
                ax.plot(*zip(*points, strict=True), marker="o", label=label, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests (C)")
        ax.set_ylabel("client CPU µs per output token (lower is better)")
        ax.set_title(panel_title(step))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.text(
        0.5, 0.01, figure_caption(machine, quick), ha="center", va="bottom", fontsize=8, wrap=True
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine_info() -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def output_dir(out: Path | None, *, quick: bool) -> Path:
    """Where a run writes: ``out`` if given, else the committed results for a full run
    and a new temporary directory for a quick one.

    Raises:
        ValueError: a quick run told to write over the committed results.
    """
    if out is None:
        if quick:
            return Path(tempfile.mkdtemp(prefix="trio-enginecore-bench-quick-"))
        return RESULTS_DIR
    if quick and out.resolve() == RESULTS_DIR:
        raise ValueError(
            f"a --quick run does not replace the committed figures in {RESULTS_DIR}; "
            "give another --out (or none, for a temporary directory)"
        )
    return out


def redraw(results_json: Path, out: Path | None) -> Path | None:
    """Draw ``results.png`` again from a ``results.json`` (into ``out``, by default the
    JSON file's directory); the path drawn, or None without matplotlib."""
    data = json.loads(results_json.read_text())
    path = (out if out is not None else results_json.parent) / "results.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    drawn = chart(data["medians"], path, data["machine"], quick=bool(data.get("quick")))
    return path if drawn else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="A full run writes benchmarks/results/ by default; a --quick run writes a "
        "new temporary directory. Either says where on stderr.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (3; quick 1)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to write results.{json,md,png} (default: benchmarks/results for a full "
        "run, a new temporary directory for --quick)",
    )
    parser.add_argument(
        "--clients",
        default=None,
        metavar="A,B,...",
        help=f"measure only these clients (of {', '.join(ALL_CLIENTS)})",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH|none",
        help="the vLLM environment's python for the vllm client, or none (default: "
        f"${VLLM_PYTHON_VARIABLE}, else a complete .nox/vllm-0.33-* of this checkout)",
    )
    parser.add_argument(
        "--redraw",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="measure nothing: draw results.png again from this results.json (into --out, "
        "by default beside it)",
    )
    args = parser.parse_args(argv)
    if args.redraw is not None:
        drawn = redraw(args.redraw, args.out)
        if drawn is None:
            return 1
        print(f"chart written to {drawn}", file=sys.stderr)
        return 0
    try:
        out = output_dir(args.out, quick=args.quick)
    except ValueError as exc:
        parser.error(str(exc))
    repeats = args.repeats or (1 if args.quick else 3)
    clients = None
    if args.clients is not None:
        clients = [c.strip() for c in args.clients.split(",") if c.strip()]
        unknown = sorted(set(clients) - set(ALL_CLIENTS))
        if unknown:
            parser.error(f"unknown clients {unknown}; known: {', '.join(ALL_CLIENTS)}")
    try:
        vllm_python, vllm_source = find_vllm_python(args.vllm_python)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    vllm: dict[str, Any] = {"measured": False, "note": vllm_source}
    if clients is not None and VLLM not in clients:
        vllm_python, vllm["note"] = None, "not measured: not in --clients"
    elif vllm_python is not None:
        vllm = {
            "measured": True,
            "python": str(vllm_python),
            "source": vllm_source,
            "version": vllm_version(vllm_python),
        }
    print(f"vLLM's AsyncMPClient: {vllm.get('source') or vllm['note']}", file=sys.stderr)
    groups = plan(args.quick, vllm_python=vllm_python, clients=clients)
    started = time.monotonic()
    runs = execute(groups, repeats)
    rows = medians(runs)
    machine = {**machine_info(), "vllm": vllm, "run_seconds": round(time.monotonic() - started)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "quick": args.quick,
                "repeats": repeats,
                "goals": goals(rows, machine),
                "medians": rows,
                "runs": runs,
            },
            indent=1,
            default=str,
        )
    )
    report = markdown(rows, machine, args.quick)
    (out / "results.md").write_text(report)
    chart(rows, out / "results.png", machine, quick=args.quick)
    print(report)
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
