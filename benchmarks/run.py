"""The side-by-side benchmark: the Trio client against the vLLM-style asyncio client and
the blocking limit, on the same reference engine, in one run.

    python -m benchmarks.run [--quick] [--repeats N] [--out DIR]
    python -m benchmarks.run --redraw RESULTS_JSON [--out DIR]

Every measurement runs in a fresh worker process (``benchmarks/worker.py``) against a
fresh engine process, so CPU accounting is per process and nothing is shared between
clients. Clients alternate (A B C D, A B C D, ...) and every figure is the median of
``--repeats`` runs. The report gives ratios of the Trio figures to the baselines
measured in the same run: machines differ, ratios travel.

Writes ``results.json`` (every run and the medians), ``results.md`` (the tables) and
``results.png`` (client CPU per token against concurrency) into ``--out``: by default
``benchmarks/results/`` for a full run, and a new temporary directory for ``--quick``
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

GENERATE_CLIENTS = ["trio-batch", "trio-stream", "asyncio", "blocking"]
RECV_CLIENTS = ["trio-batch", "asyncio", "blocking"]
ARRAY_CLIENTS = ["trio", "raw-pyzmq", "memcpy"]
CLK_TCK = os.sysconf("SC_CLK_TCK")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where the committed figures live: a full run writes here unless told otherwise."""


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
    """Run one measurement: a fresh engine (if any), a fresh worker process."""
    tmp = tempfile.mkdtemp(prefix="tecb-", dir="/tmp")
    spec = {**spec, "input_address": f"ipc://{tmp}/in", "output_address": f"ipc://{tmp}/out"}
    command = engine_command(group, spec)
    engine = subprocess.Popen(command) if command is not None else None
    try:
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
            raise RuntimeError(f"worker failed for {spec}")
        result: dict[str, Any] = json.loads(last)
        if engine_at_ready is not None and engine_after is not None:
            result["engine_cpu_s"] = engine_after - engine_at_ready
            if result.get("wall_s"):
                result["engine_cpu_share"] = result["engine_cpu_s"] / result["wall_s"]
        return result
    finally:
        if engine is not None:
            engine.terminate()
            try:
                engine.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------- the plan


def plan(quick: bool) -> list[dict[str, Any]]:
    """Every measurement group: a spec shared by the clients that are compared."""
    concurrencies = [1, 64] if quick else [1, 64, 512, 4096]
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
            "clients": ["trio-batch", "asyncio", "blocking"],
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
            "clients": ["trio-stream", "asyncio"],
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
    return groups


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
                        "workload": group["workload"],
                        "client": client,
                        "rep": rep,
                        **group["key"],
                        **result,
                    }
                )
                done += 1
                elapsed = time.monotonic() - started
                progress.update(
                    f"[{done}/{total}] {group['workload']} {group['key']} {client}"
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
        "",
    ]
    for step in sorted({r["step_time_s"] for r in rows if r["workload"] == "generate"}):
        out += [
            f"## Generate, T = 64 tokens per request, engine step {step * 1e3:g} ms",
            "",
            "| C | client | tokens/s | CPU µs/token | CPU µs/msg | p50 ms | p99 ms | engine "
            "| CPU/token ÷ asyncio | CPU/token ÷ blocking |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in sorted({r["concurrency"] for r in rows if r["workload"] == "generate"}):
            base = {
                cl: _find(rows, workload="generate", step_time_s=step, concurrency=c, client=cl)
                for cl in GENERATE_CLIENTS
            }
            for client in GENERATE_CLIENTS:
                row = base[client]
                if row is None:
                    continue
                cpu = row.get("cpu_us_per_token")
                asyncio_cpu = (base["asyncio"] or {}).get("cpu_us_per_token")
                blocking_cpu = (base["blocking"] or {}).get("cpu_us_per_token")
                out.append(
                    f"| {c} | {client} | {_fmt(row.get('tokens_per_s'), ',.0f')} | "
                    f"{_fmt(cpu, '.2f')} | {_fmt(row.get('cpu_us_per_message'), '.1f')} | "
                    f"{_fmt(1e3 * row.get('latency_p50_s', math.nan), '.1f')} | "
                    f"{_fmt(1e3 * row.get('latency_p99_s', math.nan), '.1f')} | "
                    f"{_fmt(100 * row.get('engine_cpu_share', math.nan), '.0f')} % | "
                    f"{_fmt(_ratio(cpu, asyncio_cpu), '.2f')} | "
                    f"{_fmt(_ratio(cpu, blocking_cpu), '.2f')} |"
                )
        out.append("")
    out += _simple_table(
        rows,
        "recv",
        "Receive path: messages of 256 outputs, as fast as they come",
        [("messages/s", "messages_per_s", ",.0f"), ("CPU µs/msg", "cpu_us_per_message", ".1f")],
        ratio_of="messages_per_s",
        baseline="blocking",
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
        baseline="asyncio",
    )
    out += _simple_table(
        rows,
        "abort",
        "Abort latency (cancel -> engine holds nothing; includes one utility RTT)",
        [("p50 ms", "abort_p50_s", "ms"), ("p99 ms", "abort_p99_s", "ms")],
        ratio_of="abort_p50_s",
        baseline="asyncio",
    )
    out += _simple_table(
        rows,
        "idle_streams",
        "Memory per open, idle stream",
        [("streams", "streams", ",.0f"), ("bytes/stream", "bytes_per_stream", ",.0f")],
        ratio_of="bytes_per_stream",
        baseline="asyncio",
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
        baseline="raw-pyzmq",
        extra_baseline="memcpy",
    )
    return "\n".join(out) + "\n"


def _simple_table(
    rows: list[dict[str, Any]],
    workload: str,
    title: str,
    columns: list[tuple[str, str, str]],
    *,
    ratio_of: str,
    baseline: str,
    extra_baseline: str | None = None,
) -> list[str]:
    selected = [r for r in rows if r["workload"] == workload]
    if not selected:
        return []
    base = _find(rows, workload=workload, client=baseline)
    extra = _find(rows, workload=workload, client=extra_baseline) if extra_baseline else None
    header = ["client", *(c[0] for c in columns), f"÷ {baseline}"]
    if extra_baseline:
        header.append(f"÷ {extra_baseline}")
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
        cells.append(_fmt(_ratio(row.get(ratio_of), (base or {}).get(ratio_of)), ".2f"))
        if extra_baseline:
            cells.append(_fmt(_ratio(row.get(ratio_of), (extra or {}).get(ratio_of)), ".3f"))
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
                ax.plot(*zip(*points, strict=True), marker="o", label=client)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests (C)")
        ax.set_ylabel("client CPU µs per output token (lower is better)")
        ax.set_title(panel_title(step))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.text(0.5, 0.01, figure_caption(machine, quick), ha="center", va="bottom", fontsize=8)
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
    groups = plan(args.quick)
    runs = execute(groups, repeats)
    rows = medians(runs)
    machine = machine_info()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "quick": args.quick,
                "repeats": repeats,
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
